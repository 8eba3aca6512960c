"""Property tests: random valid objects round-trip exactly through encode/decode, and encoders
and decoders agree with the spec's arithmetic."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.format import (
    InputCutId,
    KeySchedule,
    Manifest,
    PayloadState,
    SemanticModelId,
    decode_chunk,
    decode_pack,
    encode_chunk,
    encode_pack,
)
from kvpack.format import constants as C
from kvpack.format.codec import decode_frame, encode_frame, packbits_encode, reference_packbits_encode
from kvpack.format.objects import Family, Schema, StateDeclaration, StateKey
from kvpack.format.validate import validate_manifest

from .strategies import families, ids, schemas_for

SETTINGS = settings(max_examples=150, deadline=None)  # too_slow, data_too_large: off in the suite profile (tests/conftest.py)


@SETTINGS
@given(families())
def test_family_round_trip(family):
    data = family.encode()
    assert Family.decode(data) == family
    assert Family.decode(data).encode() == data


def _runs(draw_bytes):
    return draw_bytes


runny = st.lists(st.tuples(st.integers(0, 255), st.integers(1, 300)), max_size=40).map(lambda runs: b"".join(bytes([v]) * n for v, n in runs))


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=700), runny))
def test_lossless_encoder_matches_the_rule_and_round_trips(data):
    assert packbits_encode(data) == reference_packbits_encode(data)
    if data:
        frame = encode_frame(C.CODEC_LOSSLESS, data)
        assert decode_frame(C.CODEC_LOSSLESS, frame, len(data)) == data
        raw = encode_frame(C.CODEC_RAW, data)
        assert decode_frame(C.CODEC_RAW, raw, len(data)) == data


def test_lossless_example_from_the_spec():
    assert len(encode_frame(C.CODEC_LOSSLESS, bytes(range(16)))) == 33


@SETTINGS
@given(st.data())
def test_manifest_chunks_and_pack_round_trip(data):
    family = data.draw(families())
    cut = data.draw(st.integers(1, 40))
    schema = data.draw(schemas_for(family, cut))
    epoch = data.draw(st.integers(1, 2**64 - 1))
    tenant = data.draw(ids)
    keys = KeySchedule.derive(data.draw(ids), tenant, epoch)
    semantic = SemanticModelId(*(data.draw(ids) for _ in range(5)))
    cut_id = InputCutId(data.draw(ids), data.draw(ids), cut)
    fam_digest = family.digest()
    encrypted = data.draw(st.booleans())
    payload = []
    plaintexts = {}
    for fs, rs in zip(family.states, schema.states):
        refs = []
        for span in rs.spans:
            plaintext = data.draw(st.binary(min_size=span.plaintext_bytes, max_size=span.plaintext_bytes))
            salt = data.draw(st.binary(min_size=16, max_size=16)) if encrypted else bytes(16)
            nonce = data.draw(st.binary(min_size=12, max_size=12)) if encrypted else bytes(12)
            chunk = encode_chunk(
                keys=keys, family_digest=fam_digest, key=fs.key, span=span, plaintext=plaintext, codec=fs.codec, encrypted=encrypted, salt=salt, nonce=nonce
            )
            plaintexts[chunk.ref.content_id] = (chunk.obj, plaintext)
            refs.append(chunk.ref)
        payload.append(PayloadState(fs.key, tuple(refs)))
    manifest = Manifest(tenant, epoch, semantic, cut_id, family, schema, tuple(payload))
    validate_manifest(manifest)
    encoded = manifest.encode()
    assert Manifest.decode(encoded) == manifest
    assert Schema.decode(schema.encode()) == schema
    pack_enc = data.draw(st.booleans())
    pack = encode_pack(manifest, keys, encrypted=pack_enc, salt=bytes(range(16)) if pack_enc else bytes(16), nonce=bytes(range(12)) if pack_enc else bytes(12))
    assert len(pack) == 8192 + len(encoded) + (16 if pack_enc else 0)
    decoded, plain = decode_pack(pack, keys)
    assert decoded == manifest and plain == encoded
    for key, span, ref in decoded.chunk_refs():
        obj, plaintext = plaintexts[ref.content_id]
        assert hashlib.sha256(obj).digest() == ref.object_digest
        assert decode_chunk(obj, ref=ref, span=span, tenant=tenant, family=family, key=key, keys=keys) == plaintext


@SETTINGS
@given(
    layer=st.integers(0, 2**32 - 1),
    name=st.text(min_size=0, max_size=20),
    full=st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=8),
    seg=st.lists(st.integers(1, 2**64 - 1), min_size=1, max_size=8),
    strides=st.lists(st.integers(0, 2**64 - 1), max_size=8),
    nums=st.tuples(*(st.integers(0, 2**64 - 1) for _ in range(4))),
    group=st.integers(0, 2**32 - 1),
)
def test_state_declaration_round_trip(layer, name, full, seg, strides, nums, group):
    decl = StateDeclaration(StateKey(layer, name), tuple(full), tuple(seg), tuple(strides), *nums, group)
    data = decl.encode()
    assert StateDeclaration.decode(data) == decl
