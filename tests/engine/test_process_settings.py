"""Engines of different process-wide settings (torch's thread count; on CUDA the GEMM
library) in one process: each forward computes under its own engine's settings, even with
both engines forwarding at once in two threads (the settings are global, and an engine's
identity records them). Same-settings engines still forward concurrently; a thread that
nests a forward of other settings inside its own is refused, not deadlocked."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine import transformers_adapter  # noqa: E402
from kvpack.engine.models import build_llama  # noqa: E402
from kvpack.engine.transformers_adapter import TransformersEngine  # noqa: E402
from kvpack.errors import EngineError  # noqa: E402


def _engine(threads: int) -> TransformersEngine:
    loaded = build_llama(seed=0, num_hidden_layers=4, max_position_embeddings=4096)
    return TransformersEngine(loaded, threads=threads, prefill_chunk_tokens=64, prefill_attention="lower_right", prefill_forward="model")


def test_a_forward_holds_its_engines_settings_and_waits_for_other_settings():
    """Every layer of a forward runs while the process holds this engine's settings; while an
    engine of other settings (here another GEMM library) is mid-forward, this one waits, then
    computes the same bits as alone. (On CPU builds with OpenMP, torch's thread count is
    per thread; the CUDA GEMM library is global to the process: the race this prevents.)"""
    eng = _engine(2)
    tokens = [(7 * i) % 500 + 3 for i in range(64 * 6)]
    alone = eng.new_session()
    alone.prefill(tokens)
    held_during: list[tuple] = []
    for layer in eng.model.model.layers:
        layer.register_forward_pre_hook(
            lambda _m, _a: held_during.append((transformers_adapter.PROCESS_SETTINGS._key, transformers_adapter.PROCESS_SETTINGS._active))
        )
    other_inside, other_done = threading.Event(), threading.Event()

    def other_engine_forward() -> None:
        with transformers_adapter.PROCESS_SETTINGS.hold((2, "cublas"), lambda: None):
            other_inside.set()
            assert other_done.wait(30)

    other = threading.Thread(target=other_engine_forward)
    other.start()
    assert other_inside.wait(10)
    session = eng.new_session()
    worker = threading.Thread(target=session.prefill, args=(tokens,))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and not held_during  # waiting: no layer ran under the other's settings
    other_done.set()
    other.join(10)
    worker.join(120)
    assert not worker.is_alive() and session.position == len(tokens)
    assert held_during and all(key == (eng.threads, eng.cuda_blas) and active >= 1 for key, active in held_during)
    assert session.cache_digest() == alone.cache_digest()


def test_same_settings_forward_concurrently_and_nesting_other_settings_is_refused():
    settings = transformers_adapter._ProcessSettings()
    inside = threading.Event()
    release = threading.Event()
    entered: list[str] = []

    def hold(name: str, key: tuple) -> None:
        with settings.hold(key, lambda: None):
            entered.append(name)
            inside.set()
            assert release.wait(10)

    first = threading.Thread(target=hold, args=("a", (2, None)))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=hold, args=("b", (2, None)))
    second.start()
    second_in = [False]
    for _ in range(100):  # the same settings: the second enters while the first holds
        if "b" in entered:
            second_in[0] = True
            break
        threading.Event().wait(0.02)
    other = threading.Thread(target=hold, args=("c", (1, None)))
    other.start()
    threading.Event().wait(0.2)
    assert second_in[0] and "c" not in entered  # other settings wait for both
    release.set()
    for t in (first, second, other):
        t.join(10)
    assert entered[-1] == "c"

    with settings.hold((2, None), lambda: None):
        with settings.hold((2, None), lambda: None):  # the same engine nested: fine
            pass
        with pytest.raises(EngineError) as refused:
            with settings.hold((1, None), lambda: None):
                pass
    assert refused.value.category == "unsupported"
    with settings.hold((1, None), lambda: None):  # nothing was left held
        pass


def test_a_waiting_engine_is_not_starved_by_a_stream_of_the_held_settings():
    """While an engine of other settings waits, new forwards of the held settings queue
    behind it: it runs as soon as the forwards in progress end."""
    settings = transformers_adapter._ProcessSettings()
    order: list[str] = []
    gates = {name: threading.Event() for name in ("a", "b", "c")}
    inside = {name: threading.Event() for name in ("a", "b", "c")}

    def forward(name: str, key: tuple) -> None:
        with settings.hold(key, lambda: None):
            order.append(name)
            inside[name].set()
            assert gates[name].wait(10)

    a = threading.Thread(target=forward, args=("a", (2, None)))
    a.start()
    assert inside["a"].wait(10)
    b = threading.Thread(target=forward, args=("b", (1, None)))  # other settings: waits for a
    b.start()
    for _ in range(1000):  # until b is in line (a thread may take a while to start on a busy host)
        if (1, None) in settings._waiters.values():
            break
        threading.Event().wait(0.01)
    assert (1, None) in settings._waiters.values()
    c = threading.Thread(target=forward, args=("c", (2, None)))  # a's settings, after b asked
    c.start()
    assert not inside["c"].wait(0.3) and not inside["b"].is_set()
    gates["a"].set()
    assert inside["b"].wait(10) and not inside["c"].is_set()
    gates["b"].set()
    assert inside["c"].wait(10)
    gates["c"].set()
    for t in (a, b, c):
        t.join(10)
    assert order == ["a", "b", "c"]
