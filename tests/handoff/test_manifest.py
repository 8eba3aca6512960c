"""C.4-C.6 typed parse and validation rules, one refusal per rule, and round trips."""

import dataclasses

import pytest
from hypothesis import given, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff.admission import check_admission, transfer_id_matches
from kvpack.handoff.canonical_json import canonical_bytes, parse_json
from kvpack.handoff.manifest import (
    BeginManifestV2,
    ComponentV2,
    MultimodalIdentityV1,
    OverlapTracker,
    SealCoreV2,
    SealManifestV2,
    SegmentDescriptorV2,
    check_descriptor,
    check_seal,
    seal_tag,
    validate_begin,
)
from kvpack.handoff.schedule import muse_intents
from kvpack.handoff.sender import declare_segments

from ._support import IDENTITY, KEY, KEY_ID, NOW, TARGET, expectations, manifest, payloads_for


def _declared(**kw):
    intents = muse_intents(1)
    return manifest((5,), segments=declare_segments(intents, payloads_for(intents)), **kw)


def _validate(m, now=NOW, key_id=KEY_ID, minimum_epoch=1):
    validate_begin(m, now_unix_ms=now, expected_key_id=key_id, minimum_epoch=minimum_epoch)


def _refused(m, category, match=None, **kw):
    with pytest.raises(ProtocolError, match=match) as e:
        _validate(m, **kw)
    assert e.value.category == category, e.value


def test_valid_declared_and_deferred():
    _validate(_declared())
    _validate(manifest((5,), deferred=True))


def test_protocol_and_transfer_id():
    _refused(dataclasses.replace(_declared(), protocol="kvpack-live-handoff-v1"), "manifest", "protocol")
    for tid in ("", "x" * 129, "a b", "é", "a/b"):
        _refused(_declared(transfer_id=tid), "manifest", "transfer_id")
    _validate(_declared(transfer_id="A-z_0.9" + "x" * 121))


def test_time_window():
    _refused(_declared(expires=1_700_000_000_000), "manifest", "expires")
    _refused(_declared(), "expired", now=1_700_000_900_001)
    _validate(_declared(), now=1_700_000_900_000)  # now == expires is still valid


def test_key_id_and_epoch():
    _refused(_declared(key_id="other"), "key", "key id")
    _refused(_declared(epoch=1), "key", "epoch", minimum_epoch=2)
    _validate(_declared(epoch=3), minimum_epoch=2)


def test_digests_lowercase_hex():
    bad = dataclasses.replace(IDENTITY, model_sha256="D" * 64)
    _refused(dataclasses.replace(_declared(), identity=bad), "manifest", "model_sha256")
    mm = MultimodalIdentityV1("1" * 64, "2" * 64, "3" * 63)
    _refused(dataclasses.replace(_declared(), multimodal=mm), "manifest", "projector")
    _validate(dataclasses.replace(_declared(), multimodal=MultimodalIdentityV1("1" * 64, "2" * 64, "3" * 64)))


def test_components_rules():
    _refused(_declared(components=()), "manifest", "no components")
    _refused(_declared(components=(TARGET, TARGET)), "manifest", "duplicate")
    _refused(_declared(components=(dataclasses.replace(TARGET, id=""),)), "manifest", "empty component")
    _refused(_declared(components=(dataclasses.replace(TARGET, required=False),)), "manifest", "required target")
    dflash = ComponentV2("dflash", "dflash_context", True, "0" * 64)
    _refused(_declared(components=(TARGET, dflash)), "manifest", "dflash")
    _validate(manifest((5,), deferred=True, components=(TARGET, dflash)))


def test_segment_mode_exactly_one():
    _refused(manifest((5,)), "manifest", "declared mode without segments")
    _refused(dataclasses.replace(_declared(), deferred_segments=True), "manifest", "deferred mode with declared")
    _refused(manifest((), deferred=True), "manifest", "empty prompt")


def test_declared_descriptor_rules():
    m = _declared()
    d0 = m.segments[0]
    cases = [
        (dataclasses.replace(d0, sequence=1), "sequence"),
        (dataclasses.replace(d0, component_id="nope"), "unknown component"),
        (dataclasses.replace(d0, logical_count=0, byte_len=0), "zero"),
        (dataclasses.replace(d0, elements_per_token=0), "zero"),
        (dataclasses.replace(d0, sha256="A" * 64), "sha256"),
        (dataclasses.replace(d0, byte_len=d0.byte_len + 2), "byte_len"),
        (dataclasses.replace(d0, element_type="f32_le"), "byte_len"),
    ]
    for bad, match in cases:
        _refused(dataclasses.replace(m, segments=(bad,) + m.segments[1:]), "manifest", match)


