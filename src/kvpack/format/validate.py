"""Semantic validation of families and manifests (INTEROP.md A.3, INTEROP-A-ERRATA §4.6-4.7).

The checks run in the normative order; the first failure wins, with its category. A manifest
that passes describes exactly one contiguous, fully covered byte stream per state.
"""

from __future__ import annotations

from . import constants as C
from .objects import Family, Manifest, StateKey
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


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for dim in reversed(shape):
        strides.append(acc)
        acc = checked_mul(acc, dim)
    return tuple(reversed(strides))


def validate_manifest(manifest: Manifest, *, max_restored_bytes: int = C.DEFAULT_MAX_RESTORED_BYTES) -> None:
    m = manifest
    if m.tenant == C.ZERO32:
        raise fail("semantics", "manifest: zero tenant")
    if m.key_epoch == 0:
        raise fail("semantics", "manifest: key epoch 0")
    if C.ZERO32 in m.semantic.fields():
        raise fail("semantics", "manifest: zero semantic model field")
    if m.cut.token_root == C.ZERO32 or m.cut.aux_root == C.ZERO32 or m.cut.token_count == 0:
        raise fail("semantics", "manifest: empty or zero input cut")
    validate_family(m.family)
    cut = m.cut.token_count
    schema = m.schema
    if schema.parent is not None:
        parent = schema.parent
        if C.ZERO32 in (parent.manifest_id, parent.cut.token_root, parent.cut.aux_root):
            raise fail("graph", "manifest: delta parent has a zero id")
        if not 1 <= schema.depth <= C.MAX_DELTA_DEPTH:
            raise fail("graph", f"manifest: delta depth {schema.depth}")
        if parent.cut.aux_root != m.cut.aux_root:
            raise fail("graph", "manifest: delta parent has another auxiliary root")
        if not 1 <= parent.cut.token_count < cut:
            raise fail("graph", f"manifest: delta parent cut {parent.cut.token_count} not inside 1..{cut}")
        range_start = parent.cut.token_count
    else:
        range_start = 0
    range_count = cut - range_start

    family_states = m.family.states
    if len(schema.states) != len(family_states) or len(m.payload) != len(family_states):
        raise fail("bounds", "manifest: schema/payload state counts differ from the family")

    _validate_groups(m)

    seg_total = 0
    complete_total = 0
    for fs, rs, ps in zip(family_states, schema.states, m.payload):
        key = fs.key
        if rs.key != key or ps.key != key:
            raise fail("semantics", f"manifest: state keys differ ({key}, {rs.key}, {ps.key})")
        rank = len(fs.dims)
        expect_full = tuple(cut if i == fs.token_axis else d for i, d in enumerate(fs.dims))
        if rs.full_shape != expect_full:
            raise fail("semantics", f"manifest: state {key} full shape {rs.full_shape} != {expect_full}")
        expect_seg = tuple(range_count if i == fs.token_axis else d for i, d in enumerate(fs.dims))
        if rs.segment_shape != expect_seg:
            raise fail("semantics", f"manifest: state {key} segment shape {rs.segment_shape} != {expect_seg}")
        if (rs.logical_start, rs.logical_count, rs.absolute_position, rs.window) != (range_start, range_count, cut, 0):
            raise fail("semantics", f"manifest: state {key} logical range/position/window mismatch")
        if len(rs.strides) != rank or 0 in rs.strides:
            raise fail("semantics", f"manifest: state {key} strides {rs.strides}")
        if fs.layout == C.LAYOUT_CONTIGUOUS and rs.strides != _row_major(rs.full_shape):
            raise fail("semantics", f"manifest: state {key} strides are not row-major")
        width = fs.width
        offset = checked_mul(range_start, rs.strides[fs.token_axis], width)
        if (
            rs.physical_offset_bytes != offset
            or rs.physical_span_bytes != _footprint(rs.segment_shape, rs.strides, width)
            or rs.complete_physical_bytes != _footprint(rs.full_shape, rs.strides, width)
        ):
            raise fail("semantics", f"manifest: state {key} physical offset/span/complete mismatch")
        if not 1 <= len(rs.spans) <= C.MAX_CHUNKS_PER_STATE or len(ps.chunks) != len(rs.spans):
            raise fail("bounds", f"manifest: state {key} has {len(rs.spans)} spans and {len(ps.chunks)} chunks")
        bpt = checked_mul(fs.elements_per_token, width)
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
        seg_total = checked_add(seg_total, checked_mul(*rs.segment_shape, width))
        complete_total = checked_add(complete_total, checked_mul(*rs.full_shape, width))
    if seg_total != schema.segment_restored_bytes or complete_total != schema.complete_restored_bytes:
        raise fail("bounds", "manifest: restored-byte totals mismatch")
    if complete_total > max_restored_bytes:
        raise fail("bounds", f"manifest: {complete_total} restored bytes exceeds the maximum {max_restored_bytes}")
    assert complete_total <= U64_MAX


def _validate_groups(m: Manifest) -> None:
    keys = {s.key for s in m.family.states}
    seen: set[StateKey] = set()
    previous_id = 0
    for group in m.schema.groups:
        if group.group_id == 0 or group.group_id <= previous_id:
            raise fail("semantics", f"manifest: group id {group.group_id} zero or not increasing")
        previous_id = group.group_id
        prev_key = None
        for key in group.keys:
            if prev_key is not None and not key.sort_key() > prev_key:
                raise fail("semantics", f"manifest: group {group.group_id} keys not sorted/unique")
            prev_key = key.sort_key()
        for key in group.keys:
            if key not in keys:
                raise fail("graph", f"manifest: group {group.group_id} names unknown state {key}")
            if key in seen:
                raise fail("graph", f"manifest: state {key} in two groups")
            seen.add(key)
    if seen != keys:
        raise fail("graph", "manifest: atomic groups do not cover the family")
