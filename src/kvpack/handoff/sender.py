"""The producer side of Handoff V2 (INTEROP C.3-C.6, C.8 from the other end), sans-I/O.

The sender turns verbs into wire bytes and checks the one frame it ever reads (the ack):

    s = Sender(manifest, key, prefix_cut=0)
    out = s.begin()                         # [bytes]
    out = s.send_segment(payload, intent)   # [bytes header, payload]  (payload not copied)
    out = s.seal()                          # [bytes]
    s.receive_data(bytes_from_receiver)     # -> Ack once the matching ack arrived
    out = s.abort()                         # {"kind":"abort","reason":"producer failure"}

Declared mode: the begin lists every descriptor (use :func:`declare_segments` to build them
from the payloads); ``send_segment(payload)`` checks the length and streams. Deferred mode
(``manifest.deferred_segments``): each ``send_segment(payload, intent)`` hashes the payload
and ships the complete descriptor in the frame, the way a streaming prefill producer must
because future tiles do not exist at begin time. The seal binds the canonical begin (without
``prefix_cut``), the concatenated descriptors, and every payload byte.

Output buffers are a list suitable for ``socket.sendmsg``/``writelines``: segment payloads
are the caller's buffer by reference. The caller must not mutate a payload until it has
been written out; its digest was taken when ``send_segment`` was called.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, NoReturn, Optional, Sequence, TypeVar

from ..errors import ProtocolError
from ..vocab import is_token_aligned, sha256_hex
from .events import Abort, Ack, Begin, Seal, Segment
from .events import Frame
from .target import PayloadTarget
from .frames import FrameDecoder, FrameLimits, WireBuffers, encode_frame
from .hashing import INLINE
from .manifest import (
    BeginManifestV2,
    OverlapTracker,
    SealAccumulator,
    SealManifestV2,
    SegmentDescriptorV2,
    check_descriptor,
    seal_tag,
    validate_begin,
)
from .schedule import SpanSegment
from .state import SenderState, SENDER_TRANSITIONS, transition

PRODUCER_FAILURE = "producer failure"
_DEFAULT_LIMITS = FrameLimits()  # frozen: safe to share

#: A segment payload as callers hand it in (any contiguous buffer; viewed as bytes, never copied).
Payload = bytes | bytearray | memoryview
_T = TypeVar("_T")


def descriptor_for(
    intent: SpanSegment | SegmentDescriptorV2, sequence: int, payload: "Payload | PayloadTarget", sha256: str | None = None
) -> SegmentDescriptorV2:
    """A full descriptor for ``payload`` shaped as ``intent`` (upstream ``descriptor_for``).
    ``sha256`` may carry the payload digest when the caller already computed it (it must
    for a payload in pieces)."""
    if isinstance(payload, PayloadTarget):
        if sha256 is None:
            raise ValueError("a payload in pieces needs its digest")
        return _descriptor(intent, sequence, payload.nbytes, sha256)
    view = memoryview(payload).cast("B")
    return _descriptor(intent, sequence, view.nbytes, sha256 if sha256 is not None else sha256_hex(view))


def _descriptor(intent: SpanSegment | SegmentDescriptorV2, sequence: int, nbytes: int, sha256: str) -> SegmentDescriptorV2:
    return SegmentDescriptorV2(
        sequence=sequence,
        component_id=intent.component_id,
        role=intent.role,
        layer=intent.layer,
        logical_start=intent.logical_start,
        logical_count=intent.logical_count,
        element_type=intent.element_type,
        elements_per_token=intent.elements_per_token,
        byte_len=nbytes,
        sha256=sha256,
    )


def declare_segments(intents: Sequence[SpanSegment], payloads: Sequence[Payload]) -> tuple[SegmentDescriptorV2, ...]:
    """Declared-mode descriptors: one hash per payload, sequences 0..n-1 in order."""
    if len(intents) != len(payloads):
        raise ValueError("one payload per intent")
    return tuple(descriptor_for(i, n, p) for n, (i, p) in enumerate(zip(intents, payloads)))


class Sender:
    """Producer state machine: IDLE -> STREAMING -> AWAIT_ACK -> DONE (or CLOSED)."""

    def __init__(
        self,
        manifest: BeginManifestV2,
        key: bytes,
        *,
        prefix_cut: int = 0,
        limits: FrameLimits = _DEFAULT_LIMITS,
        hash_executor: Executor = INLINE,
    ) -> None:
        """``hash_executor`` runs a large deferred segment's own digest while this thread
        feeds the running payload digest (a driver's thread pool); the default hashes both
        here, in turn. The bytes on the wire are identical either way."""
        if len(key) != 32:
            raise ValueError("Handoff V2 seal keys are 32 bytes")
        # Self-consistency check with the manifest's own key and clock: the sender has no
        # clock of its own, and refusing a malformed begin locally beats a remote refusal.
        validate_begin(
            manifest,
            now_unix_ms=manifest.created_unix_ms,
            expected_key_id=manifest.hmac.key_id,
            minimum_epoch=0,
        )
        if prefix_cut < 0 or (prefix_cut and (not is_token_aligned(prefix_cut) or prefix_cut >= manifest.position)):
            # Upstream DeferredHandoffV2Sender: 256-aligned and inside the prompt.
            raise ProtocolError("delta", "prefix_cut must be 256-aligned and inside the prompt", remote=False)
        self.manifest = manifest
        self.prefix_cut = prefix_cut
        self.limits = limits
        self._hash_executor = hash_executor
        self._key = bytes(key)
        self.state = SenderState.IDLE
        self._acc = SealAccumulator()
        self._overlap = OverlapTracker()
        self._ids = {c.id for c in manifest.components}
        self._seen: set[str] = set()
        self._next = 0
        self._decoder: Optional[FrameDecoder] = None
        self.seal_manifest: Optional[SealManifestV2] = None
        self.error: Optional[ProtocolError] = None

    @property
    def deferred(self) -> bool:
        return self.manifest.deferred_segments

    @property
    def segments_sent(self) -> int:
        return self._next

    @property
    def bytes_sent(self) -> int:
        return self._acc.total_bytes

    # -- verbs --------------------------------------------------------------------------

    def begin(self) -> WireBuffers:
        return self._guard("begin", self._begin)

    def send_segment(self, payload: "Payload | PayloadTarget", intent: SpanSegment | SegmentDescriptorV2 | None = None) -> WireBuffers:
        return self._guard("segment", self._segment, payload, intent)

    def seal(self) -> WireBuffers:
        return self._guard("seal", self._seal)

    def receive_data(self, data: bytes | bytearray | memoryview) -> Optional[Ack]:
        """Bytes from the receiver. Returns the Ack when the one matching ack completed."""
        decoder = self._decoder  # made by the seal, the step that enters AWAIT_ACK
        if self.state is not SenderState.AWAIT_ACK or decoder is None:
            self._fail(ProtocolError("state", f"data from the receiver in state {self.state.value}"))
        try:
            frames = decoder.feed(data)
        except ProtocolError as exc:
            self._fail(exc)
        if not frames:
            return None
        if len(frames) > 1:
            self._fail(ProtocolError("state", "more than one frame after the seal"))
        return self.receive_frame(frames[0])

    def receive_frame(self, frame: Frame) -> Ack:
        kind = type(frame).__name__.lower()
        return self._guard(kind, self._ack, frame, remote=True)

    def abort(self, reason: str = PRODUCER_FAILURE) -> WireBuffers:
        """Give up. Emits an abort frame if the receiver has seen a begin and not acked."""
        if self.state in (SenderState.DONE, SenderState.CLOSED):
            return []
        sent_begin = self.state is not SenderState.IDLE
        self.state = SenderState.CLOSED
        return encode_frame(Abort(reason), self.limits) if sent_begin else []

    # -- handlers -----------------------------------------------------------------------

    def _guard(self, event: str, handler: Callable[..., _T], *args: Any, remote: bool = False) -> _T:
        try:
            new_state = transition(SENDER_TRANSITIONS, self.state, event, remote=remote)
            out = handler(*args)
        except ProtocolError as exc:
            self._fail(exc)
        except (TypeError, ValueError) as exc:
            self._fail(ProtocolError("state", f"invalid {event}: {exc}", remote=False))
        self.state = new_state
        return out

    def _fail(self, exc: ProtocolError) -> NoReturn:
        self.error = exc
        self.state = SenderState.CLOSED
        raise exc

    def _begin(self) -> WireBuffers:
        return encode_frame(Begin(self.manifest, self.prefix_cut), self.limits)

    def _segment(self, payload: "Payload | PayloadTarget", intent: SpanSegment | SegmentDescriptorV2 | None) -> WireBuffers:
        # a payload in pieces (PayloadTarget: e.g. the plane rows of a tile) is hashed and
        # sent piece by piece, never joined into one buffer
        pieces: Optional[PayloadTarget]
        if isinstance(payload, PayloadTarget):
            pieces, view, nbytes = payload, memoryview(b""), payload.nbytes
        else:
            pieces, view = None, memoryview(payload).cast("B")
            nbytes = view.nbytes
        seq = self._next
        if self.deferred:
            if intent is None:
                raise ProtocolError("manifest", "deferred mode needs a segment intent", remote=False)
            # segment digest and running payload digest in one concurrent pass
            if pieces is None:
                d = descriptor_for(intent, seq, view, sha256=self._acc.add_payload_and_digest(view, self._hash_executor))
            else:
                d = descriptor_for(intent, seq, pieces, sha256=self._acc.add_pieces_and_digest(pieces.pieces, nbytes, self._hash_executor))
            check_descriptor(d, self._ids)
            self._overlap.add(d)
            frame = Segment(seq, view, d, target=pieces)
        else:
            if seq >= len(self.manifest.segments):
                raise ProtocolError("sequence", "more segments than declared", remote=False)
            d = self.manifest.segments[seq]
            if nbytes != d.byte_len:
                raise ProtocolError("digest", f"segment {seq}: payload is {nbytes} bytes, declared {d.byte_len}", remote=False)
            frame = Segment(seq, view, target=pieces)
        out = encode_frame(frame, self.limits)
        self._acc.add_descriptor(d)
        if not self.deferred:
            if pieces is None:
                self._acc.add_payload(view)
            else:
                self._acc.add_pieces(pieces.pieces, nbytes)
        self._seen.add(d.component_id)
        self._next += 1
        return out

    def _seal(self) -> WireBuffers:
        m = self.manifest
        if not self.deferred and self._next != len(m.segments):
            raise ProtocolError("sequence", f"{self._next} of {len(m.segments)} declared segments sent", remote=False)
        if self.deferred:
            if self._next == 0:
                raise ProtocolError("sequence", "deferred transfer without segments", remote=False)
            missing = [c.id for c in m.components if c.required and c.id not in self._seen]
            if missing:
                raise ProtocolError("sequence", f"required component {missing[0]!r} has no segment", remote=False)
        core = self._acc.core(m)
        self.seal_manifest = SealManifestV2(core, seal_tag(self._key, core))
        self._decoder = FrameDecoder(self.limits)
        return encode_frame(Seal(self.seal_manifest), self.limits)

    def _ack(self, frame: Frame) -> Ack:
        if not isinstance(frame, Ack):
            raise ProtocolError("state", f"expected ack, got {type(frame).__name__.lower()}")
        if frame.transfer_id != self.manifest.transfer_id or frame.generation != self.manifest.generation:
            raise ProtocolError("manifest", "ack names another transfer or generation")
        return frame
