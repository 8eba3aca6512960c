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


def llama_engine(dtype: str = "f32", device: str = "cpu", **kw) -> TransformersEngine:
    loaded = build_llama(seed=0, **kw)
    loaded.model = loaded.model.to(DTYPES[dtype])
    return TransformersEngine(loaded, threads=2, prefill_chunk_tokens=128, device=device)


def cohere2_engine(device: str = "cpu") -> TransformersEngine:
    return TransformersEngine(build_cohere2(seed=0, num_hidden_layers=8, sliding_window=24), threads=2, prefill_chunk_tokens=64, device=device)
