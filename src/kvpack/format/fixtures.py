"""The production-v1 reference fixtures, built from their published *inputs* (INTEROP.md A.9,
errata S1-1..S1-3, S3-3..S3-6).

Nothing here knows an expected digest: the conformance test and ``kvpack fixture`` build the
objects with the real codecs and compare them with ``conformance/production_v1.sha256``.

It must never hard-code an expected digest or byte string: only the published inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from . import constants as C
from .chunk import EncodedChunk, encode_chunk
from .codec import encode_frame
from .identity import InputCutId, PrefixChain, SemanticModelId, auxiliary_root, namespace_id, prefix_context
from .keys import KeySchedule
from .objects import (
    AtomicGroup,
    ChunkRef,
    DeltaParent,
    Family,
    FamilyState,
    Manifest,
    PayloadState,
    RealizedState,
    Schema,
    Span,
    StateDeclaration,
    StateKey,
)
from ..vocab import sha256_hex
from .pack import encode_pack


def I(v: int) -> bytes:  # noqa: E743 - the spec's own name for "32 copies of byte v"
    return bytes([v]) * 32


ROOT = I(99)
TENANT = I(1)
EPOCH = 7
SEMANTIC = SemanticModelId(I(10), I(11), I(12), I(13), I(14))
STATE_KEY = StateKey(0, "attention.k")
AUX_INPUTS = [(I(20), I(21))]
TOKENS = (1, 2, 3, 4)
PLAINTEXT = bytes(range(16))
CODEC_NAMES = {"raw": C.CODEC_RAW, "lossless": C.CODEC_LOSSLESS}
MODES = ("plain", "encrypted")


def fixture_keys() -> KeySchedule:
    return KeySchedule.derive(ROOT, TENANT, EPOCH)


def fixture_family(codec: int) -> Family:
    state = FamilyState(
        key=STATE_KEY,
        dtype=1,
        codec=codec,
        dims=(0, 4),
        token_axis=0,
        elements_per_token=4,
    )
    return Family(engine_cache_abi=I(2), topology=I(3), shard_map=I(4), states=(state,), mode=C.MODE_NATIVE, page_size_tokens=256)


def fixture_state_declaration() -> StateDeclaration:
    return StateDeclaration(StateKey(7, "attention.k"), (320, 4, 8), (64, 4, 8), (32, 8, 1), 256, 64, 320, 0, 9)


def _realized(cut: int, start: int) -> RealizedState:
    count = cut - start
    return RealizedState(
        key=STATE_KEY,
        full_shape=(cut, 4),
        segment_shape=(count, 4),
        strides=(4, 1),
        logical_start=start,
        logical_count=count,
        physical_offset_bytes=4 * start,
        physical_span_bytes=4 * count,
        complete_physical_bytes=4 * cut,
        absolute_position=cut,
        spans=(Span(start, count, 4 * start, 4 * count),),
    )


def _schema(cut: int, start: int, depth: int = 0, parent: DeltaParent | None = None) -> Schema:
    return Schema(
        states=(_realized(cut, start),),
        groups=(AtomicGroup(1, (STATE_KEY,)),),
        segment_restored_bytes=4 * (cut - start),
        complete_restored_bytes=4 * cut,
        depth=depth,
        parent=parent,
    )


def _cut_id(keys: KeySchedule, family: Family, tokens: Sequence[int]) -> tuple[InputCutId, PrefixChain]:
    aux = auxiliary_root(keys.prefix, TENANT, AUX_INPUTS)
    chain = PrefixChain(keys.prefix, prefix_context(keys.prefix, TENANT, SEMANTIC.digest(), family.digest(), aux))
    chain.extend(tokens)
    return InputCutId(chain.token_root, aux, len(tokens)), chain


def _salt(base: int, s: int, n: int) -> bytes:
    return bytes((base + s + i) & 0xFF for i in range(n))


def reference_fixture(codec_name: str, chunk_mode: str, pack_mode: str) -> list[tuple[str, bytes]]:
    """The 25 named objects of one ``fixture/<codec>/<chunk>/<pack>`` suite, in vector order."""
    codec = CODEC_NAMES[codec_name]
    keys = fixture_keys()
    family = fixture_family(codec)
    fam_digest = family.digest()
    schema = _schema(4, 0)
    cut, _chain = _cut_id(keys, family, TOKENS)
    enc_chunk = chunk_mode == "encrypted"
    chunk = encode_chunk(
        keys=keys,
        family_digest=fam_digest,
        key=STATE_KEY,
        span=schema.states[0].spans[0],
        plaintext=PLAINTEXT,
        codec=codec,
        encrypted=enc_chunk,
        salt=bytes(range(0xA0, 0xB0)) if enc_chunk else bytes(16),
        nonce=bytes(range(0xB0, 0xBC)) if enc_chunk else bytes(12),
    )
    manifest = Manifest(TENANT, EPOCH, SEMANTIC, cut, family, schema, (PayloadState(STATE_KEY, (chunk.ref,)),))
    manifest_bytes = manifest.encode()
    enc_pack = pack_mode == "encrypted"
    pack = encode_pack(
        manifest,
        keys,
        encrypted=enc_pack,
        salt=bytes(range(0xC0, 0xD0)) if enc_pack else bytes(16),
        nonce=bytes(range(0xD0, 0xDC)) if enc_pack else bytes(12),
    )
    objects = [
        ("state_declaration", fixture_state_declaration().encode()),
        ("family", family.encode()),
        ("schema", schema.encode()),
        ("manifest", manifest_bytes),
        ("raw_frame", encode_frame(C.CODEC_RAW, PLAINTEXT)),
        ("lossless_frame", encode_frame(C.CODEC_LOSSLESS, PLAINTEXT)),
        ("chunk", chunk.obj),
        ("pack", pack),
        ("semantic_id", SEMANTIC.digest()),
        ("family_id", fam_digest),
        ("schema_id", schema.digest()),
        ("manifest_id", manifest.manifest_id(manifest_bytes)),
        ("namespace_id", namespace_id(keys.namespace, b"tenant-alpha")),
        ("token_root", cut.token_root),
        ("auxiliary_root", cut.aux_root),
        ("chunk_id", chunk.content_id),
        ("object_key", chunk.object_key),
        ("object_digest", chunk.ref.object_digest),
    ]
    objects += [(f"key/{name}", value) for name, value in keys.named().items()]
    return objects


@dataclass(frozen=True)
class DeltaStage:
    """One stage of a suite's delta chain: stage ``s`` has cut ``s + 1``, depth ``s`` and, from
    stage 1 on, the previous stage as its parent."""

    stage: int
    tokens: tuple[int, ...]
    cut: InputCutId
    chain: PrefixChain
    parent: DeltaParent | None
    manifest_bytes: bytes
    manifest_id: bytes
    chunk: EncodedChunk
    pack: bytes
    plaintext: bytes


def delta_chain_stages(codec_name: str, chunk_mode: str, pack_mode: str) -> list[DeltaStage]:
    """The 8 stages of one suite's delta chain, with their ids and prefix chains."""
    codec = CODEC_NAMES[codec_name]
    keys = fixture_keys()
    family = fixture_family(codec)
    fam_digest = family.digest()
    enc_chunk = chunk_mode == "encrypted"
    enc_pack = pack_mode == "encrypted"
    stages: list[DeltaStage] = []
    parent: DeltaParent | None = None
    for s in range(8):
        c = s + 1
        tokens = tuple(range(1, c + 1))
        cut, chain = _cut_id(keys, family, tokens)
        plaintext = bytes(range(4 * s, 4 * s + 4))
        schema = _schema(c, s, depth=s, parent=parent)
        chunk = encode_chunk(
            keys=keys,
            family_digest=fam_digest,
            key=STATE_KEY,
            span=schema.states[0].spans[0],
            plaintext=plaintext,
            codec=codec,
            encrypted=enc_chunk,
            salt=_salt(0x20, s, 16) if enc_chunk else bytes(16),
            nonce=_salt(0x40, s, 12) if enc_chunk else bytes(12),
        )
        manifest = Manifest(TENANT, EPOCH, SEMANTIC, cut, family, schema, (PayloadState(STATE_KEY, (chunk.ref,)),))
        mbytes = manifest.encode()
        mid = manifest.manifest_id(mbytes)
        pack = encode_pack(
            manifest,
            keys,
            encrypted=enc_pack,
            salt=_salt(0x60, s, 16) if enc_pack else bytes(16),
            nonce=_salt(0x80, s, 12) if enc_pack else bytes(12),
        )
        stages.append(DeltaStage(s, tokens, cut, chain, parent, mbytes, mid, chunk, pack, plaintext))
        parent = DeltaParent(mid, cut)
    return stages


