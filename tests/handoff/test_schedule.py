"""C.12 worked checks, C.13 sizes and the seed's byte arithmetic (Table 26.1, §26.2),
computed from the schedule; the literals are the published values."""

import json
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff.schedule import (
    MUSE,
    MUSE_NOPE_LAYERS,
    MUSE_SWA_LAYERS,
    class_bytes,
    dflash_schedule,
    first_tile_complete_after_tokens,
    full_attention_layout,
    muse_intents,
    muse_schedule_span,
    payload_bytes,
    schedule_span,
)


def test_constants():
    assert MUSE_NOPE_LAYERS == tuple(range(3, 52, 4)) and len(MUSE_NOPE_LAYERS) == 13
    assert len(MUSE_SWA_LAYERS) == 39
    groups = MUSE.classes[0].groups()
    # errata L6
    assert groups == [
        (0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16),
        (17, 18, 20, 21, 22, 24, 25, 26, 28, 29, 30, 32, 33),
        (34, 36, 37, 38, 40, 41, 42, 44, 45, 46, 48, 49, 50),
    ]
    assert {s.elements_per_token for s in muse_intents(4096)} == {256 * 26}


def test_full_tile_is_6815744_bytes():
    tile = [s for s in muse_intents(4096) if s.role == "nope_tile"][0]
    assert tile.logical_count == 512 and tile.byte_len == 6_815_744


def test_worked_check_2049():
    segs = muse_intents(2049)
    assert len(segs) == 20
    assert sum(s.role == "swa_tile" for s in segs) == 15
    assert sum(s.role == "nope_tile" for s in segs) == 5
    assert (segs[0].role, segs[0].logical_start, segs[0].logical_count) == ("swa_tile", 1, 511)
    assert [s.sequence for s in segs] == list(range(20))
    # Layer-major wire order: every SWA segment precedes every NoPE tile.
    roles = [s.role for s in segs]
    assert roles == ["swa_tile"] * 15 + ["nope_tile"] * 5


def test_worked_check_2049_1024():
    segs = muse_schedule_span(2049, 1024)
    nope = [s for s in segs if s.role == "nope_tile"]
    swa = [s for s in segs if s.role == "swa_tile"]
    assert (nope[0].logical_start, nope[0].logical_count) == (1024, 512)
    assert swa[0].logical_start == 1024
    assert [s.layer for s in swa] == [0, 0, 0, 17, 17, 17, 34, 34, 34]
    assert all(s.layer is None for s in nope)


def test_worked_check_4096_512():
    segs = muse_schedule_span(4096, 512)
    assert min(s.logical_start for s in segs if s.role == "swa_tile") == 2048
    assert sum(s.role == "nope_tile" for s in segs) == 7


def test_worked_check_257_256():
    segs = muse_schedule_span(257, 256)
    assert (segs[0].logical_start, segs[0].logical_count) == (256, 1)


def test_dflash_worked_check():
    segs = dflash_schedule(2113, layers=5, sink=64, window=2048, width=1024)
    assert len(segs) == 20
    assert {(s.logical_start, s.logical_count) for s in segs} == {(0, 64), (65, 2048)}
    assert all(s.element_type == "f32_le" and s.component_id == "dflash" for s in segs)
    assert dflash_schedule(2112, layers=1, sink=64, window=2048, width=8)[0].logical_count == 2112


@pytest.mark.parametrize("position", [1, 255, 256, 511, 512, 513, 2047, 2048, 2049, 4096, 10_000])
def test_cut_zero_is_full_schedule(position):
    assert muse_schedule_span(position, 0) == muse_intents(position)


def test_first_tile_complete():
    assert first_tile_complete_after_tokens(MUSE, 2049, 1024) == 1536
    assert first_tile_complete_after_tokens(MUSE, 300, 256) == 300


def _per_class(position, cut=0):
    return class_bytes(muse_schedule_span(position, cut))


