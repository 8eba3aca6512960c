"""Fixtures for the engine tests: real engines over the random geometry models and SmolLM2.

Engines are module- or session-scoped because building them is the slow part; every test
creates its own sessions, so no state leaks between tests. Two threads everywhere: the
thread count is part of the computation order (and of the engine identity).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.models import build_cohere2, build_llama, load_smollm2  # noqa: E402
from kvpack.engine.transformers_adapter import TransformersEngine  # noqa: E402

THREADS = 2
COHERE2_WINDOW = 24


def random_tokens(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def cohere2_engine() -> TransformersEngine:
    # chunk 64 > window 24: chunks overlap the window boundary both ways.
    return TransformersEngine(build_cohere2(seed=0, num_hidden_layers=8, sliding_window=COHERE2_WINDOW), threads=THREADS, prefill_chunk_tokens=64)


@pytest.fixture(scope="module")
def llama_engine() -> TransformersEngine:
    return TransformersEngine(build_llama(seed=0), threads=THREADS, prefill_chunk_tokens=128)


@pytest.fixture(scope="session")
def smollm2_engine() -> TransformersEngine:
    return TransformersEngine(load_smollm2(), threads=THREADS, prefill_chunk_tokens=256)
