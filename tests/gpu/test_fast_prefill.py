"""The lower-right chunked prefill (kvpack.engine.fast_prefill, ``prefill_attention``).

Bit-exactness is the contract: a session restored at a 256-aligned cut and continued
computes exactly what an uninterrupted prefill computes, through the store too. On the CPU
the path is forced (``prefill_attention="lower_right"``; the default there stays transformers'
own); on CUDA it is the default and the same checks run on the device."""

from __future__ import annotations

import os

import pytest

from kvpack.engine import fast_prefill
from kvpack.engine.models import build_cohere2, build_llama
from kvpack.engine.transformers_adapter import TransformersEngine, transfer_cut
from kvpack.errors import EngineError
from kvpack.store import PackStore

from .conftest import DTYPES, random_tokens, requires_cuda

torch = pytest.importorskip("torch")


def _engine(dtype="f32", device="cpu", mode="lower_right") -> TransformersEngine:
    loaded = build_llama(seed=0)
    loaded.model = loaded.model.to(DTYPES[dtype])
    return TransformersEngine(loaded, threads=2, prefill_chunk_tokens=128, device=device, prefill_attention=mode)


@pytest.fixture(scope="module")
def fast():
    return _engine()


def test_restored_then_continued_equals_uninterrupted(fast):
    tokens = random_tokens(700, fast.layout.vocab_size)
    whole = fast.new_session()
    whole.prefill(tokens)
    assert type(whole.cache.layers[0]).__name__ == "PreallocatedLayer"
    part = fast.new_session()
    part.prefill(tokens[:256])
    resumed = fast.new_session()
    transfer_cut(part, resumed)
    resumed.prefill(tokens[256:])
    assert resumed.cache_digest() == whole.cache_digest()
    assert torch.equal(resumed.last_logits, whole.last_logits)
    # decode grows the preallocated rows past the prompt's reservation, on both sides alike
    assert resumed.decode_greedy(300)[0] == whole.decode_greedy(300)[0]
    assert resumed.cache_digest() == whole.cache_digest()


def test_store_round_trip_continues_bit_exactly(fast, tmp_path):
    tokens = random_tokens(640, fast.layout.vocab_size, seed=4)
    live = fast.new_session()
    live.prefill(tokens[:512])
    store = PackStore.init(os.path.join(tmp_path, "s"), chunk_bytes=4096)
    store.save(live)
    restored = fast.new_session()
    store.restore(store.find_deepest(tokens, fast.layout, fast.ids()), restored, tokens)
    assert restored.cache_digest() == live.cache_digest()
    live.prefill(tokens[512:])
    restored.prefill(tokens[512:])
    assert restored.cache_digest() == live.cache_digest()
    assert restored.decode_greedy(5)[0] == live.decode_greedy(5)[0]


def test_lower_right_attention_computes_causal_attention():
    """Same model, both prefill paths: the same function up to rounding (on the CPU in f32
    both reach the same kernel, so the bytes agree too)."""
    tokens = random_tokens(600, 512, seed=9)
    rows = {}
    for mode in ("sdpa", "lower_right"):
        eng = _engine(mode=mode)
        s = eng.new_session()
        s.prefill(tokens)
        rows[mode] = (s.last_logits, s._plane(2, "v")[0].clone())
    assert torch.allclose(rows["sdpa"][0], rows["lower_right"][0], atol=1e-5)
    assert torch.allclose(rows["sdpa"][1], rows["lower_right"][1], atol=1e-5)


def test_the_prefill_path_is_part_of_the_identity():
    fast, plain = _engine(), _engine(mode="sdpa")
    assert fast.identity.engine_abi["prefill"].startswith("kvpack lower-right")
    assert "prefill" not in plain.identity.engine_abi
    assert fast.ids() != plain.ids()
    with pytest.raises(EngineError):
        plain.check_identity(fast.identity)


def test_unsupported_models_and_values_are_refused():
    loaded = build_cohere2(seed=0, num_hidden_layers=4, sliding_window=24)
    assert fast_prefill.unsupported_reason(loaded.model) is not None
    with pytest.raises(EngineError) as exc:
        TransformersEngine(loaded, threads=2, prefill_chunk_tokens=64, prefill_attention="lower_right")
    assert exc.value.category == "unsupported"
    auto = TransformersEngine(loaded, threads=2, prefill_chunk_tokens=64)  # auto on CPU: transformers' path
    assert auto.prefill_attention == "sdpa"
    with pytest.raises(EngineError):
        TransformersEngine(build_llama(seed=0), threads=2, prefill_attention="fast")


@requires_cuda
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_cuda_default_restores_and_continues_bit_exactly(dtype, tmp_path):
    eng = _engine(dtype, device="cuda", mode="auto")
    assert eng.prefill_attention == "lower_right"
    tokens = random_tokens(900, eng.layout.vocab_size, seed=2)
    whole = eng.new_session()
    whole.prefill(tokens)
    part = eng.new_session()
    part.prefill(tokens[:512])
    store = PackStore.init(os.path.join(tmp_path, "s"), chunk_bytes=4096)
    store.save(part)
    resumed = eng.new_session()
    store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), resumed, tokens)
    resumed.prefill(tokens[512:])
    assert resumed.cache_digest() == whole.cache_digest()
    assert torch.equal(resumed.last_logits, whole.last_logits)
    assert resumed.decode_greedy(8)[0] == whole.decode_greedy(8)[0]


@requires_cuda
def test_cuda_lower_right_matches_sdpa_numerically():
    tokens = random_tokens(800, 512, seed=6)
    rows = {}
    for mode in ("sdpa", "lower_right"):
        eng = _engine("f16", device="cuda", mode=mode)
        s = eng.new_session()
        s.prefill(tokens)
        rows[mode] = s.last_logits.float().cpu()
    assert torch.allclose(rows["sdpa"], rows["lower_right"], atol=2e-2, rtol=2e-2)
