"""The decode-node side of Handoff V2 (INTEROP C.8, errata H4/L4/M3/M4), sans-I/O.

    r = Receiver(config, sink, replay, now_unix_ms=t0, held_token_ids=held)
    effects = r.receive_data(chunk)      # or r.wanted() / r.advance(n) for recv_into
    ...                                   # Committed(ack=...) -> write ack, close
    r.eof()                               # stream ended: refuses unless committed

Order of work, exactly C.8 / errata L4:

1. The first frame must be a begin (``prefix_cut`` lifted from its raw JSON); a begin that
   names another request is refused (``identity``) while :attr:`admitted` is still False,
   so the daemon drops that connection and keeps waiting (errata M8).
2. ``replay.admit(key_id, epoch, generation)``.
3. Expiry against the clock value taken once at request start.
4. ``validate_begin`` (C.4), admission expectations, ``validate_prefix_cut`` (C.11), and the
   declared schedule; then ``sink.begin`` opens a *detached* generation.
5. Each segment: sequence contiguity, mode-matching frame form (M4), descriptor rules,
   overlap, schedule witness, length, per-segment SHA-256, the running descriptor and
   payload digests -- and only then ``sink.write_segment`` into the detached generation.
6. Seal: all counts and digests, the HMAC (constant time), completeness, ``sink.prepare``,
   then ``replay.reserve`` (durable), then ``sink.commit``, then the ack is emitted.

Any refusal before commit calls ``sink.abort()`` exactly once and leaves the machine
CLOSED: the live state was never touched, because the sink only publishes in ``commit``.
After commit the transfer is final and later bytes are ignored (errata H4).

Payloads reach the sink as ``memoryview``s of the decoder's one payload buffer, reused for
every frame: a view is valid only during ``write_segment``, and the sink copies what it
keeps (into its detached generation, which it must do anyway). That bounds the receiver's
own memory to one frame and avoids a fresh multi-MiB allocation per segment.

Payloads of at least ``stream_hash_min`` bytes (1 MiB) are hashed *while they arrive*
(:mod:`.streamhash`): while one is being read, :meth:`Receiver.wanted` hands out at most
``stream_hash_chunk`` (256 KiB) at a time, and every :meth:`Receiver.advance` queues the
newly completed range for the segment digest and the running payload digest, two ordered
lanes on pool threads (hashlib releases the GIL), so the driver's next ``recv_into`` and
its TLS decryption overlap the hashing. Nothing else moves: the digest is *waited for* at
step 5's digest check, exactly where it was computed before (so the buffer is never
reused while a lane still reads it), the running digest is continued on a copy adopted at
that same step, and a refused or aborted segment just drops its queued ranges.
"""

from __future__ import annotations

import hmac as _hmac
from dataclasses import dataclass
from collections.abc import Callable
from concurrent.futures import Executor
from typing import NoReturn, Optional, Protocol, Sequence, Union

from ..errors import KvpackError, ProtocolError
from .admission import AdmissionExpectations, check_admission, check_transfer_id
from .delta import ScheduleWitness, check_declared_schedule, layout_shapes, validate_prefix_cut
from .events import Abort, Ack, Begin, Frame, Seal, Segment
from .frames import FrameDecoder, FrameLimits, frame_bytes
from .hashing import INLINE
from .manifest import (
    BeginManifestV2,
    OverlapTracker,
    SealAccumulator,
    SealCoreV2,
    SegmentDescriptorV2,
    check_descriptor,
    check_seal,
    validate_begin,
)
from .schedule import MUSE, SpanLayout, schedule_span
from .state import RECEIVER_TRANSITIONS, ReceiverState, transition
from .streamhash import PayloadStream
from .target import PayloadTarget

#: Payloads at least this large are hashed while they arrive (see the module docstring);
#: smaller ones are hashed in one go once complete, as before.
STREAM_HASH_MIN = 1 << 20
#: The ranges handed to the hashing lanes: large enough that the per-range Python cost is
#: noise, small enough that the hashing left after a segment's last byte is short.
STREAM_HASH_CHUNK = 256 << 10


