"""Exhaustive damage: every truncation length and every single-bit flip of the fixture chunk and
pack, in all eight suites, must be refused with a typed FormatError (never accepted, never
another exception)."""

from __future__ import annotations

import pytest

from kvpack.errors import FormatError
from kvpack.format import decode_chunk, decode_pack
from kvpack.format.fixtures import fixture_keys, reference_fixture, suites

pytestmark = pytest.mark.slow


def _chunk_decoder(objs, keys):
    manifest, _ = decode_pack(objs["pack"], keys)
    key, span, ref = next(manifest.chunk_refs())
    family = manifest.family
    digest = family.digest()

    def decode(data: bytes):
        return decode_chunk(data, ref=ref, span=span, tenant=manifest.tenant, family=family, key=key, keys=keys, family_digest=digest)

    return decode


def _damage_counts(original: bytes, decode) -> tuple[int, int, dict]:
    categories: dict[str, int] = {}
    truncations = flips = 0
    for length in range(len(original)):
        try:
            decode(original[:length])
        except FormatError as exc:
            categories[exc.category] = categories.get(exc.category, 0) + 1
        else:
            raise AssertionError(f"truncation to {length} accepted")
        truncations += 1
    buf = bytearray(original)
    for pos in range(len(original)):
        for bit in range(8):
            buf[pos] ^= 1 << bit
            try:
                decode(bytes(buf))
            except FormatError as exc:
                categories[exc.category] = categories.get(exc.category, 0) + 1
            else:
                raise AssertionError(f"bit flip at byte {pos} bit {bit} accepted")
            buf[pos] ^= 1 << bit
            flips += 1
    return truncations, flips, categories


@pytest.mark.parametrize("combo", list(suites()), ids=lambda c: "/".join(c))
def test_every_truncation_and_bit_flip_is_refused(combo):
    keys = fixture_keys()
    objs = dict(reference_fixture(*combo))
    chunk_decode = _chunk_decoder(objs, keys)
    chunk_decode(objs["chunk"])  # the undamaged object verifies
    t1, f1, cats1 = _damage_counts(objs["chunk"], chunk_decode)
    t2, f2, cats2 = _damage_counts(objs["pack"], lambda d: decode_pack(d, keys))
    assert t1 == len(objs["chunk"]) and f1 == 8 * len(objs["chunk"])
    assert t2 == len(objs["pack"]) and f2 == 8 * len(objs["pack"])
    # damage is caught by the right layers, not one catch-all
    assert {"bounds", "authentication", "reserved"} <= set(cats1)
    assert {"truncated", "bad_magic", "checksum", "authentication"} <= set(cats2)
