"""Mapping an engine's KV cache onto the Handoff V2 wire (INTEROP C.12-C.13), both directions.

Handoff V2 speaks in span classes and packed tiles; an engine adapter speaks in
``(layer, role)`` token-major planes (DESIGN.md, "Mapping the seed's model"). A layout has
up to two classes:

* **windowed** layers (sliding-window RoPE, Muse's SWA) form class ``swa``, role
  ``swa_tile``: rows ``[max(cut, position - window), position)``, packed ``G`` layers per
  segment (``G`` = the number of full-attention layers, Muse's 13), each segment labelled
  with its group's first layer; they come first on the wire (upstream's layer-major order);
* **full-attention** layers form class ``nope``, role ``nope_tile``, all in one group
  (``layer: null``): rows ``[cut, position)``.

A tile packs, for each layer of its group in order, the K plane then the V plane of
``count`` rows, token-major (errata L6), so ``elements_per_token = layers * 2 * kv_heads *
head_dim``; the element type is the cache dtype (``f16`` -> ``f16_le``, ``f32`` ->
``f32_le``; others have no wire type and are refused).

Tile rows: a layout with windowed layers follows PART C exactly -- 512-row tiles
(``NOPE_TILE``) -- so for the seed's Muse geometry (muse-tiny) :func:`span_layout` *is* the
upstream ``MUSE`` preset and the schedule is byte-exact with ``muse_schedule_span``. A
layout of full-attention layers only (SmolLM2, Llama) is kvpack's own one-class mapping
(class ``full``): 256-row tiles, so that each absolute 256-token prefill chunk completes one
tile and the producer ships it before the next chunk is computed.

Installing: every plane of a detached install needs ``install.required_range(layer)``
(``[0, position)`` for full layers, the window ending at ``position`` for windowed ones).
The wire carries the rows at or after the cut; a delta takes the rest from the prefix the
receiver holds (:func:`copy_prefix`): ``[0, cut)`` of full layers and, when the window
reaches back before the cut, ``[position - window, cut)`` of windowed layers.

The identity a receiver admits (C.4 ``identity`` and ``target_cache_identity_sha256``) is
derived from the engine's exact identity (docs/engine.md) by :func:`wire_identity`, so both
nodes compute it from the model they actually loaded and a mismatch anywhere is refused at
admission. This module never touches sockets: bytes in, bytes out.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..durable import atomic_write
from ..engine.contract import LAYER_FULL, CacheLayout
from ..errors import EngineError
from ..handoff.manifest import ExactIdentityV1
from ..handoff.target import PayloadTarget
from ..handoff.schedule import MUSE, SpanClass, SpanLayout, SpanSegment, schedule_span
from ..vocab import TOKEN_ALIGN, sha256_hex

TILE_TOKENS = TOKEN_ALIGN  # one-class (full-attention only) layouts: one tile per prefill chunk
WINDOWED_TILE_TOKENS = 512  # layouts with windowed layers: PART C's NOPE_TILE
_WIRE_TYPES = {"f32": "f32_le", "f16": "f16_le"}


def span_layout(layout: CacheLayout) -> SpanLayout:
    """The span layout of an engine's cache layout (see the module docstring)."""
    specs = layout.layers
    widths = {s.kv_heads * s.head_dim for s in specs}
    dtypes = {s.dtype for s in specs}
    if len(widths) != 1 or len(dtypes) != 1:
        raise EngineError("unsupported", "layers of different widths or dtypes cannot share one tile")
    dtype = dtypes.pop()
    if dtype not in _WIRE_TYPES:
        raise EngineError("unsupported", f"cache dtype {dtype} has no Handoff V2 element type")
    full = tuple(s.index for s in specs if s.kind == LAYER_FULL)
    windowed = tuple(s.index for s in specs if s.kind != LAYER_FULL)
    width, element_type = widths.pop(), _WIRE_TYPES[dtype]
    if not windowed:
        return SpanLayout(
            name=f"full-{len(specs)}",
            classes=(SpanClass("full", "nope_tile", full, None, len(full), False),),
            tile_tokens=TILE_TOKENS,
            element_type=element_type,
            plane_elements=width,
        )
    windows = {s.window_tokens for s in specs if s.kind != LAYER_FULL}
    if len(windows) != 1:
        raise EngineError("unsupported", f"windowed layers with different windows {sorted(windows)} cannot share one span class")
    classes: tuple[SpanClass, ...] = (SpanClass("swa", "swa_tile", windowed, windows.pop(), len(full) or len(windowed), True),)
    if full:
        classes += (SpanClass("nope", "nope_tile", full, None, len(full), False),)
    out = SpanLayout(name="two-class", classes=classes, tile_tokens=WINDOWED_TILE_TOKENS, element_type=element_type, plane_elements=width)
    return MUSE if _same_wire(out, MUSE) else out


