"""The KVPKV2 frame codec (INTEROP C.2-C.3, errata M1/M4): bytes <-> :mod:`events`.

Wire form of every frame::

    b"KVPKV2\\0\\0" | u32 LE header_len | u64 LE payload_len | header JSON | payload

Decoding is incremental and bounded. :class:`FrameDecoder` exposes the buffer it wants
filled next (:meth:`FrameDecoder.wanted`), so a socket driver can ``recv_into`` it
directly; it never asks for a byte beyond the current frame, so it never holds more than
one frame. Limits are checked *before* any allocation: the header buffer is allocated only
after the header length passed the 8 MiB limit, and the payload buffer only after the
header parsed and the frame kind proved that a payload of that size is allowed (control
frames carry none; a segment carries at least one byte; 512 MiB at most) and the optional
``payload_gate`` (the receiver state machine) accepted that segment in its current state at
that exact length. :meth:`feed` is a
convenience over the same machinery for callers that already hold bytes.

Header key order is free on the wire (Rust sends ``kind`` first, Python sorted keys); we
send canonical sorted JSON like the Python producer. Frame headers are parsed strictly but
are not required to be canonical (C.7).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..errors import ProtocolError
from . import canonical_json as cj
from .delta import lift_prefix_cut
from .events import Abort, Ack, Begin, Frame, Seal, Segment
from .manifest import BeginManifestV2, SealManifestV2, SegmentDescriptorV2
from .target import PayloadTarget

MAGIC = b"KVPKV2\0\0"
PREAMBLE = struct.Struct("<8sIQ")
PREAMBLE_BYTES = PREAMBLE.size  # 20
MAX_HEADER_BYTES = 8 * 1024 * 1024
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024

CONTROL_KINDS = frozenset({"begin", "seal", "ack", "abort"})


@dataclass(frozen=True)
class FrameLimits:
    """``FrameLimitsV2``; tests shrink them, production keeps the defaults."""

    max_header: int = MAX_HEADER_BYTES
    max_payload: int = MAX_PAYLOAD_BYTES


#: What an encoder hands the socket: the preamble+header bytes, then a segment's payload
#: (the caller's own buffer, never copied).
WireBuffers = list[bytes | memoryview]


# --- encoding --------------------------------------------------------------------------


def _header_json(frame: Frame) -> dict[str, Any]:
    if isinstance(frame, Begin):
        manifest = frame.manifest.to_json()
        # The Python producer emits prefix_cut only when nonzero (C.11); absent means 0.
        if frame.prefix_cut:
            manifest["prefix_cut"] = frame.prefix_cut
        return {"kind": "begin", "manifest": manifest}
    if isinstance(frame, Segment):
        header: dict[str, Any] = {"kind": "segment", "sequence": frame.sequence}
        if frame.descriptor is not None:
            header["descriptor"] = frame.descriptor.to_json()
        return header
    if isinstance(frame, Seal):
        return {"kind": "seal", "manifest": frame.manifest.to_json()}
    if isinstance(frame, Ack):
        return {"kind": "ack", "transfer_id": frame.transfer_id, "generation": frame.generation}
    if isinstance(frame, Abort):
        return {"kind": "abort", "reason": frame.reason}
    raise TypeError(f"not a Handoff V2 frame: {frame!r}")


def encode_frame(frame: Frame, limits: FrameLimits = FrameLimits()) -> WireBuffers:
    """Encode ``frame`` as a list of buffers: ``[preamble+header]`` or, for a segment,
    ``[preamble+header, payload]`` where ``payload`` is the caller's own buffer (no copy).

    The list suits ``socket.sendmsg`` / ``writelines``; ``b"".join`` gives the bytes.
    Encoding refuses what the decoder would refuse, so a local bug never reaches the wire.
    """
    header = cj.canonical_bytes(_header_json(frame))
    if not 0 < len(header) <= limits.max_header:
        raise ProtocolError("framing", f"header of {len(header)} bytes exceeds the limit", remote=False)
    if isinstance(frame, Segment) and frame.target is not None:  # a payload sent from its pieces
        n = frame.target.nbytes
        if n == 0:
            raise ProtocolError("framing", "empty segment", remote=False)
        if n > limits.max_payload:
            raise ProtocolError("framing", f"payload of {n} bytes exceeds the limit", remote=False)
        return [PREAMBLE.pack(MAGIC, len(header), n) + header, *frame.target.pieces]
    if isinstance(frame, Segment):
        payload = frame.payload
        n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        if n == 0:
            raise ProtocolError("framing", "empty segment", remote=False)
        if n > limits.max_payload:
            raise ProtocolError("framing", f"payload of {n} bytes exceeds the limit", remote=False)
        return [PREAMBLE.pack(MAGIC, len(header), n) + header, payload]
    return [PREAMBLE.pack(MAGIC, len(header), 0) + header]


def frame_bytes(frame: Frame, limits: FrameLimits = FrameLimits()) -> bytes:
    """The whole frame as one ``bytes`` (copies the payload; for tests and small frames)."""
    return b"".join(bytes(b) for b in encode_frame(frame, limits))


# --- typed header parse ----------------------------------------------------------------


def parse_header(header: object, payload: memoryview) -> Frame:
    """Turn a parsed header object plus its payload into a frame event (C.3 allow-lists)."""
    if not isinstance(header, dict):
        raise ProtocolError("json", "frame header is not a JSON object")
    kind = header.get("kind")
    if type(kind) is not str:
        raise ProtocolError("json", "frame header has no string 'kind'")
    if kind == "begin":
        cj.check_keys(header, "begin frame", ("kind", "manifest"))
        raw = header["manifest"]
        # Lift prefix_cut from the raw JSON before the typed parse drops it (C.8 step 1).
        cut = lift_prefix_cut(raw) if isinstance(raw, dict) else 0
        return Begin(BeginManifestV2.from_json(raw), cut)
    if kind == "segment":
        cj.check_keys(header, "segment frame", ("kind", "sequence"), ("descriptor",))
        seq = cj.u32(header["sequence"], "segment.sequence")
        raw_d = header.get("descriptor")
        descriptor = None if raw_d is None else SegmentDescriptorV2.from_json(raw_d)
        if descriptor is not None and descriptor.sequence != seq:
            raise ProtocolError("sequence", f"descriptor sequence {descriptor.sequence} != frame {seq}")
        return Segment(seq, payload, descriptor)
    if kind == "seal":
        cj.check_keys(header, "seal frame", ("kind", "manifest"))
        return Seal(SealManifestV2.from_json(header["manifest"]))
    if kind == "ack":
        cj.check_keys(header, "ack frame", ("kind", "transfer_id", "generation"))
        return Ack(cj.string(header["transfer_id"], "ack.transfer_id"), cj.u64(header["generation"], "ack.generation"))
    if kind == "abort":
        cj.check_keys(header, "abort frame", ("kind", "reason"))
        return Abort(cj.string(header["reason"], "abort.reason"))
    raise ProtocolError("framing", f"unknown frame kind {kind[:64]!r}")


# --- decoding --------------------------------------------------------------------------

_EMPTY = memoryview(b"")


class FrameDecoder:
    """Incremental KVPKV2 decoder: bytes in (any split), frame events out.

    Phases: preamble (20 B) -> header (n B) -> payload (m B) -> event. After a refusal the
    decoder is dead: every later call raises the same error, so a driver cannot resume a
    stream whose framing is lost.
    """

    def __init__(
        self,
        limits: FrameLimits = FrameLimits(),
        *,
        reuse_payload_buffer: bool = False,
        payload_gate: Optional[Callable[[Segment, int], None]] = None,
        payload_buffers: int = 1,
        reuse_buffers: Sequence[bytearray] = (),
        payload_target: Optional[Callable[[Segment, int], Optional[PayloadTarget]]] = None,
    ) -> None:
        self.limits = limits
        # Called after ``payload_gate`` accepted a segment header: a consumer that wants the
        # payload read straight into its own destination (:mod:`.target`) returns the
        # pieces, of exactly the declared length; None reads it into a payload buffer.
        self.payload_target = payload_target
        self._target: Optional[PayloadTarget] = None
        # Called with a parsed segment header and its declared payload length *before* the
        # payload buffer is sized from that length: the consumer's state machine refuses
        # (raises) a segment it would not accept now, or one whose length is not its
        # descriptor's, so a peer's declared length never allocates memory on its own.
        self.payload_gate = payload_gate
        # With reuse, one payload buffer serves every frame: a segment's payload view is
        # then valid only until the decoder is advanced again. The receiver uses this (its
        # sink copies during write_segment), which saves a fresh multi-MiB allocation and
        # its page faults per frame; standalone decoding keeps fresh buffers.
        self.reuse_payload_buffer = reuse_payload_buffer
        # With reuse and ``payload_buffers = k``, segments take the reused buffers in turn:
        # a payload view then stays valid until ``k`` later segment payloads started, so a
        # consumer may still be writing one segment while the next one is read (k = 2).
        if payload_buffers < 1:
            raise ValueError("payload_buffers must be at least 1")
        self._payload_bufs: list[Optional[bytearray]] = [None] * payload_buffers
        # buffers a driver kept from an earlier stream (no fresh allocation, zero-fill and
        # page faults per connection); one that is too small for a payload is replaced
        for i, buf in enumerate(list(reuse_buffers)[:payload_buffers]):
            self._payload_bufs[i] = buf
        self._next_buf = 0
        self._preamble = bytearray(PREAMBLE_BYTES)
        self._view = memoryview(self._preamble)
        self._filled = 0
        self._phase = "preamble"
        self._payload_len = 0
        self._pending: Optional[Segment] = None
        self._error: Optional[ProtocolError] = None
        self.frames_decoded = 0

    # The two-verb interface for zero-copy drivers.

    def wanted(self) -> memoryview:
        """Writable view of the bytes the current frame still needs (never beyond it)."""
        self._check_alive()
        if self._target is not None:
            return self._target.remaining(self._filled)
        return self._view[self._filled :]

    def advance(self, n: int) -> Optional[Frame]:
        """Record that ``n`` bytes were written into :meth:`wanted`; returns a frame when
        one completes, else None."""
        self._check_alive()
        room = len(self._target.remaining(self._filled)) if self._target is not None else len(self._view) - self._filled
        if n < 0 or n > room:
            raise ValueError("advance beyond the wanted buffer")
        self._filled += n
        try:
            return self._step()
        except ProtocolError as exc:
            self._error = exc
            raise

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Consume all of ``data``; return the frames it completes, in order."""
        src = memoryview(data).cast("B")
        out: list[Frame] = []
        pos = 0
        total = len(src)
        # Zero-length phases (none exist today) would loop forever; wanted() is never empty
        # between frames because the preamble is 20 bytes.
        while pos < total:
            dst = self.wanted()
            k = min(len(dst), total - pos)
            dst[:k] = src[pos : pos + k]
            pos += k
            frame = self.advance(k)
            if frame is not None:
                out.append(frame)
        return out

    @property
    def payload_progress(self) -> Optional[tuple["memoryview | PayloadTarget", int]]:
        """``(payload buffer or target, bytes filled)`` while a payload is being read, else
        None.

        Lets a driver act on the payload bytes already in (the receiver hashes them while
        the rest arrives); it is what :meth:`wanted` hands out slices of."""
        if self._phase != "payload":
            return None
        return (self._view if self._target is None else self._target), self._filled

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return self._phase == "preamble" and self._filled == 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes currently held for the partial frame (bounded by one frame's limits)."""
        held = len(self._view)
        for buf in self._payload_bufs:
            if buf is not None:
                held = max(held, len(buf))
        return held

    def release_payload_buffers(self) -> list[bytearray]:
        """Hand the reused payload buffers to the caller (for a later decoder) and forget
        them. Only once nothing reads them any more: the stream is over."""
        out = [b for b in self._payload_bufs if b is not None]
        self._payload_bufs = [None] * len(self._payload_bufs)
        return out

    def eof(self) -> None:
        """The stream ended; refuse if a frame was cut short (C.2 "truncated")."""
        self._check_alive()
        if not self.at_boundary:
            what = "segment payload" if self._phase == "payload" else f"frame {self._phase}"
            self._error = ProtocolError("framing", f"truncated {what}")
            raise self._error

    # Internals.

    def _check_alive(self) -> None:
        if self._error is not None:
            raise self._error

    def _set_buffer(self, buf: bytearray | memoryview, phase: str) -> None:
        self._view = memoryview(buf)
        self._target = None
        self._filled = 0
        self._phase = phase

    def _payload_buffer(self, n: int) -> memoryview:
        if not self.reuse_payload_buffer:
            return memoryview(bytearray(n))
        i = self._next_buf
        self._next_buf = (i + 1) % len(self._payload_bufs)
        buf = self._payload_bufs[i]
        if buf is None or len(buf) < n:
            self._payload_bufs[i] = None  # drop the old one before allocating the larger
            buf = self._payload_bufs[i] = bytearray(n)
        return memoryview(buf)[:n]

    def _step(self) -> Optional[Frame]:
        if self._filled < (len(self._view) if self._target is None else self._target.nbytes):
            return None
        if self._phase == "preamble":
            magic, hlen, plen = PREAMBLE.unpack(self._preamble)
            if magic != MAGIC:
                raise ProtocolError("framing", "bad frame magic")
            if hlen == 0 or hlen > self.limits.max_header:
                raise ProtocolError("framing", f"header length {hlen} outside 1..={self.limits.max_header}")
            if plen > self.limits.max_payload:
                raise ProtocolError("framing", f"payload length {plen} exceeds {self.limits.max_payload}")
            self._payload_len = plen
            self._set_buffer(bytearray(hlen), "header")
            return None
        if self._phase == "header":
            header = cj.parse_json(self._view, self.limits.max_header)
            kind = header.get("kind") if isinstance(header, dict) else None
            # Payload rules are decided by the header, before the payload is allocated.
            if kind in CONTROL_KINDS and self._payload_len != 0:
                raise ProtocolError("framing", f"{kind} frame carries a payload")
            if kind == "segment" and self._payload_len == 0:
                raise ProtocolError("framing", "empty segment")
            # The typed parse runs now, so a malformed or unknown header is refused before
            # a single payload byte is allocated or read.
            frame = parse_header(header, _EMPTY)
            if self._payload_len == 0:
                return self._finish(frame)
            assert isinstance(frame, Segment)  # only a segment header survives a nonzero payload length
            if self.payload_gate is not None:
                self.payload_gate(frame, self._payload_len)
            self._pending = frame
            target = None if self.payload_target is None else self.payload_target(frame, self._payload_len)
            if target is not None:
                if target.nbytes != self._payload_len:
                    raise ProtocolError("sink", f"payload target of {target.nbytes} bytes for a {self._payload_len}-byte payload", remote=False)
                self._set_buffer(_EMPTY, "payload")
                self._target = target
                return None
            self._set_buffer(self._payload_buffer(self._payload_len), "payload")
            return None
        # payload complete: attach it by reference to the already-parsed header.
        pending = self._pending
        assert pending is not None  # the payload phase is entered only with a pending segment
        if self._target is not None:
            return self._finish(replace(pending, payload=memoryview(_EMPTY), target=self._target))
        return self._finish(replace(pending, payload=self._view))

    def _finish(self, frame: Frame) -> Frame:
        self._pending = None
        self._set_buffer(self._preamble, "preamble")
        self.frames_decoded += 1
        return frame


def decode_all(data: bytes, limits: FrameLimits = FrameLimits()) -> list[Frame]:
    """Decode a complete byte string into frames, refusing trailing partial frames."""
    dec = FrameDecoder(limits)
    frames = dec.feed(data)
    dec.eof()
    return frames
