"""One-pass host verification refuses and accepts exactly as decode_chunk.

``decode_chunk_one_pass`` (the host restore's verifier) computes a raw unencrypted chunk's
object SHA-256 and content-ID HMAC in one blockwise pass over the object instead of one pass
each. For every chunk kind, every truncation and every single-bit flip it must give exactly
what ``decode_chunk`` gives: the same FormatError (category and message), or the same
plaintext; objects spanning many blocks are checked with flips at block boundaries. The
encoder's parts (``encode_chunk_parts``, written gathered by the store) join to exactly the
object ``encode_chunk`` builds, with the same ref."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.errors import FormatError
from kvpack.format import constants as C
from kvpack.format import decode_chunk, decode_pack
from kvpack.format.chunk import ONE_PASS_BLOCK, decode_chunk_one_pass, encode_chunk, encode_chunk_parts, schedule_for
from kvpack.format.fixtures import fixture_keys, reference_fixture, suites
from kvpack.format.objects import Span

PLAINTEXT_AT = C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES


def _outcome(fn, data, args):
    try:
        return ("ok", bytes(fn(data, **args)))
    except FormatError as exc:
        return ("refused", exc.category, str(exc))


def _both(data, args):
    return _outcome(decode_chunk, data, args), _outcome(decode_chunk_one_pass, data, args)


def _setup(combo):
    keys = fixture_keys()
    objs = dict(reference_fixture(*combo))
    manifest, _ = decode_pack(objs["pack"], keys)
    key, span, ref = next(manifest.chunk_refs())
    args = dict(ref=ref, span=span, tenant=manifest.tenant, family=manifest.family, key=key, keys=keys, family_digest=manifest.family.digest())
    return objs["chunk"], args, manifest


@pytest.mark.parametrize("combo", suites(), ids=lambda c: "/".join(c))
def test_every_fixture_chunk_gives_the_same_plaintext(combo):
    chunk, args, _manifest = _setup(combo)
    host, one_pass = _both(chunk, args)
    assert host[0] == "ok" and host == one_pass
    # and from a bytearray / memoryview (the host restore reads into reused buffers)
    assert _outcome(decode_chunk_one_pass, memoryview(bytearray(chunk)), args) == host


def test_wrong_ref_span_key_and_family_digest_refuse_identically():
    chunk, args, manifest = _setup(("raw", "plain", "plain"))
    ref, span = args["ref"], args["span"]
    variants = [
        dict(ref=dataclasses.replace(ref, object_digest=bytes(32))),
        dict(ref=dataclasses.replace(ref, content_id=bytes(32))),
        dict(ref=dataclasses.replace(ref, key_epoch=ref.key_epoch + 1)),
        dict(span=dataclasses.replace(span, token_start=span.token_start + 1)),
        dict(span=dataclasses.replace(span, token_count=0)),
        dict(tenant=bytes(32)),
        dict(family_digest=bytes(32)),
        dict(key=dataclasses.replace(args["key"], layer=args["key"].layer + 1)),
    ]
    for change in variants:
        host, one_pass = _both(chunk, {**args, **change})
        assert host[0] == "refused" and host == one_pass, change


@pytest.mark.slow
def test_every_truncation_and_bit_flip_refuses_identically():
    chunk, args, _manifest = _setup(("raw", "plain", "plain"))
    for length in range(len(chunk)):
        host, one_pass = _both(chunk[:length], args)
        assert host[0] == "refused" and host == one_pass, length
    buf = bytearray(chunk)
    for pos in range(len(chunk)):
        for bit in range(8):
            buf[pos] ^= 1 << bit
            host, one_pass = _both(bytes(buf), args)
            assert host[0] == "refused" and host == one_pass, (pos, bit)
            buf[pos] ^= 1 << bit


def _large_chunk(plaintext: bytes):
    """A raw plain chunk of ``plaintext`` (many one-pass blocks) under the fixture's keys."""
    keys = fixture_keys()
    objs = dict(reference_fixture("raw", "plain", "plain"))
    manifest, _ = decode_pack(objs["pack"], keys)
    key, span0, ref0 = next(manifest.chunk_refs())
    span = Span(span0.token_start, span0.token_count, span0.plaintext_offset, len(plaintext))
    ks = schedule_for(keys, ref0.key_epoch)
    fam = manifest.family.digest()
    chunk = encode_chunk(keys=ks, family_digest=fam, key=key, span=span, plaintext=plaintext, codec=C.CODEC_RAW)
    args = dict(ref=chunk.ref, span=span, tenant=manifest.tenant, family=manifest.family, key=key, keys=keys, family_digest=fam)
    return chunk, args, (ks, fam, key, span)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 3 * ONE_PASS_BLOCK + 5000),
    flip=st.one_of(st.none(), st.integers(0, 1 << 30)),
    seed=st.binary(min_size=1, max_size=64),
)
def test_multi_block_objects_verify_and_refuse_identically(n, flip, seed):
    plaintext = (seed * (n // len(seed) + 1))[:n]
    chunk, args, (ks, fam, key, span) = _large_chunk(plaintext)
    parts = encode_chunk_parts(keys=ks, family_digest=fam, key=key, span=span, plaintext=memoryview(plaintext), codec=C.CODEC_RAW)
    assert b"".join(parts.parts) == chunk.obj and parts.ref == chunk.ref
    data = bytearray(chunk.obj)
    if flip is not None:
        data[flip % len(data)] ^= 1 << (flip % 8)
    host, one_pass = _both(bytes(data), args)
    assert host == one_pass
    assert (host[0] == "ok") == (flip is None)
    if flip is None:
        assert host[1] == plaintext


@pytest.mark.parametrize("at", [PLAINTEXT_AT, PLAINTEXT_AT + ONE_PASS_BLOCK - 1, PLAINTEXT_AT + ONE_PASS_BLOCK, PLAINTEXT_AT + 2 * ONE_PASS_BLOCK + 1])
def test_flips_at_block_boundaries_are_content_or_digest_refusals(at):
    plaintext = bytes(range(256)) * (3 * ONE_PASS_BLOCK // 256)
    chunk, args, _ = _large_chunk(plaintext)
    data = bytearray(chunk.obj)
    data[at] ^= 1
    host, one_pass = _both(bytes(data), args)
    assert host[0] == "refused" and host == one_pass and host[1] == "authentication"
    # the object digest is right (a matching ref) but the content differs: step 11 refuses
    import hashlib

    args2 = {**args, "ref": dataclasses.replace(args["ref"], object_digest=hashlib.sha256(bytes(data)).digest())}
    host, one_pass = _both(bytes(data), args2)
    assert host[0] == "refused" and host == one_pass and "content id" in host[2]


@pytest.mark.parametrize("combo", [c for c in suites() if c[0] != "raw" or c[1] != "plain"], ids=lambda c: "/".join(c))
def test_parts_join_to_the_encoded_object(combo):
    keys = fixture_keys()
    objs = dict(reference_fixture(*combo))
    manifest, _ = decode_pack(objs["pack"], keys)
    key, span, ref = next(manifest.chunk_refs())
    plaintext = decode_chunk(objs["chunk"], ref=ref, span=span, tenant=manifest.tenant, family=manifest.family, key=key, keys=keys)
    ks = schedule_for(keys, ref.key_epoch)
    from kvpack.format.chunk import ChunkHeader

    h = ChunkHeader.parse(objs["chunk"])
    kw = dict(
        keys=ks,
        family_digest=manifest.family.digest(),
        key=key,
        span=span,
        plaintext=bytes(plaintext),
        codec=h.codec,
        encrypted=h.encrypted,
        salt=h.salt,
        nonce=h.nonce,
    )
    whole = encode_chunk(**kw)
    parts = encode_chunk_parts(**kw)
    assert b"".join(parts.parts) == whole.obj and parts.ref == whole.ref


@pytest.mark.parametrize("block", [0, 4096, 100_003, 1 << 20])
def test_any_block_size_verifies_and_refuses_identically(block):
    plaintext = bytes(range(256)) * (3 * ONE_PASS_BLOCK // 256) + b"tail"
    chunk, args, _ = _large_chunk(plaintext)
    sized = {**args, "block": block}
    assert _outcome(decode_chunk_one_pass, chunk.obj, sized) == _outcome(decode_chunk, chunk.obj, args) == ("ok", plaintext)
    for at in (0, PLAINTEXT_AT - 1, PLAINTEXT_AT + block, len(chunk.obj) - 1):
        data = bytearray(chunk.obj)
        data[at % len(data)] ^= 0x40
        assert _outcome(decode_chunk_one_pass, bytes(data), sized) == _outcome(decode_chunk, bytes(data), args)