def _same_wire(a: SpanLayout, b: SpanLayout) -> bool:
    return (a.classes, a.tile_tokens, a.cut_align, a.element_type, a.plane_elements, a.planes_per_layer, a.component_id) == (
        b.classes,
        b.tile_tokens,
        b.cut_align,
        b.element_type,
        b.plane_elements,
        b.planes_per_layer,
        b.component_id,
    )


@dataclass(frozen=True)
class TileGeometry:
    """Which planes a segment packs and where: the wire layout plus plane widths."""

    span: SpanLayout
    roles: tuple[str, ...]
    row_bytes: int
    layers: tuple[int, ...]  # every layer, in order
    groups: tuple[tuple[tuple[str, Any], tuple[int, ...]], ...]  # ((role, label), layers)

    @classmethod
    def of(cls, layout: CacheLayout) -> "TileGeometry":
        span = span_layout(layout)  # refuses what the mapping does not cover
        groups = []
        for c in span.classes:
            for g in c.groups():
                groups.append(((c.role, g[0] if c.label_group_head else None), g))
        return cls(span, tuple(layout.roles), layout.layers[0].row_bytes, tuple(s.index for s in layout.layers), tuple(groups))

    def group(self, segment: SpanSegment) -> tuple[int, ...]:
        """The layers a segment packs (EngineError ``layout`` for a role or label this
        layout does not have: the witness refuses those earlier, this is the backstop)."""
        for key, layers in self.groups:
            if key == (segment.role, segment.layer):
                return layers
        raise EngineError("layout", f"no {segment.role} group labelled {segment.layer!r} in this cache layout")

    def planes(self, layers: tuple[int, ...] | None = None) -> list[tuple[int, str]]:
        return [(layer, role) for layer in (self.layers if layers is None else layers) for role in self.roles]

    def tile_bytes(self, count: int, layers: tuple[int, ...] | None = None) -> int:
        """Bytes of ``count`` rows of every plane of ``layers`` (default: all layers)."""
        return count * self.row_bytes * len(self.planes(layers))

    def schedule(self, position: int, cut: int = 0) -> tuple[SpanSegment, ...]:
        return schedule_span(self.span, position, cut)

    def payload_bytes(self, position: int, cut: int = 0) -> int:
        """Bytes on the wire for ``[cut, position)``: the span-schedule arithmetic."""
        return sum(seg.byte_len for seg in self.schedule(position, cut))


def pack_tile(session, geometry: TileGeometry, segment: SpanSegment) -> memoryview:
    """One segment's payload: per layer of its group, K then V rows (one copy each).

    The copies are NumPy copies into an uninitialised buffer: they release the GIL (a
    ``memoryview`` slice assignment holds it for the whole 64 MiB), so the stripe's writer
    thread (TLS) and the hash lanes keep running while a tile is packed, and no zero-fill
    pass touches the buffer first."""
    layers = geometry.group(segment)
    start, count = segment.logical_start, segment.logical_count
    plane = count * geometry.row_bytes
    out = np.empty(geometry.tile_bytes(count, layers), np.uint8)
    for i, (layer, role) in enumerate(geometry.planes(layers)):
        np.copyto(out[i * plane : (i + 1) * plane], np.frombuffer(session.export_rows(layer, role, start, start + count), np.uint8))
    return out.data


def tile_pieces(source, geometry: TileGeometry, segment: SpanSegment) -> PayloadTarget | None:
    """One segment's payload as the plane rows themselves, by reference (K then V per
    layer, the wire order): the sender hashes and writes them piece by piece, no packed
    copy. Only from a source whose rows never change under the views -- a session whose
    stored rows are never rewritten (``export_rows_stable``: the arrays engine, even while
    it keeps prefilling) or a resident entry (``rows_immutable``); None: pack a copy."""
    if not (getattr(source, "export_rows_stable", False) or getattr(source, "rows_immutable", False)):
        return None
    layers = geometry.group(segment)
    start, stop = segment.logical_start, segment.logical_start + segment.logical_count
    return PayloadTarget([source.export_rows(layer, role, start, stop) for layer, role in geometry.planes(layers)])


