"""muse-tiny: the seed's Muse cache layout on a real (random, seeded) Cohere2 model in f16.

* the layout is exactly Muse's: 52 layers, 13 full-attention NoPE layers 3, 7, ..., 51,
  39 sliding-window RoPE layers holding 2,048 rows, 2 KV heads x 128, f16;
* the model digest is the SHA-256 of the weights file, pinned and verified on load (a
  damaged file is regenerated, never loaded);
* f16 compute on the CPU is deterministic, and decoding from a restored cut above the
  window is bit-identical (tokens and every logits row) to decoding without the round trip.
"""

from __future__ import annotations

import hashlib
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.muse import MUSE_TINY_WEIGHTS_SHA256, WEIGHTS_FILE, load_muse_tiny  # noqa: E402
from kvpack.engine.registry import load_engine  # noqa: E402
from kvpack.engine.transformers_adapter import transfer_cut  # noqa: E402

ABOVE_WINDOW = 2100


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def muse():
    return load_engine("muse-tiny")


@pytest.fixture(scope="module")
def deep(muse):
    s = muse.new_session()
    s.prefill(tokens(ABOVE_WINDOW, seed=11))
    return s


def test_layout_is_the_seed_muse_layout(muse):
    layout = muse.layout
    assert layout.num_layers == 52
    full = [s for s in layout.layers if s.kind == "full"]
    windowed = [s for s in layout.layers if s.kind == "windowed"]
    assert [s.index for s in full] == list(range(3, 52, 4)) and len(windowed) == 39
    assert {s.position for s in full} == {"nope"} and {s.position for s in windowed} == {"rope"}
    assert {(s.window_tokens, s.attention_window) for s in windowed} == {(2048, 2049)}
    assert {(s.kv_heads, s.head_dim, s.dtype) for s in layout.layers} == {(2, 128, "f16")}
    assert muse.identity.weights_digest == MUSE_TINY_WEIGHTS_SHA256
    assert muse.identity.engine_abi["compute_dtype"] == "float16" and muse.threads == 1


def test_weights_file_is_pinned_and_a_damaged_file_is_regenerated(tmp_path):
    loaded = load_muse_tiny(cache_dir=str(tmp_path))
    path = loaded.source["weights_file"]
    assert os.path.basename(path) == WEIGHTS_FILE
    with open(path, "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == MUSE_TINY_WEIGHTS_SHA256 == loaded.weights_digest
    with open(path, "r+b") as fh:  # one flipped byte in the middle of a tensor
        fh.seek(os.path.getsize(path) // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x40]))
    again = load_muse_tiny(cache_dir=str(tmp_path))
    with open(path, "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == MUSE_TINY_WEIGHTS_SHA256
    sd_a, sd_b = loaded.model.state_dict(), again.model.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


def test_windowed_layers_hold_exactly_the_ring(muse, deep):
    assert deep.retained_range(0) == (ABOVE_WINDOW - 2048, ABOVE_WINDOW)
    assert deep.retained_range(3) == (0, ABOVE_WINDOW)
    assert deep.cache.layers[0].keys.dtype == torch.float16


def test_f16_decode_after_a_restore_above_the_window_is_bit_identical(muse, deep):
    restored = muse.new_session()
    transfer_cut(deep, restored)
    assert restored.cache_digest() == deep.cache_digest()
    twin = muse.new_session()  # the same computation from scratch: f16 on the CPU is deterministic
    twin.prefill(deep.tokens)
    assert torch.equal(twin.last_logits, deep.last_logits)
    out_a, rows_a = deep.decode_greedy(12)
    out_b, rows_b = restored.decode_greedy(12)
    assert out_a == out_b and len(set(out_a)) > 1  # a model that does not repeat one token
    assert all(torch.equal(a, b) for a, b in zip(rows_a, rows_b))


def test_a_flipped_window_row_breaks_the_comparison(muse):
    """Control: the comparison above can fail (one sign bit in one restored SWA row)."""
    src = muse.new_session()
    src.prefill(tokens(300, seed=12))
    dst = muse.new_session()
    install = dst.begin_install(src.position, src.tokens, muse.identity)
    for layer, role in src.layout.states():
        lo, hi = install.required_range(layer)
        rows = bytearray(src.export_rows(layer, role, lo, hi))
        if (layer, role) == (0, "k"):
            rows[-1] ^= 0x80  # sign bit of the last f16 of the newest row
        install.write_rows(layer, role, lo, rows)
    install.write_logits(src.export_logits())
    install.commit()
    _, rows_a = src.decode_greedy(4)
    _, rows_b = dst.decode_greedy(4)
    assert not all(torch.equal(a, b) for a, b in zip(rows_a, rows_b))