class Sink(Protocol):
    """Where verified segments go: a detached generation published only by ``commit``.

    A sink may also define ``payload_target(descriptor) -> PayloadTarget | None``: called
    once the segment header passed every check that precedes its payload (state, sequence,
    descriptor, schedule slot, length), it hands out the segment's destination pieces in
    the detached generation, and the payload is read straight into them (no staging copy).
    ``write_segment`` then receives that :class:`~.target.PayloadTarget` instead of a view,
    after the same digest check; until then the bytes in it count for nothing (a refusal
    aborts the generation they were written into).

    ``begin`` may refuse (identity admission of the engine side); ``write_segment``
    receives payloads already checked against their descriptor digest, as a view that is
    valid only for the duration of the call (copy what you keep); ``prepare`` must
    prove the generation is complete and installable; ``commit`` publishes atomically and
    should not fail; ``abort`` discards the detached generation (called at most once, never
    after commit).
    """

    def begin(self, manifest: BeginManifestV2, prefix_cut: int) -> None: ...
    def write_segment(self, descriptor: SegmentDescriptorV2, payload: "memoryview | PayloadTarget") -> None: ...
    def prepare(self) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


class ReplayGate(Protocol):
    """The replay ledger seam (C.9): ``admit`` before any work, ``reserve`` durably after
    the seal verified and before commit. Either refuses by raising."""

    def admit(self, key_id: str, epoch: int, generation: int) -> None: ...
    def reserve(self, key_id: str, epoch: int, generation: int) -> None: ...


@dataclass(frozen=True)
class ReceiverConfig:
    """Static receiver settings (from ``ReceiverConfigV2``)."""

    key: bytes
    key_id: str
    minimum_epoch: int
    #: The span layout target segments must follow (errata M3). None disables the schedule
    #: check: the sink must then enforce contiguity and coverage itself.
    layout: Optional[SpanLayout] = MUSE
    expectations: Optional[AdmissionExpectations] = None
    limits: FrameLimits = FrameLimits()
    #: This transfer is stripe ``(index, count)`` of a striped handoff (a kvpack extension,
    #: negotiated on the control plane): its target segments are the schedule's
    #: ``[index::count]``, in order, deferred mode only. None: the whole schedule.
    stripe: Optional[tuple[int, int]] = None

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise ValueError("Handoff V2 seal keys are 32 bytes")
        if self.stripe is not None and not 0 <= self.stripe[0] < self.stripe[1] <= 64:
            raise ValueError("stripe must be (index, count) with 0 <= index < count <= 64")


# Effects the driver acts on (h11 style events going out).


@dataclass(frozen=True)
class Admitted:
    """The begin passed every admission check and the sink opened its generation."""

    manifest: BeginManifestV2
    prefix_cut: int


@dataclass(frozen=True)
class SegmentStored:
    sequence: int
    byte_len: int


@dataclass(frozen=True)
class Committed:
    """Sealed, reserved and committed. Write ``ack`` and close; read nothing more."""

    transfer_id: str
    generation: int
    segment_count: int
    total_bytes: int
    ack: bytes


Effect = Union[Admitted, SegmentStored, Committed]


