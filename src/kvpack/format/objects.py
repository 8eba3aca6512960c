"""Canonical production-v1 objects (INTEROP.md A.3): state key, family (KVFAM1), state
declaration (KVSTS1), realized cut schema (KVRCS1) and cut manifest (KVMNF1).

Decoders here are *structural*: they read fields in wire order, check each count, enum and
reserved field the moment it is read (INTEROP-A-ERRATA §4.1-4.5), require exact consumption
and re-encode to compare. Semantic rules live in :mod:`kvpack.format.validate`.

Decoders here must never accept trailing bytes or a non-canonical encoding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from functools import cached_property

from . import constants as C
from .identity import InputCutId, SemanticModelId
from .wire import Reader, check_header, fail, header, u8, u16, u32, u64


# -- state keys and shapes ------------------------------------------------------------------
@dataclass(frozen=True, order=False)
class StateKey:
    layer: int
    name: str

    @cached_property
    def name_bytes(self) -> bytes:
        return self.name.encode("utf-8")

    def sort_key(self) -> tuple[int, bytes]:
        # raw UTF-8 byte order == Unicode code-point order (errata S3-18)
        return (self.layer, self.name_bytes)

    def encode(self) -> bytes:
        return u32(self.layer) + u16(len(self.name_bytes)) + self.name_bytes

    @classmethod
    def read(cls, r: Reader) -> "StateKey":
        layer = r.u32()
        n = r.u16()
        raw = r.take(n)
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise fail("semantics", f"{r.what}: state name is not valid UTF-8") from None
        return cls(layer, name)

    def __str__(self) -> str:
        return f"{self.layer}/{self.name}"


def encode_shape(dims: tuple[int, ...]) -> bytes:
    return u8(len(dims)) + b"".join(u64(d) for d in dims)


def read_shape(r: Reader, *, allow_zero: bool) -> tuple[int, ...]:
    rank = r.count(1, 1, C.MAX_RANK, "rank")
    dims = tuple(r.u64() for _ in range(rank))
    if not allow_zero and 0 in dims:
        raise fail("bounds", f"{r.what}: zero dimension in shape {dims}")
    return dims


# -- family ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FamilyState:
    key: StateKey
    dtype: int
    codec: int
    dims: tuple[int, ...]  # 0 marks the token axis
    token_axis: int
    elements_per_token: int
    layout: int = C.LAYOUT_CONTIGUOUS
    token_axis_rule: int = C.AXIS_DIRECT
    codec_version: int = C.CODEC_VERSION
    cache_kind: int = C.CACHE_KIND_ORDINARY
    dependencies: tuple[StateKey, ...] = ()

    @property
    def width(self) -> int:
        return C.DTYPE_WIDTHS[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * self.width

    def encode(self) -> bytes:
        return b"".join(
            [
                self.key.encode(),
                u16(self.cache_kind),
                u16(self.dtype),
                u16(self.codec),
                u16(self.codec_version),
                u16(self.layout),
                u16(self.token_axis_rule),
                u8(self.token_axis),
                u8(0),
                u64(self.elements_per_token),
                encode_shape(self.dims),
                u16(len(self.dependencies)),
                *(d.encode() for d in self.dependencies),
            ]
        )

    @classmethod
    def read(cls, r: Reader) -> "FamilyState":
        key = StateKey.read(r)

        def enum(name: str, allowed: Container[int]) -> int:
            v = r.u16()
            if v not in allowed:
                raise fail("unknown_enum", f"{r.what}: {name} {v}")
            return v

        cache_kind = enum("cache_kind", (C.CACHE_KIND_ORDINARY,))
        dtype = enum("dtype", C.DTYPE_WIDTHS)
        codec = enum("codec", C.CODECS)
        codec_version = r.u16()  # checked by family validation (category codec)
        layout = enum("layout", (C.LAYOUT_CONTIGUOUS, C.LAYOUT_STRIDED))
        rule = enum("token_axis_rule", (C.AXIS_DIRECT, C.AXIS_GATHER))
        token_axis = r.u8()
        r.zero(1, "state reserved")
        elements = r.u64()
        dims = read_shape(r, allow_zero=True)
        dep_count = r.count(2, 0, C.MAX_DEPENDENCIES_PER_STATE, "dependency count")
        deps = tuple(StateKey.read(r) for _ in range(dep_count))
        return cls(key, dtype, codec, dims, token_axis, elements, layout, rule, codec_version, cache_kind, deps)


@dataclass(frozen=True)
class Family:
    engine_cache_abi: bytes
    topology: bytes
    shard_map: bytes
    states: tuple[FamilyState, ...]
    mode: int = C.MODE_NATIVE
    page_size_tokens: int = C.PREFIX_BLOCK_TOKENS

    def encode_body(self) -> bytes:
        return b"".join(
            [
                self.engine_cache_abi,
                u16(self.mode),
                u16(0),
                u32(self.page_size_tokens),
                self.topology,
                self.shard_map,
                u32(len(self.states)),
                *(s.encode() for s in self.states),
            ]
        )

    def encode(self) -> bytes:
        return header(C.MAGIC_FAMILY) + self.encode_body()

    @classmethod
    def read_body(cls, r: Reader) -> "Family":
        abi = r.id32()
        mode = r.u16()
        if mode not in (C.MODE_NATIVE, C.MODE_PORTABLE):
            raise fail("unknown_enum", f"{r.what}: family mode {mode}")
        r.zero(2, "family reserved")
        page = r.u32()
        topology = r.id32()
        shard = r.id32()
        n = r.count(4, 1, C.MAX_STATES, "family state count")
        states = tuple(FamilyState.read(r) for _ in range(n))
        return cls(abi, topology, shard, states, mode, page)

    @classmethod
    def decode(cls, data: bytes, *, validate: bool = True) -> "Family":
        r = Reader(data, "family")
        check_header(r, C.MAGIC_FAMILY, "family")
        fam = cls.read_body(r)
        r.end()
        if fam.encode() != bytes(data):
            raise fail("reserved", "family: re-encoding differs")
        if validate:
            from .validate import validate_family

            validate_family(fam)
        return fam

    def digest(self) -> bytes:
        return hashlib.sha256(C.D_FAMILY + self.encode()).digest()

    def state(self, key: StateKey) -> FamilyState | None:
        return self._states_by_key.get(key)

    @cached_property
    def _states_by_key(self) -> dict[StateKey, FamilyState]:
        """Every chunk a restore verifies looks its state up: a dict, not a scan of the
        states comparing dataclasses (2.5% of a host restore's samples: docs/bench/)."""
        by_key: dict[StateKey, FamilyState] = {}
        for s in self.states:
            by_key.setdefault(s.key, s)  # the first, as the scan found it
        return by_key


# -- realized cut schema --------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    token_start: int
    token_count: int
    plaintext_offset: int
    plaintext_bytes: int

    def encode(self) -> bytes:
        return u64(self.token_start) + u64(self.token_count) + u64(self.plaintext_offset) + u32(self.plaintext_bytes)

    @classmethod
    def read(cls, r: Reader) -> "Span":
        return cls(r.u64(), r.u64(), r.u64(), r.u32())


@dataclass(frozen=True)
class RealizedState:
    key: StateKey
    full_shape: tuple[int, ...]
    segment_shape: tuple[int, ...]
    strides: tuple[int, ...]
    logical_start: int
    logical_count: int
    physical_offset_bytes: int
    physical_span_bytes: int
    complete_physical_bytes: int
    absolute_position: int
    spans: tuple[Span, ...]
    window: int = 0

    def encode(self) -> bytes:
        return b"".join(
            [
                self.key.encode(),
                encode_shape(self.full_shape),
                encode_shape(self.segment_shape),
                u8(len(self.strides)),
                *(u64(s) for s in self.strides),
                u64(self.logical_start),
                u64(self.logical_count),
                u64(self.physical_offset_bytes),
                u64(self.physical_span_bytes),
                u64(self.complete_physical_bytes),
                u64(self.absolute_position),
                u64(self.window),
                u32(len(self.spans)),
                *(s.encode() for s in self.spans),
            ]
        )

    @classmethod
    def read(cls, r: Reader) -> "RealizedState":
        key = StateKey.read(r)
        full = read_shape(r, allow_zero=False)
        seg = read_shape(r, allow_zero=False)
        ns = r.count(1, 0, C.MAX_RANK, "stride count")
        strides = tuple(r.u64() for _ in range(ns))
        ls, lc, po, ps, cp, ap, win = (r.u64() for _ in range(7))
        nspan = r.count(4, 1, C.MAX_CHUNKS_PER_STATE, "span count")
        spans = tuple(Span.read(r) for _ in range(nspan))
        return cls(key, full, seg, strides, ls, lc, po, ps, cp, ap, spans, win)


@dataclass(frozen=True)
class AtomicGroup:
    group_id: int
    keys: tuple[StateKey, ...]

    def encode(self) -> bytes:
        return u32(self.group_id) + u32(len(self.keys)) + b"".join(k.encode() for k in self.keys)

    @classmethod
    def read(cls, r: Reader) -> "AtomicGroup":
        gid = r.u32()
        n = r.count(4, 1, C.MAX_STATES, "group size")
        return cls(gid, tuple(StateKey.read(r) for _ in range(n)))


@dataclass(frozen=True)
class DeltaParent:
    manifest_id: bytes
    cut: InputCutId


@dataclass(frozen=True)
class Schema:
    states: tuple[RealizedState, ...]
    groups: tuple[AtomicGroup, ...]
    segment_restored_bytes: int
    complete_restored_bytes: int
    depth: int = 0
    parent: DeltaParent | None = None  # present exactly for delta schemas

    @property
    def kind(self) -> int:
        return C.KIND_DELTA if self.parent is not None else C.KIND_FULL

    def encode_body(self) -> bytes:
        parts = [u8(self.kind), u8(self.depth), u16(0)]
        if self.parent is not None:
            parts += [self.parent.manifest_id, self.parent.cut.encode()]
        parts += [u32(len(self.states)), *(s.encode() for s in self.states)]
        parts += [u32(len(self.groups)), *(g.encode() for g in self.groups)]
        parts += [u64(self.segment_restored_bytes), u64(self.complete_restored_bytes)]
        return b"".join(parts)

    def encode(self) -> bytes:
        return header(C.MAGIC_SCHEMA) + self.encode_body()

    @classmethod
    def read_body(cls, r: Reader) -> "Schema":
        kind = r.u8()
        depth = r.u8()
        r.zero(2, "schema kind reserved")
        parent = None
        if kind == C.KIND_FULL:
            if depth != 0:
                raise fail("reserved", f"{r.what}: full schema with depth {depth}")
        elif kind == C.KIND_DELTA:
            # parent fields are only checked by manifest validation (category graph)
            parent = DeltaParent(r.id32(), InputCutId.read(r))
        else:
            raise fail("unknown_enum", f"{r.what}: schema kind {kind}")
        n = r.count(4, 1, C.MAX_STATES, "schema state count")
        states = tuple(RealizedState.read(r) for _ in range(n))
        ng = r.count(4, 1, C.MAX_ATOMIC_GROUPS, "group count")
        groups = tuple(AtomicGroup.read(r) for _ in range(ng))
        seg_total = r.u64()
        complete_total = r.u64()
        return cls(states, groups, seg_total, complete_total, depth, parent)

    @classmethod
    def decode(cls, data: bytes) -> "Schema":
        r = Reader(data, "schema")
        check_header(r, C.MAGIC_SCHEMA, "schema")
        schema = cls.read_body(r)
        r.end()
        if schema.encode() != bytes(data):
            raise fail("reserved", "schema: re-encoding differs")
        return schema

    def digest(self) -> bytes:
        return hashlib.sha256(C.D_SCHEMA + self.encode()).digest()


# -- state declaration ----------------------------------------------------------------------
@dataclass(frozen=True)
class StateDeclaration:
    key: StateKey
    full_shape: tuple[int, ...]
    segment_shape: tuple[int, ...]
    strides: tuple[int, ...]
    logical_start: int
    logical_count: int
    absolute_position: int
    window: int
    atomic_group: int

    def encode(self) -> bytes:
        return b"".join(
            [
                header(C.MAGIC_STATE),
                self.key.encode(),
                encode_shape(self.full_shape),
                encode_shape(self.segment_shape),
                u8(len(self.strides)),
                *(u64(s) for s in self.strides),
                u64(self.logical_start),
                u64(self.logical_count),
                u64(self.absolute_position),
                u64(self.window),
                u32(self.atomic_group),
            ]
        )

    @classmethod
    def decode(cls, data: bytes) -> "StateDeclaration":
        r = Reader(data, "state declaration")
        check_header(r, C.MAGIC_STATE, "state declaration")
        key = StateKey.read(r)
        full = read_shape(r, allow_zero=False)
        seg = read_shape(r, allow_zero=False)
        ns = r.count(1, 0, C.MAX_RANK, "stride count")
        strides = tuple(r.u64() for _ in range(ns))
        ls, lc, ap, win = (r.u64() for _ in range(4))
        group = r.u32()
        r.end()
        decl = cls(key, full, seg, strides, ls, lc, ap, win, group)
        if decl.encode() != bytes(data):
            raise fail("reserved", "state declaration: re-encoding differs")
        return decl


# -- manifest -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkRef:
    content_id: bytes
    object_key: bytes
    object_digest: bytes
    key_epoch: int
    plaintext_bytes: int
    object_bytes: int

    def encode(self) -> bytes:
        return self.content_id + self.object_key + self.object_digest + u64(self.key_epoch) + u32(self.plaintext_bytes) + u32(self.object_bytes)

    @classmethod
    def read(cls, r: Reader) -> "ChunkRef":
        return cls(r.id32(), r.id32(), r.id32(), r.u64(), r.u32(), r.u32())


@dataclass(frozen=True)
class PayloadState:
    key: StateKey
    chunks: tuple[ChunkRef, ...]

    def encode(self) -> bytes:
        return self.key.encode() + u32(len(self.chunks)) + b"".join(c.encode() for c in self.chunks)

    @classmethod
    def read(cls, r: Reader) -> "PayloadState":
        key = StateKey.read(r)
        n = r.count(4, 1, C.MAX_CHUNKS_PER_STATE, "chunk count")
        return cls(key, tuple(ChunkRef.read(r) for _ in range(n)))


@dataclass(frozen=True)
class Manifest:
    tenant: bytes
    key_epoch: int
    semantic: SemanticModelId
    cut: InputCutId
    family: Family
    schema: Schema
    payload: tuple[PayloadState, ...] = field(default=())

    def encode(self) -> bytes:
        return b"".join(
            [
                header(C.MAGIC_MANIFEST),
                self.tenant,
                u64(self.key_epoch),
                self.semantic.encode(),
                self.cut.encode(),
                self.family.encode_body(),
                self.schema.encode_body(),
                u32(len(self.payload)),
                *(p.encode() for p in self.payload),
            ]
        )

    @classmethod
    def decode(cls, data: bytes | memoryview, *, validate: bool = True, max_restored_bytes: int = C.DEFAULT_MAX_RESTORED_BYTES) -> "Manifest":
        if len(data) > C.MAX_MANIFEST_BYTES:
            raise fail("bounds", f"manifest: {len(data)} bytes exceeds 256 MiB")
        r = Reader(data, "manifest")
        check_header(r, C.MAGIC_MANIFEST, "manifest")
        tenant = r.id32()
        epoch = r.u64()
        semantic = SemanticModelId.read(r)
        cut = InputCutId.read(r)
        family = Family.read_body(r)
        schema = Schema.read_body(r)
        n = r.count(4, 1, C.MAX_STATES, "payload state count")
        payload = tuple(PayloadState.read(r) for _ in range(n))
        r.end()
        manifest = cls(tenant, epoch, semantic, cut, family, schema, payload)
        if manifest.encode() != bytes(data):
            raise fail("reserved", "manifest: re-encoding differs")
        if validate:
            from .validate import validate_manifest

            validate_manifest(manifest, max_restored_bytes=max_restored_bytes)
        return manifest

    def manifest_id(self, encoded: bytes | None = None) -> bytes:
        return hashlib.sha256(C.D_MANIFEST + (encoded if encoded is not None else self.encode())).digest()

    def chunk_refs(self) -> Iterator[tuple[StateKey, Span, ChunkRef]]:
        """Yield (payload state key, span, chunk ref) in manifest order."""
        for rs, ps in zip(self.schema.states, self.payload):
            for span, ref in zip(rs.spans, ps.chunks):
                yield ps.key, span, ref
