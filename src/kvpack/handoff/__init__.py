"""Handoff V2, pure: canonical JSON, manifests, frame codec, sender and receiver state
machines, span schedule, delta rules and control-plane messages (INTEROP PART C).

No module here touches sockets, files, clocks or randomness: drivers pass bytes, the
current time and collaborators (replay ledger, sink) in. See docs/protocol.md.

Nothing here may start a thread or a pool either: hashing runs on the executor a driver passes
(:mod:`.hashing`).
"""

from .events import Abort, Ack, Begin, Seal, Segment
from .frames import FrameDecoder, FrameLimits, encode_frame, frame_bytes
from .manifest import (
    BeginManifestV2,
    ComponentV2,
    ExactIdentityV1,
    HmacRef,
    MultimodalIdentityV1,
    SealCoreV2,
    SealManifestV2,
    SegmentDescriptorV2,
)
from .receiver import Admitted, Committed, Receiver, ReceiverConfig, ReplayGate, SegmentStored, Sink
from .schedule import MUSE, SpanLayout, SpanSegment, muse_intents, muse_schedule_span, schedule_span
from .sender import Sender, declare_segments, descriptor_for

__all__ = [
    "Abort",
    "Ack",
    "Begin",
    "Seal",
    "Segment",
    "FrameDecoder",
    "FrameLimits",
    "encode_frame",
    "frame_bytes",
    "BeginManifestV2",
    "ComponentV2",
    "ExactIdentityV1",
    "HmacRef",
    "MultimodalIdentityV1",
    "SealCoreV2",
    "SealManifestV2",
    "SegmentDescriptorV2",
    "Admitted",
    "Committed",
    "Receiver",
    "ReceiverConfig",
    "ReplayGate",
    "SegmentStored",
    "Sink",
    "MUSE",
    "SpanLayout",
    "SpanSegment",
    "muse_intents",
    "muse_schedule_span",
    "schedule_span",
    "Sender",
    "declare_segments",
    "descriptor_for",
]
