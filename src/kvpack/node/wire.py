"""Mapping an engine's KV cache onto the Handoff V2 wire (INTEROP C.12-C.13), both directions.

Handoff V2 speaks in span classes and packed tiles; an engine adapter speaks in
``(layer, role)`` token-major planes. A model whose layers are all full attention (SmolLM2,
Llama) is the *one-class* case of the schedule (DESIGN.md, "Mapping the seed's model"):

* one span class ``full`` with role ``nope_tile`` holding every layer in one group (the
  segment's ``layer`` is null, exactly like Muse's NoPE tiles): rows ``[cut, position)``;
* a tile packs, for each layer in order, the K plane then the V plane of ``count`` rows
  (errata L6), so ``elements_per_token = layers * 2 * kv_heads * head_dim``;
* the element type is the cache dtype (``f32`` -> ``f32_le``, ``f16`` -> ``f16_le``; other
  dtypes have no wire type and are refused);
* tiles are ``TILE_TOKENS = 256`` rows: the schedule anchors tiles at the cut (a multiple of
  256) and the engine prefills in absolute 256-token chunks, so each prefill chunk completes
  exactly one tile and the producer can ship it before the next chunk is computed.

Windowed (sliding) layers would need a second span class and a window re-derivation on
delta installs; this mapping refuses them (``unsupported``) rather than guess.

The identity a receiver admits (C.4 ``identity`` and ``target_cache_identity_sha256``) is
derived from the engine's exact identity (docs/engine.md) by :func:`wire_identity`, so both
nodes compute it from the model they actually loaded and a mismatch anywhere is refused at
admission.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..durable import atomic_write
from ..engine.contract import LAYER_FULL, CacheLayout
from ..errors import EngineError
from ..handoff.manifest import ExactIdentityV1
from ..handoff.schedule import SpanClass, SpanLayout, SpanSegment
from ..vocab import TOKEN_ALIGN, sha256_hex

TILE_TOKENS = TOKEN_ALIGN
_WIRE_TYPES = {"f32": "f32_le", "f16": "f16_le"}


def span_layout(layout: CacheLayout) -> SpanLayout:
    """The one-class span layout of an all-full-attention cache layout."""
    specs = layout.layers
    if any(s.kind != LAYER_FULL for s in specs):
        raise EngineError("unsupported", "the node wire mapping covers full-attention layers only")
    widths = {s.kv_heads * s.head_dim for s in specs}
    dtypes = {s.dtype for s in specs}
    if len(widths) != 1 or len(dtypes) != 1:
        raise EngineError("unsupported", "layers of different widths or dtypes cannot share one tile")
    dtype = dtypes.pop()
    if dtype not in _WIRE_TYPES:
        raise EngineError("unsupported", f"cache dtype {dtype} has no Handoff V2 element type")
    return SpanLayout(
        name=f"full-{len(specs)}",
        classes=(SpanClass("full", "nope_tile", tuple(s.index for s in specs), None, len(specs), False),),
        tile_tokens=TILE_TOKENS,
        element_type=_WIRE_TYPES[dtype],
        plane_elements=widths.pop(),
    )


@dataclass(frozen=True)
class TileGeometry:
    """Byte offsets of the planes inside one packed tile of ``count`` rows."""

    layers: tuple[int, ...]
    roles: tuple[str, ...]
    row_bytes: int

    @classmethod
    def of(cls, layout: CacheLayout) -> "TileGeometry":
        span_layout(layout)  # refuses what the mapping does not cover
        return cls(tuple(s.index for s in layout.layers), tuple(layout.roles), layout.layers[0].row_bytes)

    def planes(self):
        return [(layer, role) for layer in self.layers for role in self.roles]

    def tile_bytes(self, count: int) -> int:
        return count * self.row_bytes * len(self.layers) * len(self.roles)


def pack_tile(session, geometry: TileGeometry, start: int, count: int) -> bytearray:
    """One tile's payload: per layer K then V rows ``[start, start+count)`` (one copy)."""
    plane = count * geometry.row_bytes
    out = bytearray(geometry.tile_bytes(count))
    view = memoryview(out)
    for i, (layer, role) in enumerate(geometry.planes()):
        view[i * plane : (i + 1) * plane] = session.export_rows(layer, role, start, start + count)
    return out


def scatter_tile(install, geometry: TileGeometry, segment: SpanSegment, payload: memoryview) -> None:
    """Write one verified tile into a detached install, plane by plane (no extra copy)."""
    plane = segment.logical_count * geometry.row_bytes
    if payload.nbytes != plane * len(geometry.layers) * len(geometry.roles):
        raise EngineError("layout", f"tile of {payload.nbytes} bytes does not match {segment.logical_count} rows")
    for i, (layer, role) in enumerate(geometry.planes()):
        install.write_rows(layer, role, segment.logical_start, payload[i * plane : (i + 1) * plane])


def copy_prefix(source, install, geometry: TileGeometry, cut: int) -> int:
    """Rows ``[0, cut)`` of every plane from a held source into an install; returns bytes."""
    n = 0
    for layer, role in geometry.planes():
        rows = source.export_rows(layer, role, 0, cut)
        install.write_rows(layer, role, 0, rows)
        n += rows.nbytes
    return n


def wire_identity(engine) -> tuple[ExactIdentityV1, str]:
    """(ExactIdentityV1, target_cache_identity_sha256) of an engine, from its exact identity.

    The five C.4 digests carry the engine's Id32 components (weights+config, adapters,
    tokenizer+template, position semantics); the target cache identity is the digest over
    all eight Id32 (cache ABI, topology and shard map included), so a producer running
    another build, thread count or dtype is refused at admission.
    """
    ident = engine.identity
    ids = ident.ids()
    exact = ExactIdentityV1(
        adapter_sha256=ids.adapters.hex(),
        chat_template_sha256=ident.chat_template_digest,
        context_policy_sha256=ids.position_semantics.hex(),
        model_revision=ident.model_name,
        model_sha256=ids.weights_config.hex(),
        tokenizer_revision=ident.tokenizer_digest[:16],
        tokenizer_sha256=ids.tokenizer_template.hex(),
    )
    return exact, ids.digest().hex()


def identity_file_json(engine) -> dict:
    """The ``--identity FILE`` object ``kvpack enroll`` takes for a receiver of this engine."""
    exact, target = wire_identity(engine)
    return {"identity": exact.to_json(), "target_cache_identity_sha256": target}


def write_identity_file(engine, path: str) -> None:
    """Publish the identity file durably (temp file, fsync, rename): it is not secret (0644)."""
    body = json.dumps(identity_file_json(engine), indent=2, sort_keys=True).encode() + b"\n"
    atomic_write(os.path.abspath(path), body, mode=0o644)


def held_digest(tokens) -> str:
    """A short digest of token ids for receipts (never the ids themselves)."""
    return sha256_hex(",".join(str(int(t)) for t in tokens))
