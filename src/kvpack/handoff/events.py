"""Handoff V2 frame events (C.3): one frozen dataclass per frame kind.

These are what the frame codec turns bytes into and back, and what the sender and receiver
state machines consume and produce. Segment payloads are ``memoryview`` references: the
codec never copies a payload after it lands, and the sender never copies the caller's
buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .manifest import BeginManifestV2, SealManifestV2, SegmentDescriptorV2
from .target import PayloadTarget


@dataclass(frozen=True)
class Begin:
    """Producer -> receiver: the begin manifest plus the raw-lifted ``prefix_cut`` (0 = full)."""

    manifest: BeginManifestV2
    prefix_cut: int = 0


@dataclass(frozen=True)
class Segment:
    """Producer -> receiver: one payload. ``descriptor`` is set exactly in deferred mode.

    ``target``: a decoder that read the payload straight into a consumer's destination
    pieces (:mod:`.target`) sets it, and ``payload`` is then empty."""

    sequence: int
    payload: memoryview
    descriptor: Optional[SegmentDescriptorV2] = None
    target: Optional[PayloadTarget] = None

    @property
    def payload_bytes(self) -> int:
        return self.target.nbytes if self.target is not None else self.payload.nbytes


@dataclass(frozen=True)
class Seal:
    """Producer -> receiver: the HMAC-sealed digest core."""

    manifest: SealManifestV2


@dataclass(frozen=True)
class Ack:
    """Receiver -> producer only: the transfer is committed."""

    transfer_id: str
    generation: int


@dataclass(frozen=True)
class Abort:
    """Producer -> receiver: the producer gave up (reason ``"producer failure"`` upstream)."""

    reason: str


Frame = Union[Begin, Segment, Seal, Ack, Abort]
