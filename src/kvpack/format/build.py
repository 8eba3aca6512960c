"""Builders for valid production-v1 schemas and manifests from a family and a cut.

The store, the handoff and the tests all need the same arithmetic (row-major strides,
physical offsets, footprints, token-aligned spans of at most 4 MiB); it lives here once so
that what is written always satisfies :func:`kvpack.format.validate.validate_manifest`.

It must never produce a schema that :func:`validate_manifest` would refuse.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import constants as C
from .identity import InputCutId
from .objects import AtomicGroup, DeltaParent, Family, FamilyState, RealizedState, Schema, Span


def row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for dim in reversed(shape):
        strides.append(acc)
        acc *= dim
    return tuple(reversed(strides))


def footprint(shape: Sequence[int], strides: Sequence[int], width: int) -> int:
    return (sum((d - 1) * s for d, s in zip(shape, strides)) + 1) * width


def tokens_per_chunk(state: FamilyState, max_chunk_bytes: int = C.MAX_CHUNK_PLAINTEXT) -> int:
    bpt = state.bytes_per_token
    if not 1 <= bpt <= C.MAX_CHUNK_PLAINTEXT:
        raise ValueError(f"state {state.key}: {bpt} bytes per token cannot be chunked")
    return max(1, min(max_chunk_bytes, C.MAX_CHUNK_PLAINTEXT) // bpt)


def plan_spans(state: FamilyState, start: int, stop: int, max_chunk_bytes: int = C.MAX_CHUNK_PLAINTEXT) -> tuple[Span, ...]:
    """Token-aligned spans covering rows [start, stop), each at most ``max_chunk_bytes``.

    Span boundaries are aligned to absolute multiples of the chunk size, so the same rows
    always land in the same span whatever ``start`` is: that is what makes chunks of a full
    compaction and of the deltas before it deduplicate by content id.
    """
    per = tokens_per_chunk(state, max_chunk_bytes)
    bpt = state.bytes_per_token
    spans = []
    t = start
    while t < stop:
        end = min(stop, (t // per + 1) * per)
        spans.append(Span(t, end - t, t * bpt, (end - t) * bpt))
        t = end
    return tuple(spans)


def realized_state(state: FamilyState, cut: int, start: int, spans: Sequence[Span] | None = None) -> RealizedState:
    full = tuple(cut if i == state.token_axis else d for i, d in enumerate(state.dims))
    seg = tuple(cut - start if i == state.token_axis else d for i, d in enumerate(state.dims))
    strides = row_major(full)
    width = state.width
    return RealizedState(
        key=state.key,
        full_shape=full,
        segment_shape=seg,
        strides=strides,
        logical_start=start,
        logical_count=cut - start,
        physical_offset_bytes=start * strides[state.token_axis] * width,
        physical_span_bytes=footprint(seg, strides, width),
        complete_physical_bytes=footprint(full, strides, width),
        absolute_position=cut,
        spans=tuple(spans) if spans is not None else plan_spans(state, start, cut),
    )


def build_schema(
    family: Family,
    cut: int,
    *,
    parent: tuple[bytes, InputCutId] | None = None,
    depth: int = 0,
    groups: Sequence[AtomicGroup] | None = None,
    max_chunk_bytes: int = C.MAX_CHUNK_PLAINTEXT,
) -> Schema:
    """A full schema covering [0, cut), or a delta over [parent cut, cut)."""
    start = parent[1].token_count if parent is not None else 0
    states = tuple(realized_state(s, cut, start, plan_spans(s, start, cut, max_chunk_bytes)) for s in family.states)
    seg_total = sum(_product(rs.segment_shape) * s.width for rs, s in zip(states, family.states))
    complete_total = sum(_product(rs.full_shape) * s.width for rs, s in zip(states, family.states))
    return Schema(
        states=states,
        groups=tuple(groups) if groups is not None else (AtomicGroup(1, tuple(s.key for s in family.states)),),
        segment_restored_bytes=seg_total,
        complete_restored_bytes=complete_total,
        depth=depth if parent is not None else 0,
        parent=DeltaParent(parent[0], parent[1]) if parent is not None else None,
    )


def _product(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