def scatter_tile(install, geometry: TileGeometry, segment: SpanSegment, payload: memoryview) -> None:
    """Write one verified segment into a detached install, plane by plane (no extra copy).
    The install refuses rows outside a layer's needed range (its window)."""
    layers = geometry.group(segment)
    plane = segment.logical_count * geometry.row_bytes
    if payload.nbytes != plane * len(geometry.planes(layers)):
        raise EngineError("layout", f"tile of {payload.nbytes} bytes does not match {segment.logical_count} rows of {len(layers)} layers")
    for i, (layer, role) in enumerate(geometry.planes(layers)):
        install.write_rows(layer, role, segment.logical_start, payload[i * plane : (i + 1) * plane])


def tile_target(install, geometry: TileGeometry, segment: SpanSegment) -> list[memoryview] | None:
    """The destination pieces of one segment in a detached install -- per layer of its group,
    the K then V rows, exactly the payload's order -- claimed for a verifier to read the
    payload straight into (see :mod:`kvpack.handoff.target`); None when the install cannot
    hand out rows (the payload is then staged and scattered by :func:`scatter_tile`)."""
    claim = getattr(install, "claim_rows", None)
    if claim is None:
        return None
    layers = geometry.group(segment)
    planes = geometry.planes(layers)
    if segment.byte_len != segment.logical_count * geometry.row_bytes * len(planes):
        raise EngineError("layout", f"tile of {segment.byte_len} bytes does not match {segment.logical_count} rows of {len(layers)} layers")
    return [claim(layer, role, segment.logical_start, segment.logical_count) for layer, role in planes]


def tile_landed(install, geometry: TileGeometry, segment: SpanSegment) -> None:
    """The segment read into :func:`tile_target`'s pieces verified: count its rows as written."""
    for layer, role in geometry.planes(geometry.group(segment)):
        install.rows_landed(layer, role, segment.logical_start, segment.logical_count)


def copy_prefix(source, install, geometry: TileGeometry, cut: int) -> int:
    """The rows before ``cut`` that ``install`` needs, from a held source; returns bytes.

    Full layers: ``[0, cut)``. Windowed layers: ``[lo, cut)`` where ``lo`` is the start of
    the install's window (nothing when the window starts at or after the cut: the wire
    carries all of it). The source must still hold those rows (it refuses evicted rows).

    A source whose rows never change (``rows_immutable``: a resident entry) lends them to an
    install that can take a whole plane by reference (``share_rows``: the arrays engine)
    instead of being copied -- a producer's resident prefix then costs no whole-cache copy.
    """
    share = getattr(install, "share_rows", None) if getattr(source, "rows_immutable", False) else None
    n = 0
    for layer, role in geometry.planes():
        lo = install.required_range(layer)[0]
        if lo >= cut:
            continue
        rows = source.export_rows(layer, role, lo, cut)
        if share is None or not share(layer, role, lo, rows):
            install.write_rows(layer, role, lo, rows)
        n += rows.nbytes
    return n


def wire_identity(engine) -> tuple[ExactIdentityV1, str]:
    """(ExactIdentityV1, target_cache_identity_sha256) of an engine, from its exact identity.

    ``model_sha256`` is the engine's weights digest (for muse-tiny the SHA-256 of the
    weights file it loaded, the seed's rule; for SmolLM2 the digest of its verified
    tensors); the other C.4 digests carry the engine's Id32 components (adapters,
    tokenizer+template, position semantics); the target cache identity is the digest over
    all eight Id32 (config, cache ABI, topology and shard map included), so a producer
    running another build, thread count, layout or dtype is refused at admission.
    """
    ident = engine.identity
    ids = ident.ids()
    exact = ExactIdentityV1(
        adapter_sha256=ids.adapters.hex(),
        chat_template_sha256=ident.chat_template_digest,
        context_policy_sha256=ids.position_semantics.hex(),
        model_revision=ident.model_name,
        model_sha256=ident.weights_digest,
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
