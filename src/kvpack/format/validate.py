"""Semantic validation of families and manifests (INTEROP.md A.3, INTEROP-A-ERRATA §4.6-4.7).

The checks run in the normative order; the first failure wins, with its category. A manifest
that passes describes exactly one contiguous, fully covered byte stream per state.

It must never reorder checks for convenience: the category of the first failure is part of the
format (INTEROP-A-ERRATA-2).
"""

from __future__ import annotations

from . import constants as C
from .objects import Family, FamilyState, Manifest, PayloadState, RealizedState, StateKey
from .wire import U64_MAX, checked_add, checked_mul, fail


def validate_family(family: Family) -> None:
    if C.ZERO32 in (family.engine_cache_abi, family.topology, family.shard_map):
        raise fail("semantics", "family: zero abi/topology/shard id")
    if family.page_size_tokens == 0:
        raise fail("semantics", "family: page size 0")
    if not 1 <= len(family.states) <= C.MAX_STATES:
        raise fail("bounds", f"family: {len(family.states)} states")
    keys = {s.key for s in family.states}
    previous = None
    for state in family.states:
        key = state.key
        nb = key.name_bytes
        if not 1 <= len(nb) <= C.MAX_STATE_NAME_BYTES or b"\0" in nb:
            raise fail("semantics", f"family: bad state name {key.name!r}")
        if previous is not None and not key.sort_key() > previous:
            raise fail("semantics", f"family: state {key} out of canonical order")
        previous = key.sort_key()
        if state.codec_version != C.CODEC_VERSION:
            raise fail("codec", f"family: state {key} codec_version {state.codec_version}")
        rank = len(state.dims)
        if state.token_axis >= rank:
            raise fail("semantics", f"family: state {key} token axis {state.token_axis} >= rank {rank}")
        zero_axes = {i for i, d in enumerate(state.dims) if d == 0}
        if zero_axes != {state.token_axis}:
            raise fail("semantics", f"family: state {key} zero dims {sorted(zero_axes)} != token axis")
        fixed = checked_mul(*(d for d in state.dims if d != 0))
        if state.elements_per_token == 0 or fixed != state.elements_per_token:
            raise fail("semantics", f"family: state {key} elements_per_token {state.elements_per_token} != {fixed}")
        if state.layout == C.LAYOUT_CONTIGUOUS and state.token_axis_rule == C.AXIS_GATHER:
            raise fail("semantics", f"family: state {key} contiguous layout with gather")
        if family.mode == C.MODE_PORTABLE and not (state.layout == C.LAYOUT_CONTIGUOUS and state.token_axis_rule == C.AXIS_DIRECT):
            raise fail("semantics", f"family: state {key} portable mode needs contiguous+direct")
        prev_dep = None
        for dep in state.dependencies:
            if dep == key:
                raise fail("graph", f"family: state {key} depends on itself")
            if dep not in keys:
                raise fail("graph", f"family: state {key} depends on unknown {dep}")
            if prev_dep is not None and not dep.sort_key() > prev_dep:
                raise fail("graph", f"family: state {key} dependencies not strictly increasing")
            prev_dep = dep.sort_key()
    _check_acyclic(family)


def _check_acyclic(family: Family) -> None:
    graph = {s.key: s.dependencies for s in family.states}
    # iterative three-colour DFS: white (absent), grey (1), black (2)
    colour: dict[StateKey, int] = {}
    for start in graph:
        if colour.get(start):
            continue
        stack = [(start, iter(graph[start]))]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                continue
            c = colour.get(nxt)
            if c == 1:
                raise fail("graph", f"family: dependency cycle through {nxt}")
            if c is None:
                colour[nxt] = 1
                stack.append((nxt, iter(graph[nxt])))


def _footprint(shape: tuple[int, ...], strides: tuple[int, ...], width: int) -> int:
    total = 0
    for dim, stride in zip(shape, strides):
        total = checked_add(total, checked_mul(dim - 1, stride))
    return checked_mul(checked_add(total, 1), width)