def reference_delta_chain(codec_name: str, chunk_mode: str, pack_mode: str) -> list[tuple[str, bytes]]:
    """The 8-stage delta chain of one suite as named objects, in vector order."""
    return [obj for st in delta_chain_stages(codec_name, chunk_mode, pack_mode) for obj in stage_objects(st)]


def suites() -> Iterator[tuple[str, str, str]]:
    for codec in CODEC_NAMES:
        for chunk_mode in MODES:
            for pack_mode in MODES:
                yield codec, chunk_mode, pack_mode


def vector_objects() -> Iterator[tuple[str, str, bytes]]:
    """(suite, name, bytes) for every vector line, in the vector file's order (errata S3-3)."""
    for codec, chunk_mode, pack_mode in suites():
        combo = f"{codec}/{chunk_mode}/{pack_mode}"
        for name, data in reference_fixture(codec, chunk_mode, pack_mode):
            yield f"fixture/{combo}", name, data
        for name, data in reference_delta_chain(codec, chunk_mode, pack_mode):
            yield f"delta-chain/{combo}", name, data


def fixture_cut(codec_name: str) -> tuple[InputCutId, PrefixChain]:
    """The fixture's input cut and the keyed prefix chain over its tokens."""
    return _cut_id(fixture_keys(), fixture_family(CODEC_NAMES[codec_name]), TOKENS)