class Receiver:
    """Receiver state machine: AWAIT_BEGIN -> RECEIVING -> DONE (or CLOSED)."""

    def __init__(
        self,
        config: ReceiverConfig,
        sink: Sink,
        replay: ReplayGate,
        *,
        now_unix_ms: int,
        held_token_ids: Optional[Sequence[int]] = None,
        stream_hash_min: Optional[int] = STREAM_HASH_MIN,
        stream_hash_chunk: int = STREAM_HASH_CHUNK,
        hash_executor: Executor = INLINE,
        payload_buffers: int = 1,
        reuse_buffers: Sequence[bytearray] = (),
    ) -> None:
        """``stream_hash_min``: payloads of at least this many bytes are hashed while they
        arrive, in ranges of ``stream_hash_chunk`` bytes (None: always hash complete
        payloads on the calling thread's schedule, as :meth:`receive_frame` does).
        ``hash_executor`` runs that hashing (a driver's thread pool overlaps it with the
        next reads and runs both digests at once); the default hashes on this thread.
        ``payload_buffers``: how many reused payload buffers segments take in turn. With
        ``k > 1`` the payload view handed to ``sink.write_segment`` stays unchanged until the
        sink's ``k - 1``-th later ``write_segment`` call returns, so a sink may finish
        writing a segment asynchronously while the next one is read, provided it waits for
        that write before that call returns (and in ``prepare``/``abort``); 1: the view
        is valid only during the call. ``reuse_buffers``: payload buffers of an earlier
        transfer to take first (see :meth:`release_payload_buffers`)."""
        if stream_hash_chunk < 1 or (stream_hash_min is not None and stream_hash_min < 1):
            raise ValueError("stream hashing sizes must be positive")
        self.config = config
        self.sink = sink
        self.replay = replay
        self.now_unix_ms = now_unix_ms
        self.held_token_ids = held_token_ids
        self.state = ReceiverState.AWAIT_BEGIN
        self.decoder = FrameDecoder(
            config.limits,
            reuse_payload_buffer=True,
            payload_gate=self._admit_payload,
            payload_buffers=payload_buffers,
            reuse_buffers=reuse_buffers,
            payload_target=self._payload_target if callable(getattr(sink, "payload_target", None)) else None,
        )
        self.manifest: Optional[BeginManifestV2] = None
        #: The begin that was parsed, admitted or not (receipts name the transfer_id and
        #: generation of a refused begin; ``manifest`` is set only once it is admitted).
        self.offered: Optional[BeginManifestV2] = None
        self.prefix_cut = 0
        self.error: Optional[ProtocolError] = None
        self._sink_open = False
        self._acc = SealAccumulator()
        self._overlap = OverlapTracker()
        self._witness: Optional[ScheduleWitness] = None
        self._ids: set[str] = set()
        self._seen: set[str] = set()
        self._next = 0
        self._stream_min = stream_hash_min
        self._stream_chunk = stream_hash_chunk
        self._hash_executor = hash_executor
        self._stream: Optional[PayloadStream] = None  # the payload being hashed as it arrives

    # -- inputs -------------------------------------------------------------------------

    @property
    def admitted(self) -> bool:
        """True once a begin passed admission (failures before that are "wrong peer")."""
        return self.manifest is not None and self._sink_open

    @property
    def segments_received(self) -> int:
        return self._next

    @property
    def bytes_received(self) -> int:
        return self._acc.total_bytes

    def seal_core(self) -> Optional[SealCoreV2]:
        """The seal core of what was received so far (digests for receipts); None before begin."""
        return None if self.manifest is None else self._acc.core(self.manifest)

    def wanted(self) -> memoryview:
        """Buffer for ``recv_into``; empty once the transfer is final.

        Never beyond the current frame phase; while a large payload is hashed as it
        arrives, never beyond the next hash range either (fill it, then :meth:`advance`).
        """
        if self.state is ReceiverState.DONE:
            return memoryview(b"")
        self._check_open()
        try:
            view = self.decoder.wanted()
        except ProtocolError as exc:
            self._fail(exc)
        stream = self._stream
        return view if stream is None else view[: stream.room()]

    def advance(self, n: int) -> list[Effect]:
        """Record ``n`` bytes written into :meth:`wanted`; returns the effects of a frame
        that completed."""
        if self.state is ReceiverState.DONE:
            return []
        self._check_open()
        try:
            frame = self.decoder.advance(n)
        except ProtocolError as exc:
            self._fail(exc)
        if frame is None:
            self._payload_progress()
            return []
        return self._receive(frame, self._stream)

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Effect]:
        """Feed bytes in any split. Bytes after the commit are ignored (errata H4)."""
        src = memoryview(data).cast("B")
        effects: list[Effect] = []
        pos = 0
        while pos < len(src) and self.state is not ReceiverState.DONE:
            dst = self.wanted()
            k = min(len(dst), len(src) - pos)
            dst[:k] = src[pos : pos + k]
            pos += k
            effects.extend(self.advance(k))
        return effects

    def release_payload_buffers(self) -> list[bytearray]:
        """The payload buffers, for a later transfer's receiver -- only once this one
        committed (every digest lane and sink write finished with them); after a refusal a
        cancelled lane may still be reading one, so they are dropped with the receiver."""
        if self.state is not ReceiverState.DONE:
            return []
        return self.decoder.release_payload_buffers()

    def eof(self) -> None:
        """The peer closed. Refuses (and aborts the sink) unless the transfer committed."""
        if self.state is ReceiverState.DONE:
            return
        self._check_open()
        try:
            self.decoder.eof()
        except ProtocolError as exc:
            self._fail(exc)
        self._fail(ProtocolError("aborted", "stream ended before the seal"))

    def abort(self, reason: str) -> None:
        """Local abort (timeout, shutdown): discard the detached generation."""
        if self.state in (ReceiverState.DONE, ReceiverState.CLOSED):
            return
        self._close(ProtocolError("aborted", reason, remote=False))

    def receive_frame(self, frame: Frame) -> list[Effect]:
        """Feed one decoded frame (its payload is hashed here, on the calling thread)."""
        self._drop_stream()  # a payload the decoder was streaming is no longer the next frame
        return self._receive(frame, None)

    def _receive(self, frame: Frame, stream: Optional[PayloadStream]) -> list[Effect]:
        if self.state is ReceiverState.DONE:
            return []
        self._check_open()
        event = type(frame).__name__.lower()
        try:
            new_state = transition(RECEIVER_TRANSITIONS, self.state, event, remote=True)
            if isinstance(frame, Begin):
                effects = self._on_begin(frame)
            elif isinstance(frame, Segment):
                effects = self._on_segment(frame, stream)
            elif isinstance(frame, Seal):
                effects = self._on_seal(frame)
            elif isinstance(frame, Abort):
                raise ProtocolError("aborted", f"producer abort: {frame.reason[:256]}")
            else:  # pragma: no cover - the table refuses every other kind
                raise ProtocolError("state", f"unexpected {event}")
        except ProtocolError as exc:
            self._fail(exc)
        except KvpackError as exc:
            # Injected collaborators raise their own typed errors; keep their category in
            # the message and map them onto the step that failed.
            self._fail(ProtocolError("sink", f"{exc.category}: {exc.message}", remote=False))
        self._stream = None  # consumed by _on_segment (a control frame never has one)
        self.state = new_state
        return effects

    # -- hashing payloads as they arrive ------------------------------------------------

    def _payload_progress(self) -> None:
        """After an advance inside a frame: start or feed the payload's hash stream."""
        progress = self.decoder.payload_progress
        if progress is None:
            return
        view, filled = progress
        stream = self._stream
        try:
            if stream is None:
                # Only from the payload's first byte, only once admitted (a segment in any
                # other state is refused when it completes), only for large payloads.
                if filled or self._stream_min is None or view.nbytes < self._stream_min or self.state is not ReceiverState.RECEIVING:
                    return
                stream = self._stream = PayloadStream(view, self._acc.payload_hash, self._stream_chunk, self._hash_executor)
            stream.feed(filled)
        except Exception as exc:  # noqa: BLE001 - e.g. the driver's pool was shut down
            self._fail(ProtocolError("aborted", f"payload hashing failed: {type(exc).__name__}: {exc}", remote=False))

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()

    def _segment_digest(self, payload: "memoryview | PayloadTarget", stream: Optional[PayloadStream]) -> str:
        """The segment's SHA-256 (hex), with the running payload digest fed by it: from the
        hash stream that followed this payload in, else computed now."""
        if stream is None or stream.view is not payload:
            if isinstance(payload, PayloadTarget):
                return self._acc.add_pieces_and_digest(payload.pieces, payload.nbytes)
            return self._acc.add_payload_and_digest(payload, self._hash_executor)
        try:
            got = stream.digest()  # waits for both lanes: the buffer is ours again after
        except Exception as exc:  # noqa: BLE001
            raise ProtocolError("aborted", f"payload hashing failed: {type(exc).__name__}: {exc}", remote=False) from exc
        self._acc.add_streamed_payload(stream.running_hash, payload.nbytes)
        return got

    # -- failure ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state is ReceiverState.CLOSED:
            raise ProtocolError("state", "receiver is closed", remote=False)

    def _fail(self, exc: ProtocolError) -> NoReturn:
        self._close(exc)
        raise exc

    def _close(self, exc: ProtocolError) -> None:
        """Record the refusal, close the machine and abort the sink if it is open."""
        self.error = exc
        self.state = ReceiverState.CLOSED
        self._drop_stream()
        if self._sink_open:
            self._sink_open = False
            try:
                self.sink.abort()
            except Exception:  # the refusal that got us here is the one to report
                pass

    def _call(self, category: str, fn: Callable[..., object], *args: object) -> None:
        """Run an injected callback; any exception it raises becomes ``category``."""
        try:
            fn(*args)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - any callback failure must abort
            detail = exc.verdict() if isinstance(exc, KvpackError) else f"{type(exc).__name__}: {exc}"
            raise ProtocolError(category, detail, remote=False) from exc

    # -- handlers -----------------------------------------------------------------------

    def _on_begin(self, frame: Begin) -> list[Effect]:
        m = frame.manifest
        cfg = self.config
        self.offered = m
        check_transfer_id(cfg.expectations, m)
        self._call("replay", self.replay.admit, m.hmac.key_id, m.hmac.epoch, m.generation)
        if self.now_unix_ms > m.expires_unix_ms:
            raise ProtocolError("expired", f"begin expired at {m.expires_unix_ms}, now {self.now_unix_ms}")
        validate_begin(m, now_unix_ms=self.now_unix_ms, expected_key_id=cfg.key_id, minimum_epoch=cfg.minimum_epoch)
        if cfg.expectations is not None:
            check_admission(m, cfg.expectations)
        if cfg.stripe is not None and not m.deferred_segments:
            raise ProtocolError("manifest", "a stripe of a striped transfer must use deferred segments")
        validate_prefix_cut(m, frame.prefix_cut, self.held_token_ids, cfg.layout)
        if cfg.layout is not None and m.component(cfg.layout.component_id) is not None:
            expected = schedule_span(cfg.layout, m.position, frame.prefix_cut)
            if cfg.stripe is not None:
                expected = expected[cfg.stripe[0] :: cfg.stripe[1]]
            self._witness = ScheduleWitness(expected, cfg.layout.component_id, layout_shapes(cfg.layout))
            if not m.deferred_segments:
                check_declared_schedule(m, cfg.layout, frame.prefix_cut)
        self.manifest = m
        self.prefix_cut = frame.prefix_cut
        self._ids = {c.id for c in m.components}
        self._sink_open = True
        self._call("sink", self.sink.begin, m, frame.prefix_cut)
        return [Admitted(m, frame.prefix_cut)]

    def _admit_payload(self, header: Segment, length: int) -> None:
        """Allocate after checking: before the decoder sizes a payload buffer from the peer's
        declared ``length``, the segment must be acceptable *now* (an admitted begin came
        first), its descriptor must pass the C.5 rules and the next schedule slot, and the
        length must be exactly its descriptor's. The full checks still run on completion."""
        m = self.manifest
        if self.state is not ReceiverState.RECEIVING or m is None:
            raise ProtocolError("state", f"segment in state {self.state.value}: no payload is read before an admitted begin")
        # the checks of _on_segment, in its order, without recording anything
        if header.sequence != self._next:
            raise ProtocolError("sequence", f"segment {header.sequence} where {self._next} was expected")
        if m.deferred_segments:
            d = header.descriptor
            if d is None:
                raise ProtocolError("sequence", "extra segment: deferred mode needs in-frame descriptors")
            check_descriptor(d, self._ids)
            self._overlap.check(d)
        else:
            if header.descriptor is not None:
                raise ProtocolError("sequence", "deferred segment outside deferred receiving mode")
            if header.sequence >= len(m.segments):
                raise ProtocolError("sequence", f"extra segment {header.sequence} beyond the {len(m.segments)} declared")
            d = m.segments[header.sequence]
        if self._witness is not None:
            self._witness.peek(d)
        if length != d.byte_len:
            raise ProtocolError("digest", f"segment {header.sequence}: {length} payload bytes declared, descriptor says {d.byte_len}")

    def _payload_target(self, header: Segment, length: int) -> Optional[PayloadTarget]:
        """The sink's destination for a segment the gate just accepted (see :class:`Sink`)."""
        m = self.manifest
        assert m is not None  # the gate refused the segment otherwise
        d = header.descriptor if m.deferred_segments else m.segments[header.sequence]
        assert d is not None  # the gate checked it
        try:
            target = self.sink.payload_target(d)  # type: ignore[attr-defined]
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - a sink failure refuses the transfer
            detail = exc.verdict() if isinstance(exc, KvpackError) else f"{type(exc).__name__}: {exc}"
            raise ProtocolError("sink", detail, remote=False) from exc
        if target is not None and not isinstance(target, PayloadTarget):
            raise ProtocolError("sink", f"payload_target returned {type(target).__name__}", remote=False)
        return target

    def _on_segment(self, frame: Segment, stream: Optional[PayloadStream] = None) -> list[Effect]:
        m = self.manifest
        assert m is not None  # the transition table admits a segment only after a begin
        seq = self._next
        if frame.sequence != seq:
            raise ProtocolError("sequence", f"segment {frame.sequence} where {seq} was expected")
        if m.deferred_segments:
            if frame.descriptor is None:
                raise ProtocolError("sequence", "extra segment: deferred mode needs in-frame descriptors")
            d = frame.descriptor
            check_descriptor(d, self._ids)
            self._overlap.add(d)
        else:
            if frame.descriptor is not None:
                raise ProtocolError("sequence", "deferred segment outside deferred receiving mode")
            if seq >= len(m.segments):
                raise ProtocolError("sequence", f"extra segment {seq} beyond the {len(m.segments)} declared")
            d = m.segments[seq]
        if self._witness is not None:
            self._witness.observe(d)
        payload: "memoryview | PayloadTarget" = frame.payload if frame.target is None else frame.target
        if payload.nbytes != d.byte_len:
            raise ProtocolError("digest", f"segment {seq}: {payload.nbytes} payload bytes, descriptor says {d.byte_len}")
        # the running payload digest is fed in the same pass; a mismatch closes the machine,
        # so the extra bytes in it are never used
        got = self._segment_digest(payload, stream)
        if not _hmac.compare_digest(got.encode(), d.sha256.encode()):
            raise ProtocolError("digest", f"segment {seq}: payload SHA-256 does not match its descriptor")
        self._acc.add_descriptor(d)
        self._seen.add(d.component_id)
        self._next += 1
        self._call("sink", self.sink.write_segment, d, payload)
        return [SegmentStored(seq, d.byte_len)]

    def _on_seal(self, frame: Seal) -> list[Effect]:
        m = self.manifest
        assert m is not None  # the transition table admits a seal only after a begin
        if not m.deferred_segments and self._next != len(m.segments):
            raise ProtocolError("sequence", f"seal after {self._next} of {len(m.segments)} declared segments")
        if m.deferred_segments:
            if self._next == 0:
                raise ProtocolError("sequence", "seal before any segment")
            missing = [c.id for c in m.components if c.required and c.id not in self._seen]
            if missing:
                raise ProtocolError("sequence", f"required component {missing[0]!r} has no segment")
        check_seal(self.config.key, frame.manifest, self._acc.core(m))
        if self._witness is not None:
            self._witness.finish()
        self._call("sink", self.sink.prepare)
        self._call("reservation", self.replay.reserve, m.hmac.key_id, m.hmac.epoch, m.generation)
        self._call("sink", self.sink.commit)
        # Committed: from here on nothing may abort the sink.
        self._sink_open = False
        ack = frame_bytes(Ack(m.transfer_id, m.generation), self.config.limits)
        return [Committed(m.transfer_id, m.generation, self._next, self._acc.total_bytes, ack)]
