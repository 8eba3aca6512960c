"""Shared builders for the handoff tests: manifests, a recording sink, a ledger, transfers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

from kvpack.errors import ProtocolError, SecurityError
from kvpack.handoff.admission import AdmissionExpectations
from kvpack.handoff.manifest import (
    PROTOCOL,
    BeginManifestV2,
    ComponentV2,
    ExactIdentityV1,
    HmacRef,
)
from kvpack.handoff.receiver import Receiver, ReceiverConfig
from kvpack.handoff.schedule import SpanClass, SpanLayout, schedule_span
from kvpack.handoff.sender import Sender, declare_segments

KEY = bytes([7]) * 32
KEY_ID = "loop-key"
CREATED = 1_700_000_000_000
EXPIRES = CREATED + 900_000
NOW = CREATED + 1_000

IDENTITY = ExactIdentityV1(
    adapter_sha256="a" * 64,
    chat_template_sha256="b" * 64,
    context_policy_sha256="c" * 64,
    model_revision="m",
    model_sha256="d" * 64,
    tokenizer_revision="t",
    tokenizer_sha256="e" * 64,
)
TARGET = ComponentV2("target", "target_kv", True, "f" * 64)

#: A miniature Muse-shaped layout (windowed groups first, then full-span tiles) so that
#: multi-segment transfers stay a few KiB and byte-by-byte sweeps stay fast.
TINY = SpanLayout(
    name="tiny",
    classes=(
        SpanClass("swa", "swa_tile", (0, 1, 2, 4, 5, 6), 16, 3, True),
        SpanClass("nope", "nope_tile", (3, 7), None, 2, False),
    ),
    tile_tokens=8,
    plane_elements=4,
)


def manifest(
    prompt=(5,),
    *,
    segments=(),
    deferred=False,
    transfer_id="muser-1700000000000-0-1",
    generation=1,
    epoch=1,
    key_id=KEY_ID,
    components=(TARGET,),
    created=CREATED,
    expires=EXPIRES,
) -> BeginManifestV2:
    return BeginManifestV2(
        protocol=PROTOCOL,
        transfer_id=transfer_id,
        generation=generation,
        created_unix_ms=created,
        expires_unix_ms=expires,
        identity=IDENTITY,
        prompt_token_ids=tuple(prompt),
        multimodal=None,
        hmac=HmacRef(key_id, epoch),
        components=tuple(components),
        segments=tuple(segments),
        deferred_segments=deferred,
    )


def payloads_for(intents, seed: int = 1) -> list[bytes]:
    """Deterministic, distinct payload bytes per segment (so reorders change digests)."""
    out = []
    for i, seg in enumerate(intents):
        n = seg.byte_len
        block = hashlib.sha256(f"{seed}:{i}".encode()).digest()
        out.append((block * (n // 32 + 1))[:n])
    return out


@dataclass
class RecordingSink:
    """Records every call; never publishes anything before ``commit``."""

    refuse: Optional[str] = None  # name of the call that raises
    calls: list = field(default_factory=list)
    written: list = field(default_factory=list)
    live: Optional[bytes] = None  # what a decode would see

    def _maybe(self, name):
        self.calls.append(name)
        if self.refuse == name:
            raise RuntimeError(f"sink refuses {name}")

    def begin(self, manifest, prefix_cut):
        self._maybe("begin")
        self.detached = []

    def write_segment(self, d, payload):
        self._maybe("write_segment")
        self.detached.append(bytes(payload))
        self.written.append(d)

    def prepare(self):
        self._maybe("prepare")

    def commit(self):
        self._maybe("commit")
        self.live = b"".join(self.detached)

    def abort(self):
        self._maybe("abort")
        self.detached = []

    @property
    def committed(self) -> bool:
        return "commit" in self.calls and self.refuse != "commit"


@dataclass
class MemoryLedger:
    """ReplayLedger semantics (C.9) in memory; ``refuse_reserve`` simulates a failed fsync."""

    highest: dict = field(default_factory=dict)
    refuse_reserve: bool = False
    calls: list = field(default_factory=list)

    def admit(self, key_id, epoch, generation):
        self.calls.append(("admit", generation))
        if generation == 0:
            raise SecurityError("replay", "zero generation")
        h = self.highest.get(f"{key_id}:{epoch}")
        if h is not None and generation <= h:
            raise SecurityError("replay", f"generation {generation} <= {h}")

    def reserve(self, key_id, epoch, generation):
        self.admit(key_id, epoch, generation)
        self.calls.append(("reserve", generation))
        if self.refuse_reserve:
            raise SecurityError("degraded", "persist failed")
        self.highest[f"{key_id}:{epoch}"] = generation


def expectations(prompt_with_boundary, request_id="muser-1700000000000-0") -> AdmissionExpectations:
    return AdmissionExpectations(
        identity=IDENTITY,
        target_cache_identity_sha256=TARGET.identity_sha256,
        max_context=131072,
        request_prompt=tuple(prompt_with_boundary),
        request_id=request_id,
    )


def build_transfer(layout=TINY, position=20, cut=0, deferred=False, seed=1, **mkw):
    """A real multi-segment transfer: returns (manifest, sender frames as bytes list, intents, payloads)."""
    intents = schedule_span(layout, position, cut)
    payloads = payloads_for(intents, seed)
    prompt = mkw.pop("prompt", tuple(range(100, 100 + position)))
    if deferred:
        m = manifest(prompt, deferred=True, **mkw)
    else:
        m = manifest(prompt, segments=declare_segments(intents, payloads), **mkw)
    s = Sender(m, KEY, prefix_cut=cut)
    frames = [b"".join(bytes(b) for b in s.begin())]
    for intent, p in zip(intents, payloads):
        out = s.send_segment(p, intent if deferred else None)
        frames.append(b"".join(bytes(b) for b in out))
    frames.append(b"".join(bytes(b) for b in s.seal()))
    return m, frames, intents, payloads, s


def receiver(layout=TINY, *, key=KEY, key_id=KEY_ID, minimum_epoch=1, now=NOW, held=None, exp=None, ledger=None, sink=None):
    sink = sink if sink is not None else RecordingSink()
    ledger = ledger if ledger is not None else MemoryLedger()
    cfg = ReceiverConfig(key=key, key_id=key_id, minimum_epoch=minimum_epoch, layout=layout, expectations=exp)
    return Receiver(cfg, sink, ledger, now_unix_ms=now, held_token_ids=held), sink, ledger


def run(stream: bytes, **kw):
    """Feed ``stream`` then EOF; returns (receiver, sink, ledger, error-or-None, effects)."""
    r, sink, ledger = receiver(**kw)
    effects = []
    err = None
    try:
        effects = r.receive_data(stream)
        r.eof()
    except ProtocolError as exc:
        err = exc
    return r, sink, ledger, err, effects
