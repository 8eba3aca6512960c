"""Fixtures for the CUDA-path tests. The logic tests run on the CPU (the helpers in
kvpack.engine.cuda work on CPU tensors too); tests marked ``cuda`` skip without a device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.models import build_cohere2, build_llama  # noqa: E402
from kvpack.engine.transformers_adapter import TransformersEngine  # noqa: E402

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def random_tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def assert_same_session(a, b) -> None:
    """Two sessions hold the same cut bit for bit: tokens, every layer's K/V rows, the
    logits row (float32) and the cache digest."""
    assert a.position == b.position and a.tokens == b.tokens
    for index, (la, lb) in enumerate(zip(a.cache.layers, b.cache.layers)):
        assert la.get_seq_length() == lb.get_seq_length() == a.position, f"layer {index} rows"
        assert torch.equal(la.keys, lb.keys), f"layer {index} k"
        assert torch.equal(la.values, lb.values), f"layer {index} v"
    assert a.last_logits.dtype == b.last_logits.dtype == torch.float32
    assert torch.equal(a.last_logits, b.last_logits)
    assert a.cache_digest() == b.cache_digest()


def llama_engine(dtype: str = "f32", device: str = "cpu", **kw) -> TransformersEngine:
    loaded = build_llama(seed=0, **kw)
    loaded.model = loaded.model.to(DTYPES[dtype])
    return TransformersEngine(loaded, threads=2, prefill_chunk_tokens=128, device=device)


def cohere2_engine(device: str = "cpu") -> TransformersEngine:
    return TransformersEngine(build_cohere2(seed=0, num_hidden_layers=8, sliding_window=24), threads=2, prefill_chunk_tokens=64, device=device)
