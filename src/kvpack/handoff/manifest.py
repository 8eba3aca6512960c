"""Typed Handoff V2 manifests: begin, segment descriptors, seal (INTEROP C.4-C.6, errata M1-M3).

Every object here is a frozen dataclass with three verbs:

* ``from_json(obj)`` -- the strict typed parse of an already-parsed JSON value: exact
  allow-lists, integers only where integers are required, exact enum strings. A refusal
  here is category ``json``.
* ``to_json()`` -- the typed serialization (the value whose canonical bytes are hashed).
* ``canonical_bytes()`` -- :func:`canonical_json.canonical_bytes` of ``to_json()``.

Semantic rules (C.4 ``ValidatedBeginV2``, C.5 descriptor rules, C.6 seal rules) live in
:func:`validate_begin`, :func:`check_descriptor`, :class:`OverlapTracker` and
:class:`SealAccumulator`, and refuse with ``manifest``, ``expired``, ``key``, ``digest`` or
``authentication``. Keeping parse and validation separate mirrors upstream (serde parse,
then ``validate``) and keeps the error classification exact (errata L4).

``begin_sha256`` is computed over the typed form, which by construction drops
``prefix_cut``, omits ``deferred_segments`` when false, includes ``multimodal: null`` and
gives every descriptor a ``layer`` key: exactly the normalization errata M2 prescribes.

It must never accept a field the upstream typed parse would refuse, and never hash anything but
canonical bytes.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac as _hmac
import re
from dataclasses import dataclass, field
from concurrent.futures import Executor
from typing import Any, Iterable, Optional, Sequence

from ..errors import ProtocolError
from ..vocab import is_hex64, sha256_hex
from . import canonical_json as cj
from .hashing import INLINE


PROTOCOL = "kvpack-live-handoff-v2"

#: The nine descriptor roles of C.5.
ROLES = frozenset(
    {
        "nope_key",
        "nope_value",
        "swa_key",
        "swa_value",
        "nope_tile",
        "swa_tile",
        "dflash_key",
        "dflash_value",
        "auxiliary",
    }
)
COMPONENT_KINDS = frozenset({"target_kv", "dflash_context", "vision_context"})
#: Bytes per element of each wire element type.
ELEMENT_SIZES = {"f16_le": 2, "f32_le": 4}

_TRANSFER_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}\Z")


def valid_transfer_id(value: Any) -> bool:
    """1..=128 ASCII characters of ``[A-Za-z0-9-_.]`` (C.4, errata L11)."""
    return isinstance(value, str) and value.isascii() and _TRANSFER_ID.match(value) is not None


def _require_hex(value: str, what: str) -> None:
    if not is_hex64(value):
        raise ProtocolError("manifest", f"{what} is not 64 lowercase hex digits")


# --- identity objects ------------------------------------------------------------------

_IDENTITY_DIGESTS = (
    "adapter_sha256",
    "chat_template_sha256",
    "context_policy_sha256",
    "model_sha256",
    "tokenizer_sha256",
)


@dataclass(frozen=True)
class ExactIdentityV1:
    """The exact model identity a cache belongs to; equality is exact, never fuzzy."""

    adapter_sha256: str
    chat_template_sha256: str
    context_policy_sha256: str
    model_revision: str
    model_sha256: str
    tokenizer_revision: str
    tokenizer_sha256: str

    KEYS = (*_IDENTITY_DIGESTS, "model_revision", "tokenizer_revision")

    @classmethod
    def from_json(cls, obj: Any) -> "ExactIdentityV1":
        cj.check_keys(obj, "identity", cls.KEYS)
        return cls(**{k: cj.string(obj[k], f"identity.{k}") for k in cls.KEYS})

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KEYS}

    def check_digests(self) -> None:
        for k in _IDENTITY_DIGESTS:
            _require_hex(getattr(self, k), f"identity.{k}")


@dataclass(frozen=True)
class MultimodalIdentityV1:
    """Digests binding a multimodal prompt (images) to the transfer (C.4, errata M5)."""

    image_sequence_sha256: str
    preprocessing_sha256: str
    projector_sha256: str

    KEYS = ("image_sequence_sha256", "preprocessing_sha256", "projector_sha256")

    @classmethod
    def from_json(cls, obj: Any) -> "MultimodalIdentityV1":
        cj.check_keys(obj, "multimodal", cls.KEYS)
        return cls(**{k: cj.string(obj[k], f"multimodal.{k}") for k in cls.KEYS})

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KEYS}

    def check_digests(self) -> None:
        for k in self.KEYS:
            _require_hex(getattr(self, k), f"multimodal.{k}")


@dataclass(frozen=True)
class HmacRef:
    """Which seal key (id, epoch) the producer claims to use."""

    key_id: str
    epoch: int

    @classmethod
    def from_json(cls, obj: Any) -> "HmacRef":
        cj.check_keys(obj, "hmac", ("key_id", "epoch"))
        return cls(cj.string(obj["key_id"], "hmac.key_id"), cj.u64(obj["epoch"], "hmac.epoch"))

    def to_json(self) -> dict[str, Any]:
        return {"key_id": self.key_id, "epoch": self.epoch}


@dataclass(frozen=True)
class ComponentV2:
    """One cache component of the transfer (target KV, DFlash draft context, vision)."""

    id: str
    kind: str
    required: bool
    identity_sha256: str

    KEYS = ("id", "kind", "required", "identity_sha256")

    @classmethod
    def from_json(cls, obj: Any, where: str = "component") -> "ComponentV2":
        cj.check_keys(obj, where, cls.KEYS)
        kind = cj.string(obj["kind"], f"{where}.kind")
        if kind not in COMPONENT_KINDS:
            raise ProtocolError("json", f"{where}.kind {kind!r} is not a component kind")
        return cls(
            cj.string(obj["id"], f"{where}.id"),
            kind,
            cj.boolean(obj["required"], f"{where}.required"),
            cj.string(obj["identity_sha256"], f"{where}.identity_sha256"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "required": self.required, "identity_sha256": self.identity_sha256}


# --- segment descriptors ---------------------------------------------------------------


@dataclass(frozen=True)
class SegmentDescriptorV2:
    """What one segment frame carries: which rows of which plane(s), and its digest (C.5)."""

    sequence: int
    component_id: str
    role: str
    layer: Optional[int]
    logical_start: int
    logical_count: int
    element_type: str
    elements_per_token: int
    byte_len: int
    sha256: str

    KEYS = (
        "sequence",
        "component_id",
        "role",
        "layer",
        "logical_start",
        "logical_count",
        "element_type",
        "elements_per_token",
        "byte_len",
        "sha256",
    )

    @classmethod
    def from_json(cls, obj: Any, where: str = "descriptor") -> "SegmentDescriptorV2":
        # layer is the one optional key (absent == null, errata M1).
        cj.check_keys(obj, where, [k for k in cls.KEYS if k != "layer"], ("layer",))
        role = cj.string(obj["role"], f"{where}.role")
        if role not in ROLES:
            raise ProtocolError("json", f"{where}.role {role!r} is not a segment role")
        etype = cj.string(obj["element_type"], f"{where}.element_type")
        if etype not in ELEMENT_SIZES:
            raise ProtocolError("json", f"{where}.element_type {etype!r} is not an element type")
        layer = obj.get("layer")
        return cls(
            sequence=cj.u32(obj["sequence"], f"{where}.sequence"),
            component_id=cj.string(obj["component_id"], f"{where}.component_id"),
            role=role,
            layer=None if layer is None else cj.u32(layer, f"{where}.layer"),
            logical_start=cj.u64(obj["logical_start"], f"{where}.logical_start"),
            logical_count=cj.u64(obj["logical_count"], f"{where}.logical_count"),
            element_type=etype,
            elements_per_token=cj.u32(obj["elements_per_token"], f"{where}.elements_per_token"),
            byte_len=cj.u64(obj["byte_len"], f"{where}.byte_len"),
            sha256=cj.string(obj["sha256"], f"{where}.sha256"),
        )

    def to_json(self) -> dict[str, Any]:
        # Always all ten keys, layer null when absent (errata M2).
        return {k: getattr(self, k) for k in self.KEYS}

    def canonical_bytes(self) -> bytes:
        return cj.canonical_bytes(self.to_json())

    @property
    def plane_key(self) -> tuple[str, str, Optional[int]]:
        """The (component, role, layer) key that ranges must not overlap within."""
        return (self.component_id, self.role, self.layer)


def check_descriptor(d: SegmentDescriptorV2, component_ids: Iterable[str] | set[str]) -> None:
    """Per-descriptor rules of C.5 (independent of other descriptors)."""
    if d.component_id not in component_ids:
        raise ProtocolError("manifest", f"segment {d.sequence}: unknown component {d.component_id!r}")
    if d.logical_count == 0 or d.elements_per_token == 0 or d.byte_len == 0:
        raise ProtocolError("manifest", f"segment {d.sequence}: zero count, width or length")
    _require_hex(d.sha256, f"segment {d.sequence} sha256")
    expected = d.logical_count * d.elements_per_token * ELEMENT_SIZES[d.element_type]
    if d.byte_len != expected:
        raise ProtocolError("manifest", f"segment {d.sequence}: byte_len {d.byte_len} != count*width*size {expected}")
    if d.logical_start + d.logical_count > cj.U64_MAX:
        raise ProtocolError("manifest", f"segment {d.sequence}: range end overflows u64")


class OverlapTracker:
    """Refuses overlapping ``[start, start+count)`` ranges per (component, role, layer).

    Ranges are kept sorted per key, so each insertion is a bisect plus two neighbour checks;
    both declared (all at once) and deferred (one per frame) modes use it.
    """

    def __init__(self) -> None:
        self._starts: dict[tuple[str, str, Optional[int]], list[int]] = {}
        self._ends: dict[tuple[str, str, Optional[int]], list[int]] = {}

    def add(self, d: SegmentDescriptorV2) -> None:
        i = self.check(d)
        lo, hi = d.logical_start, d.logical_start + d.logical_count
        self._starts.setdefault(d.plane_key, []).insert(i, lo)
        self._ends.setdefault(d.plane_key, []).insert(i, hi)

    def check(self, d: SegmentDescriptorV2) -> int:
        """Refuse ``d`` if it overlaps a range already added (records nothing); returns
        where :meth:`add` inserts it."""
        key = d.plane_key
        starts = self._starts.get(key, [])
        ends = self._ends.get(key, [])
        lo, hi = d.logical_start, d.logical_start + d.logical_count
        i = bisect.bisect_left(starts, lo)
        if (i > 0 and ends[i - 1] > lo) or (i < len(starts) and starts[i] < hi):
            raise ProtocolError("manifest", f"segment {d.sequence}: range [{lo},{hi}) overlaps another for {key}")
        return i


# --- begin manifest --------------------------------------------------------------------

_BEGIN_REQUIRED = (
    "protocol",
    "transfer_id",
    "generation",
    "created_unix_ms",
    "expires_unix_ms",
    "identity",
    "prompt_token_ids",
    "hmac",
    "components",
    "segments",
)
#: prefix_cut is allowed in the raw object but not part of the typed manifest (C.3, C.6).
_BEGIN_OPTIONAL = ("multimodal", "deferred_segments", "prefix_cut")


@dataclass(frozen=True)
class BeginManifestV2:
    """The begin manifest (C.4). ``prefix_cut`` is deliberately not a field: upstream's typed
    struct drops it, so it never enters ``begin_sha256`` (see :mod:`delta`)."""

    protocol: str
    transfer_id: str
    generation: int
    created_unix_ms: int
    expires_unix_ms: int
    identity: ExactIdentityV1
    prompt_token_ids: tuple[int, ...]
    multimodal: Optional[MultimodalIdentityV1]
    hmac: HmacRef
    components: tuple[ComponentV2, ...]
    segments: tuple[SegmentDescriptorV2, ...] = ()
    deferred_segments: bool = False

    @classmethod
    def from_json(cls, obj: Any) -> "BeginManifestV2":
        cj.check_keys(obj, "manifest", _BEGIN_REQUIRED, _BEGIN_OPTIONAL)
        mm = obj.get("multimodal")
        return cls(
            protocol=cj.string(obj["protocol"], "manifest.protocol"),
            transfer_id=cj.string(obj["transfer_id"], "manifest.transfer_id"),
            generation=cj.u64(obj["generation"], "manifest.generation"),
            created_unix_ms=cj.u64(obj["created_unix_ms"], "manifest.created_unix_ms"),
            expires_unix_ms=cj.u64(obj["expires_unix_ms"], "manifest.expires_unix_ms"),
            identity=ExactIdentityV1.from_json(obj["identity"]),
            prompt_token_ids=cj.u32_array(obj["prompt_token_ids"], "manifest.prompt_token_ids"),
            multimodal=None if mm is None else MultimodalIdentityV1.from_json(mm),
            hmac=HmacRef.from_json(obj["hmac"]),
            components=tuple(ComponentV2.from_json(c, f"components[{i}]") for i, c in enumerate(cj.array(obj["components"], "manifest.components"))),
            segments=tuple(SegmentDescriptorV2.from_json(d, f"segments[{i}]") for i, d in enumerate(cj.array(obj["segments"], "manifest.segments"))),
            deferred_segments=cj.boolean(obj.get("deferred_segments", False), "manifest.deferred_segments"),
        )

    def to_json(self) -> dict[str, Any]:
        out = {
            "protocol": self.protocol,
            "transfer_id": self.transfer_id,
            "generation": self.generation,
            "created_unix_ms": self.created_unix_ms,
            "expires_unix_ms": self.expires_unix_ms,
            "identity": self.identity.to_json(),
            "prompt_token_ids": list(self.prompt_token_ids),
            "multimodal": None if self.multimodal is None else self.multimodal.to_json(),
            "hmac": self.hmac.to_json(),
            "components": [c.to_json() for c in self.components],
            "segments": [d.to_json() for d in self.segments],
        }
        if self.deferred_segments:
            out["deferred_segments"] = True
        return out

    def canonical_bytes(self) -> bytes:
        return cj.canonical_bytes(self.to_json())

    def begin_sha256(self) -> str:
        """SHA-256 of the canonical typed manifest: the value the seal binds (C.6, M2)."""
        return sha256_hex(self.canonical_bytes())

    @property
    def position(self) -> int:
        """Rows the cache covers: the prompt as sent (the boundary token is held back)."""
        return len(self.prompt_token_ids)

    def component(self, cid: str) -> Optional[ComponentV2]:
        for c in self.components:
            if c.id == cid:
                return c
        return None


def validate_begin(m: BeginManifestV2, *, now_unix_ms: int, expected_key_id: str, minimum_epoch: int) -> None:
    """``ValidatedBeginV2::validate`` (C.4), in upstream's order.

    Raises ``manifest`` for structural rules, ``expired`` for the time window and ``key``
    for the key id / epoch.
    """
    if m.protocol != PROTOCOL:
        raise ProtocolError("manifest", f"protocol {m.protocol!r} is not {PROTOCOL!r}")
    if not valid_transfer_id(m.transfer_id):
        raise ProtocolError("manifest", "transfer_id is not 1..128 of [A-Za-z0-9-_.]")
    if m.expires_unix_ms <= m.created_unix_ms:
        raise ProtocolError("manifest", "expires_unix_ms is not after created_unix_ms")
    if now_unix_ms > m.expires_unix_ms:
        raise ProtocolError("expired", f"begin expired at {m.expires_unix_ms}, now {now_unix_ms}")
    if not _hmac.compare_digest(m.hmac.key_id.encode("utf-8"), expected_key_id.encode("utf-8")):
        raise ProtocolError("key", f"key id {m.hmac.key_id!r} is not the configured key")
    if m.hmac.epoch < minimum_epoch:
        raise ProtocolError("key", f"key epoch {m.hmac.epoch} below minimum {minimum_epoch}")
    m.identity.check_digests()
    if m.multimodal is not None:
        m.multimodal.check_digests()
    if not m.components:
        raise ProtocolError("manifest", "no components")
    if m.deferred_segments:
        if m.segments:
            raise ProtocolError("manifest", "deferred mode with declared segments")
    elif not m.segments:
        raise ProtocolError("manifest", "declared mode without segments")
    if not m.prompt_token_ids:
        raise ProtocolError("manifest", "empty prompt")
    ids: set[str] = set()
    for c in m.components:
        if not c.id:
            raise ProtocolError("manifest", "empty component id")
        if c.id in ids:
            raise ProtocolError("manifest", f"duplicate component id {c.id!r}")
        ids.add(c.id)
        _require_hex(c.identity_sha256, f"component {c.id!r} identity_sha256")
    if not any(c.kind == "target_kv" and c.required for c in m.components):
        raise ProtocolError("manifest", "no required target_kv component")
    if not m.deferred_segments:
        overlap = OverlapTracker()
        for i, d in enumerate(m.segments):
            if d.sequence != i:
                raise ProtocolError("manifest", f"declared segment {i} has sequence {d.sequence}")
            check_descriptor(d, ids)
            overlap.add(d)
        used = {d.component_id for d in m.segments}
        for c in m.components:
            if c.kind == "dflash_context" and c.required and c.id not in used:
                raise ProtocolError("manifest", f"required dflash component {c.id!r} has no segments")


# --- seal ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SealCoreV2:
    """What the seal binds (C.6); its canonical JSON is the HMAC input, no domain tag."""

    transfer_id: str
    generation: int
    begin_sha256: str
    descriptor_sha256: str
    payload_sha256: str
    segment_count: int
    total_bytes: int

    KEYS = (
        "transfer_id",
        "generation",
        "begin_sha256",
        "descriptor_sha256",
        "payload_sha256",
        "segment_count",
        "total_bytes",
    )

    @classmethod
    def from_json(cls, obj: Any) -> "SealCoreV2":
        cj.check_keys(obj, "seal.core", cls.KEYS)
        return cls(
            transfer_id=cj.string(obj["transfer_id"], "core.transfer_id"),
            generation=cj.u64(obj["generation"], "core.generation"),
            begin_sha256=cj.string(obj["begin_sha256"], "core.begin_sha256"),
            descriptor_sha256=cj.string(obj["descriptor_sha256"], "core.descriptor_sha256"),
            payload_sha256=cj.string(obj["payload_sha256"], "core.payload_sha256"),
            segment_count=cj.u32(obj["segment_count"], "core.segment_count"),
            total_bytes=cj.u64(obj["total_bytes"], "core.total_bytes"),
        )

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.KEYS}

    def canonical_bytes(self) -> bytes:
        return cj.canonical_bytes(self.to_json())


@dataclass(frozen=True)
class SealManifestV2:
    core: SealCoreV2
    hmac_sha256: str

    @classmethod
    def from_json(cls, obj: Any) -> "SealManifestV2":
        cj.check_keys(obj, "seal", ("core", "hmac_sha256"))
        return cls(SealCoreV2.from_json(obj["core"]), cj.string(obj["hmac_sha256"], "seal.hmac_sha256"))

    def to_json(self) -> dict[str, Any]:
        return {"core": self.core.to_json(), "hmac_sha256": self.hmac_sha256}


def seal_tag(key: bytes, core: SealCoreV2) -> str:
    """Lowercase hex HMAC-SHA-256(key, canonical(core)); Handoff V2 uses no domain tag."""
    return _hmac.new(key, core.canonical_bytes(), hashlib.sha256).hexdigest()


def verify_seal_tag(key: bytes, seal: SealManifestV2) -> None:
    """Constant-time tag check; the tag must first be 64 lowercase hex (C.6)."""
    if not is_hex64(seal.hmac_sha256):
        raise ProtocolError("authentication", "seal tag is not 64 lowercase hex digits")
    expected = seal_tag(key, seal.core)
    if not _hmac.compare_digest(expected.encode("ascii"), seal.hmac_sha256.encode("ascii")):
        raise ProtocolError("authentication", "seal HMAC does not verify")


#: Payloads at least this large have their two digests computed concurrently when the caller
#: passes a thread pool (smaller ones are not worth the hand-off).
_PARALLEL_HASH_MIN = 1 << 20


@dataclass
class SealAccumulator:
    """Running digests both sides keep while segments flow (C.6).

    ``descriptor_sha256`` is the plain concatenation of canonical descriptors (no domain, no
    separator); ``payload_sha256`` is over all payload bytes in wire order. hashlib is fed
    the payload buffers directly, so large payloads are hashed in C without copies and with
    the GIL released.
    """

    descriptor_hash: Any = field(default_factory=hashlib.sha256)
    payload_hash: Any = field(default_factory=hashlib.sha256)
    segment_count: int = 0
    total_bytes: int = 0

    def add_descriptor(self, d: SegmentDescriptorV2) -> None:
        self.descriptor_hash.update(d.canonical_bytes())

    def add_payload(self, payload: bytes | bytearray | memoryview) -> None:
        self.payload_hash.update(payload)
        self.segment_count += 1
        self.total_bytes += len(payload)

    def add_payload_and_digest(self, payload: bytes | bytearray | memoryview, executor: Executor = INLINE) -> str:
        """Feed the running payload digest and return the segment's own SHA-256 (hex).

        Both passes read the same bytes; with a thread-pool ``executor`` a large payload's
        segment digest runs on it while this thread feeds the running digest (hashlib
        releases the GIL), so a segment costs one hash pass of wall time instead of two.
        The result is identical either way; the default runs both here, one after the other.
        """
        view = memoryview(payload).cast("B")
        if executor is not INLINE and view.nbytes >= _PARALLEL_HASH_MIN:
            pending = executor.submit(sha256_hex, view)
            self.add_payload(view)
            return pending.result()
        digest = sha256_hex(view)
        self.add_payload(view)
        return digest

    def add_pieces_and_digest(self, pieces: Sequence[memoryview], nbytes: int, executor: Executor = INLINE) -> str:
        """:meth:`add_payload_and_digest` for a payload held in pieces (in wire order)."""

        def segment_digest() -> str:
            h = hashlib.sha256()
            for piece in pieces:
                h.update(piece)
            return h.hexdigest()

        pending = executor.submit(segment_digest) if executor is not INLINE and nbytes >= _PARALLEL_HASH_MIN else None
        self.add_pieces(pieces, nbytes)
        return segment_digest() if pending is None else pending.result()

    def add_pieces(self, pieces: Sequence[memoryview], nbytes: int) -> None:
        """:meth:`add_payload` for a payload held in pieces (in wire order)."""
        for piece in pieces:
            self.payload_hash.update(piece)
        self.segment_count += 1
        self.total_bytes += nbytes

    def add_streamed_payload(self, running_hash: Any, nbytes: int) -> None:
        """Count one payload of ``nbytes`` whose bytes a streaming hasher already fed into
        ``running_hash``, a copy of :attr:`payload_hash` continued over exactly that payload
        (:mod:`.streamhash`); it becomes the running payload digest."""
        self.payload_hash = running_hash
        self.segment_count += 1
        self.total_bytes += nbytes

    def core(self, begin: BeginManifestV2) -> SealCoreV2:
        return SealCoreV2(
            transfer_id=begin.transfer_id,
            generation=begin.generation,
            begin_sha256=begin.begin_sha256(),
            descriptor_sha256=self.descriptor_hash.hexdigest(),
            payload_sha256=self.payload_hash.hexdigest(),
            segment_count=self.segment_count,
            total_bytes=self.total_bytes,
        )


def check_seal(key: bytes, seal: SealManifestV2, expected: SealCoreV2) -> None:
    """Receiver-side seal check: identity and every count/digest, then the HMAC.

    Each mismatch is named (the upstream message lumps them; naming them is what makes a
    refusal useful evidence). Digest comparisons are constant-time too, although they are
    not secrets, so that no comparison on this path leaks timing.
    """
    core = seal.core
    if core.transfer_id != expected.transfer_id or core.generation != expected.generation:
        raise ProtocolError("manifest", "seal names another transfer or generation")
    if core.segment_count != expected.segment_count:
        raise ProtocolError("sequence", f"seal counts {core.segment_count} segments, received {expected.segment_count}")
    if core.total_bytes != expected.total_bytes:
        raise ProtocolError("digest", f"seal total_bytes {core.total_bytes} != received {expected.total_bytes}")
    for name in ("begin_sha256", "descriptor_sha256", "payload_sha256"):
        got, want = getattr(core, name), getattr(expected, name)
        if not (is_hex64(got) and _hmac.compare_digest(got.encode(), want.encode())):
            raise ProtocolError("digest", f"seal {name} does not match what was received")
    verify_seal_tag(key, seal)