def _check_row_major(key: StateKey, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """Contiguous layout (step 6): the canonical row-major strides, innermost first, each
    compared as soon as it is computed (errata E2-2): a mismatch refuses ``semantics`` even
    where finishing the row-major product would overflow; only a stride that is itself
    needed and overflows refuses ``bounds``."""
    expected = 1
    for axis in range(len(shape) - 1, -1, -1):
        if strides[axis] != expected:
            raise fail("semantics", f"manifest: state {key} strides are not row-major")
        if axis:
            expected = checked_mul(expected, shape[axis])


def validate_manifest(manifest: Manifest, *, max_restored_bytes: int = C.DEFAULT_MAX_RESTORED_BYTES) -> None:
    m = manifest
    _validate_identity_fields(m)
    validate_family(m.family)
    range_start = _delta_range_start(m)
    family_states = m.family.states
    if len(m.schema.states) != len(family_states) or len(m.payload) != len(family_states):
        raise fail("bounds", "manifest: schema/payload state counts differ from the family")
    _validate_groups(m)
    seg_total = 0
    complete_total = 0
    for fs, rs, ps in zip(family_states, m.schema.states, m.payload):
        seg_bytes, complete_bytes = _validate_state(fs, rs, ps, m.cut.token_count, range_start)
        seg_total = checked_add(seg_total, seg_bytes)
        complete_total = checked_add(complete_total, complete_bytes)
    if seg_total != m.schema.segment_restored_bytes or complete_total != m.schema.complete_restored_bytes:
        raise fail("bounds", "manifest: restored-byte totals mismatch")
    if complete_total > max_restored_bytes:
        raise fail("bounds", f"manifest: {complete_total} restored bytes exceeds the maximum {max_restored_bytes}")
    assert complete_total <= U64_MAX


def _validate_identity_fields(m: Manifest) -> None:
    if m.tenant == C.ZERO32:
        raise fail("semantics", "manifest: zero tenant")
    if m.key_epoch == 0:
        raise fail("semantics", "manifest: key epoch 0")
    if C.ZERO32 in m.semantic.fields():
        raise fail("semantics", "manifest: zero semantic model field")
    if m.cut.token_root == C.ZERO32 or m.cut.aux_root == C.ZERO32 or m.cut.token_count == 0:
        raise fail("semantics", "manifest: empty or zero input cut")


def _delta_range_start(m: Manifest) -> int:
    """First token of the segment this manifest carries: 0 for a full pack, the parent's cut
    for a delta (whose parent link is checked here)."""
    schema = m.schema
    parent = schema.parent
    if parent is None:
        return 0
    if C.ZERO32 in (parent.manifest_id, parent.cut.token_root, parent.cut.aux_root):
        raise fail("graph", "manifest: delta parent has a zero id")
    if not 1 <= schema.depth <= C.MAX_DELTA_DEPTH:
        raise fail("graph", f"manifest: delta depth {schema.depth}")
    if parent.cut.aux_root != m.cut.aux_root:
        raise fail("graph", "manifest: delta parent has another auxiliary root")
    if not 1 <= parent.cut.token_count < m.cut.token_count:
        raise fail("graph", f"manifest: delta parent cut {parent.cut.token_count} not inside 1..{m.cut.token_count}")
    return parent.cut.token_count


def _validate_state(fs: FamilyState, rs: RealizedState, ps: PayloadState, cut: int, range_start: int) -> tuple[int, int]:
    """Steps 5-8 for one state; returns its (segment, complete) restored bytes."""
    key = fs.key
    if rs.key != key or ps.key != key:
        raise fail("semantics", f"manifest: state keys differ ({key}, {rs.key}, {ps.key})")
    range_count = cut - range_start
    expect_full = tuple(cut if i == fs.token_axis else d for i, d in enumerate(fs.dims))
    if rs.full_shape != expect_full:
        raise fail("semantics", f"manifest: state {key} full shape {rs.full_shape} != {expect_full}")
    expect_seg = tuple(range_count if i == fs.token_axis else d for i, d in enumerate(fs.dims))
    if rs.segment_shape != expect_seg:
        raise fail("semantics", f"manifest: state {key} segment shape {rs.segment_shape} != {expect_seg}")
    if (rs.logical_start, rs.logical_count, rs.absolute_position, rs.window) != (range_start, range_count, cut, 0):
        raise fail("semantics", f"manifest: state {key} logical range/position/window mismatch")
    if len(rs.strides) != len(fs.dims) or 0 in rs.strides:
        raise fail("semantics", f"manifest: state {key} strides {rs.strides}")
    if fs.layout == C.LAYOUT_CONTIGUOUS:
        _check_row_major(key, rs.full_shape, rs.strides)
    width = fs.width
    # Every byte quantity first (errata E2-2): an overflow in any of them refuses ``bounds``
    # before any of them is compared with what the manifest declares.
    offset = checked_mul(range_start, rs.strides[fs.token_axis], width)
    span_bytes = _footprint(rs.segment_shape, rs.strides, width)
    complete_footprint = _footprint(rs.full_shape, rs.strides, width)
    seg_bytes = checked_mul(*rs.segment_shape, width)
    complete_bytes = checked_mul(*rs.full_shape, width)
    if (rs.physical_offset_bytes, rs.physical_span_bytes, rs.complete_physical_bytes) != (offset, span_bytes, complete_footprint):
        raise fail("semantics", f"manifest: state {key} physical offset/span/complete mismatch")
    _validate_spans(fs, rs, ps, cut, range_start)
    return seg_bytes, complete_bytes


def _validate_spans(fs: FamilyState, rs: RealizedState, ps: PayloadState, cut: int, range_start: int) -> None:
    """Step 8.9-8.12: the spans tile ``[range_start, cut)`` contiguously, one ref each."""
    key = fs.key
    if not 1 <= len(rs.spans) <= C.MAX_CHUNKS_PER_STATE or len(ps.chunks) != len(rs.spans):
        raise fail("bounds", f"manifest: state {key} has {len(rs.spans)} spans and {len(ps.chunks)} chunks")
    bpt = checked_mul(fs.elements_per_token, fs.width)
    if not 1 <= bpt <= C.MAX_CHUNK_PLAINTEXT:
        raise fail("bounds", f"manifest: state {key} bytes per token {bpt}")
    next_token = range_start
    next_offset = checked_mul(range_start, bpt)
    for span, ref in zip(rs.spans, ps.chunks):
        if span.token_start != next_token or span.token_count == 0 or span.plaintext_offset != next_offset:
            raise fail("semantics", f"manifest: state {key} spans not contiguous at token {next_token}")
        size = checked_mul(span.token_count, bpt)
        if size != span.plaintext_bytes or size > C.MAX_CHUNK_PLAINTEXT or ref.plaintext_bytes != size:
            raise fail("semantics", f"manifest: state {key} span size mismatch")
        if C.ZERO32 in (ref.content_id, ref.object_key, ref.object_digest) or ref.key_epoch == 0:
            raise fail("semantics", f"manifest: state {key} chunk ref has a zero id or epoch")
        if ref.object_bytes % C.ALIGNMENT or not C.ALIGNMENT < ref.object_bytes <= C.MAX_CHUNK_OBJECT_BYTES:
            raise fail("semantics", f"manifest: state {key} chunk object size {ref.object_bytes}")
        next_token = checked_add(next_token, span.token_count)
        next_offset = checked_add(next_offset, size)
    if next_token != cut or next_offset != checked_mul(cut, bpt):
        raise fail("semantics", f"manifest: state {key} spans end at {next_token}, not {cut}")


def _validate_groups(m: Manifest) -> None:
    keys = {s.key for s in m.family.states}
    seen: set[StateKey] = set()
    previous_id = 0
    for group in m.schema.groups:
        if group.group_id == 0 or group.group_id <= previous_id:
            raise fail("semantics", f"manifest: group id {group.group_id} zero or not increasing")
        previous_id = group.group_id
        # key by key, first failure wins (errata E2-1): membership, then order within the
        # group, then "already in an earlier group"; no whole-group pre-check
        prev_key = None
        for key in group.keys:
            if key not in keys:
                raise fail("graph", f"manifest: group {group.group_id} names unknown state {key}")
            if prev_key is not None and not key.sort_key() > prev_key:
                raise fail("semantics", f"manifest: group {group.group_id} keys not sorted/unique")
            prev_key = key.sort_key()
            if key in seen:
                raise fail("graph", f"manifest: state {key} in two groups")
        seen.update(group.keys)
    if seen != keys:
        raise fail("graph", "manifest: atomic groups do not cover the family")
