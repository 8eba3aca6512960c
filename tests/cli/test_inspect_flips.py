"""``kvpack inspect`` and single-bit damage: a flip that any keyless check can see is refused;
a flip it cannot see lies inside what inspect itself reports as not verified (a pack's footer
HMAC, an encrypted manifest body, a chunk's payload), and ``kvpack verify`` with the root key
refuses every flip of a pack.

The sweep flips one bit of every byte through ``describe`` (what inspect runs); a sample of
offsets goes through the CLI to check exit codes and the error line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpack.errors import FormatError
from kvpack.format import constants as C
from kvpack.format.describe import describe

from .conftest import check_contract, run_cli, write_secret

FIXTURE_ROOT = bytes([99]) * 32  # the production-v1 vectors' root (tests/format/test_cli.py)
OBJECTS = [
    "fixture/raw/plain/plain/pack",
    "fixture/lossless/encrypted/encrypted/pack",
    "fixture/raw/plain/plain/chunk",
    "fixture/lossless/encrypted/encrypted/chunk",
]


def _unverified_ranges(data: bytes) -> list[range]:
    """Byte ranges inspect declares not verified without a key (from the object itself)."""
    if data[:8] == C.MAGIC_PACK:
        footer = len(data) - C.HEADER_BYTES
        ranges = [range(footer + 80, footer + 112)]  # the footer HMAC
        if describe(data).get("encrypted"):
            ranges.append(range(C.HEADER_BYTES, footer))  # the sealed manifest
        return ranges
    stored = describe(data)["stored_bytes"]
    return [range(C.HEADER_BYTES, C.HEADER_BYTES + stored)]  # the chunk payload


def _flipped(data: bytes, offset: int) -> bytes:
    b = bytearray(data)
    b[offset] ^= 0x01
    return bytes(b)


@pytest.mark.parametrize("name", OBJECTS)
def test_every_keyless_detectable_flip_is_refused(world, name):
    data = Path(world.objects, name).read_bytes()
    info = describe(data)
    assert info["verified"] is False and info["unverified"]
    blind = _unverified_ranges(data)
    passed = []
    for offset in range(len(data)):
        try:
            describe(_flipped(data, offset))
        except FormatError:
            continue
        passed.append(offset)
    outside = [o for o in passed if not any(o in r for r in blind)]
    assert not outside, f"flips at {outside[:10]} pass inspect but lie outside what it reports as unverified"
    # what is blind without a key is exactly what inspect names, nothing more
    assert len(passed) == sum(len(r) for r in blind)


@pytest.mark.parametrize("name", [n for n in OBJECTS if n.endswith("pack")])
def test_verify_with_the_key_refuses_every_flip_of_a_pack(world, name):
    data = Path(world.objects, name).read_bytes()
    assert describe(data, root=FIXTURE_ROOT)["verified"] is True
    for offset in range(len(data)):
        with pytest.raises(FormatError):
            describe(_flipped(data, offset), root=FIXTURE_ROOT)


def test_cli_exit_codes_on_flips(world, tmp_path):
    key = write_secret(tmp_path / "fixture.key", FIXTURE_ROOT)
    data = Path(world.objects, "fixture/raw/plain/plain/pack").read_bytes()
    footer = len(data) - C.HEADER_BYTES
    bad = tmp_path / "bad.pack"
    # header digest region, a manifest body byte, the commit footer's stored size: refused keyless
    for offset in (40, 100, C.HEADER_BYTES + 17, footer + 24):
        bad.write_bytes(_flipped(data, offset))
        check_contract(run_cli(["inspect", str(bad)]), 1, context=f"offset {offset}")
    # the footer HMAC: keyless inspect says so; the key refuses it
    bad.write_bytes(_flipped(data, footer + 90))
    r = run_cli(["inspect", str(bad)])
    check_contract(r, 0)
    assert r.out.startswith("structure ok, not verified: footer HMAC (needs the root key)")
    check_contract(run_cli(["inspect", str(bad), "--root-key-file", key]), 1, "authentication")
    check_contract(run_cli(["verify", str(bad), "--root-key-file", key]), 1, "authentication")
    r = run_cli(["inspect", str(Path(world.objects, "fixture/raw/plain/plain/pack")), "--root-key-file", key])
    check_contract(r, 0)
    assert r.out.startswith("verified: every check passed under the root key")