def test_seed_table_26_1():
    # 65,536-token prompt, boundary token held back -> 65,535 rows.
    per_token = 13 * 2 * 256 * 2  # 13 layers x K,V x 256 elements x 2 bytes = 13,312
    full = _per_class(65_535)
    assert full["nope"] == 65_535 * per_token == 872_401_920
    assert full["swa"] == 2_048 * 39 * 1_024 == 81_788_928
    assert sum(full.values()) == 954_190_848
    prefix = _per_class(32_768)  # 32,769-token prompt held back -> 32,768 rows
    assert prefix == {"nope": 436_207_616, "swa": 81_788_928}
    assert sum(prefix.values()) == 517_996_544
    delta = _per_class(65_535, 32_768)
    assert delta == {"nope": 436_194_304, "swa": 81_788_928}
    assert sum(delta.values()) == 517_983_232
    share = sum(delta.values()) / sum(full.values())
    assert round(share * 100, 4) == 54.2851
    # "a delta is not a subtraction": it exceeds full - prefix by exactly one SWA window.
    assert sum(delta.values()) - (sum(full.values()) - sum(prefix.values())) == 81_788_928


def test_seed_shallow_cell():
    # 2,048-token prompt holding 1,024: position 2,047, cut 1,024.
    share = payload_bytes(muse_schedule_span(2_047, 1_024)) / payload_bytes(muse_intents(2_047))
    assert round(share * 100, 2) == 49.98
    # The suffix fits inside the window: SWA ships exactly the suffix rows.
    assert _per_class(2_047, 1_024)["swa"] == 1_023 * 39 * 1_024


@pytest.mark.parametrize("position,cut", [(0, 0), (10, 10), (300, 100), (300, 512), (256, 256), (10, -256)])
def test_invalid_cuts_refused(position, cut):
    with pytest.raises(ProtocolError) as e:
        muse_schedule_span(position, cut)
    assert e.value.category in ("delta", "manifest")


@given(st.integers(1, 20_000), st.integers(0, 80))
def test_schedule_covers_exactly_the_span(position, k):
    cut = min(k * 256, ((position - 1) // 256) * 256)
    segs = muse_schedule_span(position, cut)
    swa_start = max(cut, position - 2048)
    for role, layers, start in (("nope_tile", [None], cut), ("swa_tile", [0, 17, 34], swa_start)):
        for layer in layers:
            ranges = [(s.logical_start, s.logical_count) for s in segs if s.role == role and s.layer == layer]
            # Contiguous, ascending, covering [start, position).
            pos = start
            for s, n in ranges:
                assert s == pos and n > 0
                pos += n
            assert pos == position
            # Never crossing a tile boundary of the grid anchored at cut.
            assert all((s - cut) // 512 == (s + n - 1 - cut) // 512 for s, n in ranges)


def test_generic_one_class_layout():
    smol = full_attention_layout("smol", 30, 3 * 64)
    segs = schedule_span(smol, 1000, 256)
    assert [(s.logical_start, s.logical_count) for s in segs] == [(256, 512), (768, 232)]
    assert all(s.elements_per_token == 3 * 64 * 2 * 30 and s.layer is None for s in segs)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvpack.cli", "schedule", *args], capture_output=True, text=True, check=False)


def test_cli_json():
    p = _cli("--preset", "muse", "--position", "65535", "--cut", "32768", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["payload_bytes"] == 517_983_232
    assert out["nope_bytes"] == 436_194_304 and out["swa_bytes"] == 81_788_928
    assert len(out["segments"]) == out["segment_count"]
    assert out["segments"][0]["sequence"] == 0


def test_cli_table_and_refusal():
    p = _cli("--position", "2049")
    assert p.returncode == 0 and "segments 20" in p.stdout
    p = _cli("--position", "300", "--cut", "100")
    assert p.returncode == 1 and p.stderr.startswith("kvpack: delta:")
