"""Each semantic rule of family and manifest validation refuses with its normative category
(INTEROP-A-ERRATA §4.6, §4.7), and chunk/pack/sidecar checks refuse in their documented order."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest

from kvpack.errors import FormatError
from kvpack.format import (
    AtomicGroup,
    Span,
    StateKey,
    StatsSidecar,
    decode_chunk,
    decode_pack,
    encode_chunk,
    encode_pack,
    validate_family,
    validate_manifest,
)
from kvpack.format.fixtures import fixture_keys, reference_delta_chain, reference_fixture

KEYS = fixture_keys()
OBJS = dict(reference_fixture("raw", "plain", "plain"))
MANIFEST, _ = decode_pack(OBJS["pack"], KEYS)
FAMILY = MANIFEST.family
STATE = FAMILY.states[0]
SCHEMA = MANIFEST.schema
RS = SCHEMA.states[0]
PS = MANIFEST.payload[0]
REF = PS.chunks[0]
DELTA, _ = decode_pack(dict(reference_delta_chain("raw", "plain", "plain"))["stage-3/pack"], KEYS)


def _fam(**state_changes):
    return replace(FAMILY, states=(replace(STATE, **state_changes),))


def _schema_state(**changes):
    return replace(MANIFEST, schema=replace(SCHEMA, states=(replace(RS, **changes),)))


def _ref(**changes):
    return replace(MANIFEST, payload=(replace(PS, chunks=(replace(REF, **changes),)),))


Z = bytes(32)
FAMILY_CASES = {
    "zero-abi": (replace(FAMILY, engine_cache_abi=Z), "semantics"),
    "zero-topology": (replace(FAMILY, topology=Z), "semantics"),
    "page-zero": (replace(FAMILY, page_size_tokens=0), "semantics"),
    "no-states": (replace(FAMILY, states=()), "bounds"),
    "empty-name": (_fam(key=StateKey(0, "")), "semantics"),
    "nul-name": (_fam(key=StateKey(0, "a\0b")), "semantics"),
    "long-name": (_fam(key=StateKey(0, "x" * 256)), "semantics"),
    "unsorted": (replace(FAMILY, states=(replace(STATE, key=StateKey(1, "b")), replace(STATE, key=StateKey(1, "a")))), "semantics"),
    "duplicate": (replace(FAMILY, states=(STATE, STATE)), "semantics"),
    "codec-version": (_fam(codec_version=2), "codec"),
    "axis-out-of-rank": (_fam(token_axis=2), "semantics"),
    "two-token-axes": (_fam(dims=(0, 0)), "semantics"),
    "no-token-axis": (_fam(dims=(4, 4)), "semantics"),
    "elements-mismatch": (_fam(elements_per_token=5), "semantics"),
    "elements-overflow": (_fam(dims=(0, 2**63, 4), elements_per_token=4), "bounds"),
    "contiguous-gather": (_fam(token_axis_rule=2), "semantics"),
    "portable-strided": (replace(_fam(layout=2), mode=2), "semantics"),
    "self-dependency": (_fam(dependencies=(STATE.key,)), "graph"),
    "unknown-dependency": (_fam(dependencies=(StateKey(9, "nope"),)), "graph"),
    "cycle": (
        replace(
            FAMILY,
            states=(
                replace(STATE, key=StateKey(0, "a"), dependencies=(StateKey(0, "b"),)),
                replace(STATE, key=StateKey(0, "b"), dependencies=(StateKey(0, "a"),)),
            ),
        ),
        "graph",
    ),
    "deps-unsorted": (
        replace(
            FAMILY,
            states=(
                replace(STATE, key=StateKey(0, "a")),
                replace(STATE, key=StateKey(0, "b")),
                replace(STATE, key=StateKey(0, "c"), dependencies=(StateKey(0, "b"), StateKey(0, "a"))),
            ),
        ),
        "graph",
    ),
}


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_family_rules(case):
    family, category = FAMILY_CASES[case]
    with pytest.raises(FormatError) as info:
        validate_family(family)
    assert info.value.category == category, info.value


def _delta(**changes):
    return replace(DELTA, schema=replace(DELTA.schema, **changes))


MANIFEST_CASES = {
    "zero-tenant": (replace(MANIFEST, tenant=Z), "semantics"),
    "epoch-zero": (replace(MANIFEST, key_epoch=0), "semantics"),
    "zero-semantic": (replace(MANIFEST, semantic=replace(MANIFEST.semantic, qualified_math=Z)), "semantics"),
    "zero-token-root": (replace(MANIFEST, cut=replace(MANIFEST.cut, token_root=Z)), "semantics"),
    "zero-count": (replace(MANIFEST, cut=replace(MANIFEST.cut, token_count=0)), "semantics"),
    "family-rule": (replace(MANIFEST, family=replace(FAMILY, page_size_tokens=0)), "semantics"),
    "delta-zero-parent": (_delta(parent=replace(DELTA.schema.parent, manifest_id=Z)), "graph"),
    "delta-depth-0": (_delta(depth=0), "graph"),
    "delta-depth-8": (_delta(depth=8), "graph"),
    "delta-other-aux": (_delta(parent=replace(DELTA.schema.parent, cut=replace(DELTA.schema.parent.cut, aux_root=bytes([5]) * 32))), "graph"),
    "delta-parent-at-cut": (_delta(parent=replace(DELTA.schema.parent, cut=replace(DELTA.schema.parent.cut, token_count=4))), "graph"),
    "state-count": (replace(MANIFEST, payload=MANIFEST.payload * 2), "bounds"),
    "group-id-zero": (replace(MANIFEST, schema=replace(SCHEMA, groups=(AtomicGroup(0, (STATE.key,)),))), "semantics"),
    "group-unknown-key": (replace(MANIFEST, schema=replace(SCHEMA, groups=(AtomicGroup(1, (StateKey(3, "x"),)),))), "graph"),
    "group-twice": (replace(MANIFEST, schema=replace(SCHEMA, groups=(AtomicGroup(1, (STATE.key,)), AtomicGroup(2, (STATE.key,))))), "graph"),
    "group-unsorted": (replace(MANIFEST, schema=replace(SCHEMA, groups=(AtomicGroup(1, (STATE.key, STATE.key)),))), "semantics"),
    "key-differs": (_schema_state(key=StateKey(0, "attention.v")), "semantics"),
    "full-shape": (_schema_state(full_shape=(5, 4)), "semantics"),
    "segment-shape": (_schema_state(segment_shape=(3, 4)), "semantics"),
    "absolute-position": (_schema_state(absolute_position=1), "semantics"),
    "logical-start": (_schema_state(logical_start=1), "semantics"),
    "window": (_schema_state(window=1), "semantics"),
    "stride-count": (_schema_state(strides=(4,)), "semantics"),
    "zero-stride": (_schema_state(strides=(4, 0)), "semantics"),
    "not-row-major": (_schema_state(strides=(8, 1)), "semantics"),
    "physical-offset": (_schema_state(physical_offset_bytes=4), "semantics"),
    "complete-bytes": (_schema_state(complete_physical_bytes=17), "semantics"),
    "chunk-count": (replace(MANIFEST, payload=(replace(PS, chunks=(REF, REF)),)), "bounds"),
    "span-gap": (_schema_state(spans=(Span(1, 4, 4, 16),)), "semantics"),
    "span-short": (_schema_state(spans=(Span(0, 3, 0, 12),)), "semantics"),
    "span-zero-tokens": (_schema_state(spans=(Span(0, 0, 0, 0),)), "semantics"),
    "ref-plaintext": (_ref(plaintext_bytes=15), "semantics"),
    "ref-zero-id": (_ref(content_id=Z), "semantics"),
    "ref-epoch-zero": (_ref(key_epoch=0), "semantics"),
    "ref-unaligned": (_ref(object_bytes=8193), "semantics"),
    "ref-too-small": (_ref(object_bytes=4096), "semantics"),
    "totals": (replace(MANIFEST, schema=replace(SCHEMA, complete_restored_bytes=17)), "bounds"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_manifest_rules(case):
    manifest, category = MANIFEST_CASES[case]
    with pytest.raises(FormatError) as info:
        validate_manifest(manifest)
    assert info.value.category == category, info.value


def test_valid_manifests_pass_and_restored_bytes_bound():
    validate_manifest(MANIFEST)
    validate_manifest(DELTA)
    with pytest.raises(FormatError) as info:
        validate_manifest(MANIFEST, max_restored_bytes=15)
    assert info.value.category == "bounds"


def test_pack_encoder_refuses_invalid_manifest_and_nothing_is_produced():
    with pytest.raises(FormatError):
        encode_pack(replace(MANIFEST, key_epoch=0), KEYS)


def _chunk_decode(obj, ref=REF, span=RS.spans[0], **kw):
    args = dict(ref=ref, span=span, tenant=MANIFEST.tenant, family=FAMILY, key=STATE.key, keys=KEYS)
    args.update(kw)
    return decode_chunk(obj, **args)


def _set(obj: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(obj)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


CHUNK = OBJS["chunk"]
CHUNK_CASES = {
    "short": (CHUNK[:4095], "bounds"),
    "unaligned": (CHUNK + b"\0", "bounds"),
    "header-only": (CHUNK[:4096], "bounds"),
    "magic": (b"KVCHK2\0\0" + CHUNK[8:], "bad_magic"),
    "header-size": (_set(CHUNK, 10, "<H", 512), "bad_magic"),
    "flags": (_set(CHUNK, 16, "<I", 2), "reserved"),
    "codec": (_set(CHUNK, 20, "<H", 3), "unknown_enum"),
    "codec-version": (_set(CHUNK, 22, "<H", 2), "codec"),
    "plaintext-zero": (_set(CHUNK, 24, "<I", 0), "bounds"),
    "object-bytes": (_set(CHUNK, 36, "<I", 12288), "bounds"),
    "stored": (_set(CHUNK, 32, "<I", 40), "bounds"),
    "padding": (CHUNK[:-1] + b"\x01", "reserved"),
    "tail": (_set(CHUNK, 4000, "<B", 1), "reserved"),
    "salt-on-plain": (_set(CHUNK, 180, "<B", 1), "reserved"),
    "header-digest": (_set(CHUNK, 210, "<B", 1), "authentication"),
}


@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
def test_chunk_refusals(case):
    obj, category = CHUNK_CASES[case]
    with pytest.raises(FormatError) as info:
        _chunk_decode(obj)
    assert info.value.category == category, info.value


def test_chunk_binding_refusals():
    span = RS.spans[0]
    for kwargs, category in [
        (dict(ref=replace(REF, object_bytes=12288)), "bounds"),
        (dict(ref=replace(REF, object_digest=bytes([7]) * 32)), "authentication"),
        (dict(tenant=bytes([2]) * 32), "authentication"),
        (dict(key=StateKey(0, "other")), "semantics"),
        (dict(ref=replace(REF, key_epoch=8)), "authentication"),
        (dict(span=replace(span, token_start=1)), "authentication"),  # content id binds the position
        (dict(keys=type(KEYS).derive(bytes([98]) * 32, KEYS.tenant, 7)), "authentication"),
    ]:
        with pytest.raises(FormatError) as info:
            _chunk_decode(CHUNK, **kwargs)
        assert info.value.category == category, (kwargs, info.value)


def test_chunk_encoder_refusals():
    span = Span(0, 4, 0, 16)
    base = dict(keys=KEYS, family_digest=FAMILY.digest(), key=STATE.key, span=span, plaintext=bytes(16), codec=1)
    for changes, category in [
        (dict(span=Span(0, 4, 0, 15)), "semantics"),
        (dict(codec_version=2), "codec"),
        (dict(plaintext=b"", span=Span(0, 0, 0, 0)), "bounds"),
        (dict(salt=bytes(3)), "bounds"),
        (dict(salt=bytes([1]) * 16), "reserved"),
        (dict(sidecar=b"junkjunkjunk"), "bad_magic"),
    ]:
        with pytest.raises(FormatError) as info:
            encode_chunk(**{**base, **changes})
        assert info.value.category == category, (changes, info.value)


def test_sidecar_fixture_and_rules():
    values = [(1, 0.5, -1, 2), (0, 1.5, -0.5, 1), (-2, 0.25, 3, 0), (4, -0.75, 0.5, 1)]
    import numpy as np

    plaintext = np.array(values, dtype="<f2").tobytes()
    side = StatsSidecar.from_f16(plaintext, 4, 2)
    encoded = side.encode()
    assert len(encoded) == 62  # errata S3-11
    assert [i for i, _ in side.sinks] == [3, 2]
    assert StatsSidecar.decode(encoded) == side
    # -0.0 and +0.0 tie by value, so the lower index wins (errata S2-17)
    tie = StatsSidecar(((0x3C00, 0x3C00),), (0x8000, 0x3C00), ((0, 0x8000),))
    with pytest.raises(FormatError) as info:
        StatsSidecar.decode(tie.encode())
    assert info.value.category == "semantics"
    fam16 = replace(FAMILY, states=(replace(STATE, dtype=6, dims=(0, 4)),))
    chunk = encode_chunk(keys=KEYS, family_digest=fam16.digest(), key=STATE.key, span=Span(0, 4, 0, 32), plaintext=plaintext, codec=1, sidecar=encoded)
    plain_chunk = encode_chunk(keys=KEYS, family_digest=fam16.digest(), key=STATE.key, span=Span(0, 4, 0, 32), plaintext=plaintext, codec=1)
    assert chunk.object_key != plain_chunk.object_key  # the sidecar digest is bound into the key
    out = decode_chunk(chunk.obj, ref=chunk.ref, span=Span(0, 4, 0, 32), tenant=KEYS.tenant, family=fam16, key=STATE.key, keys=KEYS)
    assert out == plaintext


def test_pack_refusal_order():
    pack = OBJS["pack"]
    cases = [
        (pack[:8191], "truncated"),
        (b"X" + pack[1:], "bad_magic"),
        (_set(pack, 16, "<I", 4), "reserved"),
        (_set(pack, 48, "<Q", 1), "reserved"),
        (_set(pack, 200, "<B", 1), "reserved"),
        (_set(pack, 24, "<Q", 2**40), "bounds"),
        (pack + b"\0", "bad_magic"),  # the footer is always the last 4096 bytes
        (_set(pack, len(pack) - 4096 + 8, "<H", 2), "reserved"),
        (_set(pack, len(pack) - 4096 + 24, "<Q", 8), "bounds"),
        (_set(pack, 170, "<B", 1), "checksum"),
        (_set(pack, len(pack) - 4096 + 90, "<B", 1), "authentication"),
        (_set(pack, 5000, "<B", 0xFF), "authentication"),
    ]
    for data, category in cases:
        with pytest.raises(FormatError) as info:
            decode_pack(data, KEYS)
        assert info.value.category == category, info.value
    other_epoch = type(KEYS).derive(bytes([99]) * 32, KEYS.tenant, 8)
    with pytest.raises(FormatError) as info:
        decode_pack(pack, other_epoch)
    assert info.value.category == "authentication"