def test_overlap_per_component_role_layer():
    t = OverlapTracker()
    base = dict(sequence=0, component_id="t", role="swa_tile", layer=0, element_type="f16_le", elements_per_token=1, sha256="0" * 64)

    def d(start, count, **kw):
        return SegmentDescriptorV2(**{**base, **kw, "logical_start": start, "logical_count": count, "byte_len": 2 * count})

    t.add(d(10, 5))
    t.add(d(0, 10))
    t.add(d(15, 5))
    t.add(d(12, 3, layer=17))  # other layer: independent
    t.add(d(12, 3, role="nope_tile", layer=None))
    for start, count in ((14, 1), (0, 1), (19, 10), (5, 20)):
        with pytest.raises(ProtocolError, match="overlaps"):
            t.add(d(start, count))
    t.add(d(20, 1))


def test_check_descriptor_u64_overflow():
    d = declare_segments(muse_intents(1), payloads_for(muse_intents(1)))[0]
    with pytest.raises(ProtocolError, match="overflows"):
        check_descriptor(dataclasses.replace(d, logical_start=2**64 - 1), {"target"})


def test_typed_parse_strictness():
    raw = _declared().to_json()
    BeginManifestV2.from_json(raw)
    mutations = [
        lambda r: r.update(extra=1),
        lambda r: r.update(generation=True),
        lambda r: r.update(generation=-1),
        lambda r: r.update(generation="1"),
        lambda r: r.update(deferred_segments=1),
        lambda r: r["identity"].update(extra="x"),
        lambda r: r["hmac"].update(epoch=1.5),
        lambda r: r["components"][0].update(kind="target"),
        lambda r: r["components"][0].update(required=1),
        lambda r: r["segments"][0].update(role="swa"),
        lambda r: r["segments"][0].update(element_type="bf16"),
        lambda r: r["segments"][0].update(layer=-1),
        lambda r: r["segments"][0].update(unknown=0),
        lambda r: r.update(prompt_token_ids=[5, 2**32]),
        lambda r: r.update(prompt_token_ids=[True]),
        lambda r: r.pop("hmac"),
        lambda r: r.update(multimodal={"projector_sha256": "0" * 64}),
    ]
    for mutate in mutations:
        r = _declared().to_json()
        mutate(r)
        with pytest.raises(ProtocolError) as e:
            BeginManifestV2.from_json(r)
        assert e.value.category == "json"


def test_optional_fields_absent():
    r = manifest((5,), deferred=True).to_json()
    del r["multimodal"]
    m = BeginManifestV2.from_json(r)
    assert m.multimodal is None and m.to_json()["multimodal"] is None
    d = _declared().segments[3].to_json()
    assert d["layer"] is None
    del d["layer"]
    assert SegmentDescriptorV2.from_json(d).layer is None


def test_seal_check_names_each_mismatch():
    core = SealCoreV2("t-1", 1, "1" * 64, "2" * 64, "3" * 64, 4, 100)
    seal = SealManifestV2(core, seal_tag(KEY, core))
    check_seal(KEY, seal, core)
    cases = [
        (dataclasses.replace(core, transfer_id="t-2"), "manifest"),
        (dataclasses.replace(core, generation=2), "manifest"),
        (dataclasses.replace(core, segment_count=5), "sequence"),
        (dataclasses.replace(core, total_bytes=101), "digest"),
        (dataclasses.replace(core, begin_sha256="4" * 64), "digest"),
        (dataclasses.replace(core, descriptor_sha256="4" * 64), "digest"),
        (dataclasses.replace(core, payload_sha256="4" * 64), "digest"),
    ]
    for expected, category in cases:
        with pytest.raises(ProtocolError) as e:
            check_seal(KEY, seal, expected)
        assert e.value.category == category
    for tag in (seal.hmac_sha256.upper(), seal.hmac_sha256[:-1], "0" * 64):
        with pytest.raises(ProtocolError) as e:
            check_seal(KEY, SealManifestV2(core, tag), core)
        assert e.value.category == "authentication"
    with pytest.raises(ProtocolError):
        check_seal(bytes(32), seal, core)


