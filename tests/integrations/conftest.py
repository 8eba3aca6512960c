"""Fixtures for the vLLM connector tests: the SmolLM2 checkpoint, the prompts, and the
reference tokens of a vLLM engine *without* any connector (one engine per test session).

Engines run in subprocesses (kvpack.testing.vllm_harness), single-process vLLM unless a test
says otherwise: vLLM loads in about a minute on 2 cores, so every test module starts as few
as it can and starts independent ones side by side, each bound to its own core (one OpenMP
thread, set explicitly: with a connector vLLM's automatic binding would reserve both cores).
"""

from __future__ import annotations

import os

import pytest

from kvpack.testing.vllm_harness import Engine, vllm_python

MAX_TOKENS = 32


def engine_config(model: str, connector: str | None = None, **kw) -> dict:
    cfg = {"model": model, "dtype": "float32", "max_model_len": 4096, "kv_cache_bytes": 192 << 20, "connector": connector}
    cfg.update(kw)
    return cfg


def start(cfg: dict, log_dir, name: str, core: int) -> Engine:
    return Engine(cfg, os.path.join(str(log_dir), f"{name}.log"), core=core).start()


@pytest.fixture(scope="session")
def vllm_py() -> str:
    py = vllm_python()
    if py is None:
        pytest.skip("vLLM is not installed (scripts/install.sh installs it; or set KVPACK_VLLM_PYTHON)")
    return py


@pytest.fixture(scope="session")
def smollm2_dir(vllm_py) -> str:
    from kvpack.engine.models import load_smollm2

    return load_smollm2().source["cache_dir"]


@pytest.fixture(scope="session")
def prompts(smollm2_dir) -> dict[str, list[int]]:
    """A: ~1,000 tokens; B: A's first 512 tokens, then other text (partial hit); D: for the
    disaggregated prefill tests (~700 tokens, its own text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)

    def text(n: int, topic: str) -> list[int]:
        body, i = "", 0
        while True:
            body += f"Note {i} on {topic}: a KV cache holds the keys and values attention computed for each token of the context. "
            i += 1
            ids = tok(body)["input_ids"]
            if len(ids) >= n:
                return list(ids[:n])

    a = text(1000, "prefix reuse")
    b = a[:512] + text(600, "something else entirely")
    d = text(700, "disaggregated prefill")
    return {"A": a, "B": b, "D": d}


class Reference:
    """Greedy tokens of every prompt from a vLLM engine with no connector at all.

    The engine starts booting when the fixture is created; the tokens are computed at the
    first lookup, so the modules' own engines boot side by side with it (pytest creates
    session fixtures before module ones)."""

    def __init__(self, engine: Engine, prompts: dict[str, list[int]]) -> None:
        self.engine, self.prompts = engine, prompts
        self._tokens: dict[str, list[int]] | None = None

    @property
    def done(self) -> bool:
        """The tokens are computed and the engine is stopping (its core is free)."""
        return self._tokens is not None

    def __getitem__(self, name: str) -> list[int]:
        if self._tokens is None:
            names = sorted(self.prompts)
            out = self.engine.generate([self.prompts[k] for k in names], max_tokens=MAX_TOKENS)
            self.engine.request_stop()  # its memory and core go to the next engines (teardown waits)
            self._tokens = {k: r["tokens"] for k, r in zip(names, out)}
        return self._tokens[name]


@pytest.fixture(scope="session")
def reference(vllm_py, smollm2_dir, prompts, tmp_path_factory):
    eng = start(engine_config(smollm2_dir), tmp_path_factory.mktemp("vllm-reference"), "reference", core=1)
    yield Reference(eng, prompts)
    eng.stop()