def _prefix_json(chain: PrefixChain) -> dict[str, Any]:
    return {
        "context": chain.context.hex(),
        "root": chain.root.hex(),
        "token_root": chain.token_root.hex(),
        "nodes": [{"index": i, "token_count": n.cumulative_count, "node_id": n.node_id.hex(), "reusable": n.reusable} for i, n in enumerate(chain.nodes)],
    }


def _object_record(suite: str, name: str, data: bytes) -> dict[str, Any]:
    return {"record": "object", "suite": suite, "name": name, "bytes": len(data), "sha256": sha256_hex(data), "hex": data.hex()}


def fixture_records(codec_name: str, chunk_mode: str, pack_mode: str) -> Iterator[dict[str, Any]]:
    """One suite's fixture as JSON-ready records: its prefix chain, then every object."""
    suite = f"fixture/{codec_name}/{chunk_mode}/{pack_mode}"
    cut, chain = fixture_cut(codec_name)
    yield {"record": "prefix", "suite": suite, "tokens": list(TOKENS), "aux_root": cut.aux_root.hex(), **_prefix_json(chain)}
    for name, data in reference_fixture(codec_name, chunk_mode, pack_mode):
        yield _object_record(suite, name, data)


def delta_chain_records(codec_name: str, chunk_mode: str, pack_mode: str) -> Iterator[dict[str, Any]]:
    """One suite's delta chain as JSON-ready records: per stage, its ids (cut, parent,
    manifest, chunk, prefix nodes), then its objects."""
    suite = f"delta-chain/{codec_name}/{chunk_mode}/{pack_mode}"
    for st in delta_chain_stages(codec_name, chunk_mode, pack_mode):
        yield {
            "record": "stage",
            "suite": suite,
            "stage": st.stage,
            "depth": st.stage,
            "tokens": list(st.tokens),
            "token_count": st.cut.token_count,
            "aux_root": st.cut.aux_root.hex(),
            "manifest_id": st.manifest_id.hex(),
            "parent_manifest_id": st.parent.manifest_id.hex() if st.parent else None,
            "parent_token_count": st.parent.cut.token_count if st.parent else None,
            "content_id": st.chunk.content_id.hex(),
            "object_key": st.chunk.object_key.hex(),
            "object_digest": st.chunk.ref.object_digest.hex(),
            "pack_sha256": sha256_hex(st.pack),
            "prefix": _prefix_json(st.chain),
        }
        for name, data in stage_objects(st):
            yield _object_record(suite, name, data)


def stage_objects(st: DeltaStage) -> list[tuple[str, bytes]]:
    """A stage's named objects, in vector order."""
    s = st.stage
    return [
        (f"stage-{s}/manifest", st.manifest_bytes),
        (f"stage-{s}/chunk", st.chunk.obj),
        (f"stage-{s}/pack", st.pack),
        (f"stage-{s}/manifest-id", st.manifest_id),
        (f"stage-{s}/plaintext", st.plaintext),
    ]


# keep the ChunkRef import meaningful for readers of this module's API
__all__ = [
    "reference_fixture",
    "reference_delta_chain",
    "delta_chain_stages",
    "DeltaStage",
    "stage_objects",
    "fixture_cut",
    "fixture_records",
    "delta_chain_records",
    "vector_objects",
    "suites",
    "fixture_keys",
    "fixture_family",
    "ChunkRef",
]