def test_admission_expectations():
    prompt = (1, 2, 3)
    m = manifest(prompt[:-1], deferred=True, transfer_id="muser-1700000000000-0-1")
    exp = expectations(prompt)
    check_admission(m, exp)
    bad = [
        (dataclasses.replace(m, generation=0), "manifest"),
        (dataclasses.replace(m, identity=dataclasses.replace(IDENTITY, model_revision="x")), "identity"),
        (dataclasses.replace(m, prompt_token_ids=prompt), "identity"),
        (dataclasses.replace(m, components=(dataclasses.replace(TARGET, identity_sha256="0" * 64),)), "identity"),
        (dataclasses.replace(m, components=(TARGET, ComponentV2("v", "vision_context", False, "0" * 64))), "identity"),
        (dataclasses.replace(m, components=(TARGET, ComponentV2("d", "dflash_context", True, "0" * 64))), "identity"),
    ]
    for mm, category in bad:
        with pytest.raises(ProtocolError) as e:
            check_admission(mm, exp)
        assert e.value.category == category
    with pytest.raises(ProtocolError, match="max_context"):
        check_admission(m, dataclasses.replace(exp, max_context=1))


def test_transfer_id_match_rule():
    assert transfer_id_matches("muser-17-0", "muser-17-0-1")
    assert not transfer_id_matches("muser-17-0", "muser-17-01-1")
    assert not transfer_id_matches("muser-17-0", "muser-18-0-1")
    assert transfer_id_matches("muser-17-0", "a" * 64)


# --- hypothesis round trips -------------------------------------------------------------

hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
descriptors = st.builds(
    SegmentDescriptorV2,
    sequence=u32,
    component_id=st.text(max_size=10),
    role=st.sampled_from(sorted(["nope_key", "nope_value", "swa_key", "swa_value", "nope_tile", "swa_tile", "dflash_key", "dflash_value", "auxiliary"])),
    layer=st.none() | u32,
    logical_start=u64,
    logical_count=u64,
    element_type=st.sampled_from(["f16_le", "f32_le"]),
    elements_per_token=u32,
    byte_len=u64,
    sha256=hex64,
)
manifests = st.builds(
    BeginManifestV2,
    protocol=st.text(max_size=30),
    transfer_id=st.text(max_size=20),
    generation=u64,
    created_unix_ms=u64,
    expires_unix_ms=u64,
    identity=st.builds(type(IDENTITY), *([hex64] * 3), st.text(max_size=5), hex64, st.text(max_size=5), hex64),
    prompt_token_ids=st.lists(u32, max_size=20).map(tuple),
    multimodal=st.none() | st.builds(MultimodalIdentityV1, hex64, hex64, hex64),
    hmac=st.builds(type(_declared().hmac), st.text(max_size=10), u64),
    components=st.lists(
        st.builds(ComponentV2, st.text(max_size=8), st.sampled_from(["target_kv", "dflash_context", "vision_context"]), st.booleans(), hex64),
        max_size=3,
    ).map(tuple),
    segments=st.lists(descriptors, max_size=3).map(tuple),
    deferred_segments=st.booleans(),
)
cores = st.builds(SealCoreV2, st.text(max_size=20), u64, hex64, hex64, hex64, u32, u64)


def _encodable(obj):
    try:
        return canonical_bytes(obj.to_json())
    except ProtocolError:
        return None  # lone surrogates in generated text: refused by design


@given(descriptors)
def test_descriptor_roundtrip(d):
    data = _encodable(d)
    if data is not None:
        assert SegmentDescriptorV2.from_json(parse_json(data, 1 << 20)) == d


@given(manifests)
def test_begin_roundtrip(m):
    data = _encodable(m)
    if data is not None:
        back = BeginManifestV2.from_json(parse_json(data, 1 << 22))
        assert back == m and back.begin_sha256() == m.begin_sha256()


@given(cores, hex64)
def test_seal_roundtrip(core, tag):
    s = SealManifestV2(core, tag)
    data = _encodable(s)
    if data is not None:
        assert SealManifestV2.from_json(parse_json(data, 1 << 20)) == s
