"""Deferred chunk verification (the GPU restore's host half) refuses exactly as decode_chunk.

``decode_chunk_deferred`` runs every A.5 check except the object SHA-256 and the content-ID
HMAC; ``DeferredChunk.finish`` takes those two digests, computed elsewhere over the same
bytes. For every truncation and every single-bit flip of the raw plain fixture chunk, the
two halves together must give exactly what ``decode_chunk`` gives: the same FormatError
(category and message), or the same plaintext. Chunks the deferred path does not take
(encrypted, lossless) are refused by ``deferrable``, and a wrong external digest is refused
at the step it belongs to."""

from __future__ import annotations

import hashlib

import pytest

from kvpack.errors import FormatError
from kvpack.format import constants as C
from kvpack.format import decode_chunk, decode_pack
from kvpack.format.chunk import ExternalDigests, decode_chunk_deferred, deferrable, schedule_for
from kvpack.format.fixtures import fixture_keys, reference_fixture, suites
from kvpack.format.identity import chunk_content_prefix, hmac_sha256_finish, hmac_sha256_pads

PLAINTEXT_AT = C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES


def _setup(combo):
    keys = fixture_keys()
    objs = dict(reference_fixture(*combo))
    manifest, _ = decode_pack(objs["pack"], keys)
    key, span, ref = next(manifest.chunk_refs())
    args = dict(ref=ref, span=span, tenant=manifest.tenant, family=manifest.family, key=key, keys=keys, family_digest=manifest.family.digest())
    inner, outer = hmac_sha256_pads(schedule_for(keys, ref.key_epoch).chunk_identity)
    head = inner + chunk_content_prefix(
        manifest.tenant, args["family_digest"], key.layer, key.name, span.token_start, span.token_count, span.plaintext_offset, span.plaintext_bytes
    )

    def external(data: bytes) -> ExternalDigests:
        """What the GPU computes: SHA-256 of the object, and the HMAC over the bytes where a
        raw frame's plaintext sits (for the ref's plaintext length)."""
        body = data[PLAINTEXT_AT : PLAINTEXT_AT + span.plaintext_bytes]
        return ExternalDigests(hashlib.sha256(data).digest(), hmac_sha256_finish(outer, hashlib.sha256(head + body).digest()))

    def both(data: bytes):
        outcomes = []
        for path in ("host", "deferred"):
            try:
                if path == "host" or not deferrable(data):
                    out = decode_chunk(data, **args)
                else:
                    out = decode_chunk_deferred(data, **args).finish(external(data))
                outcomes.append(("ok", bytes(out)))
            except FormatError as exc:
                outcomes.append(("refused", exc.category, str(exc)))
        return outcomes

    return objs["chunk"], both, args, external


def test_deferred_accepts_the_fixture_and_gives_the_same_plaintext():
    chunk, both, args, external = _setup(("raw", "plain", "plain"))
    host, deferred = both(chunk)
    assert host[0] == "ok" and host == deferred
    d = decode_chunk_deferred(chunk, **args)
    good = external(chunk)
    with pytest.raises(FormatError, match="object digest"):
        d.finish(ExternalDigests(bytes(32), good.content_id))
    with pytest.raises(FormatError, match="content id"):
        d.finish(ExternalDigests(good.object_digest, bytes(32)))


@pytest.mark.parametrize("combo", [c for c in suites() if c[0] != "raw" or c[1] != "plain"], ids=lambda c: "/".join(c))
def test_other_codecs_and_encrypted_chunks_are_not_deferrable(combo):
    chunk, _both, args, _external = _setup(combo)
    assert not deferrable(chunk)
    with pytest.raises(ValueError):
        decode_chunk_deferred(chunk, **args)


@pytest.mark.slow
def test_every_truncation_and_bit_flip_refuses_identically():
    chunk, both, _args, _external = _setup(("raw", "plain", "plain"))
    for length in range(len(chunk)):
        host, deferred = both(chunk[:length])
        assert host[0] == "refused" and host == deferred, length
    buf = bytearray(chunk)
    for pos in range(len(chunk)):
        for bit in range(8):
            buf[pos] ^= 1 << bit
            host, deferred = both(bytes(buf))
            assert host[0] == "refused" and host == deferred, (pos, bit)
            buf[pos] ^= 1 << bit
