"""kvpack as vLLM's KV connector (kv_both, a verified prefix store), real vLLM on CPU.

Every case compares vLLM's greedy tokens (temperature 0, ignore_eos, 32 tokens) with the
tokens of an engine without any connector (the session's ``reference``), and reads the
connector's own counters through vLLM's metrics (``LLM.get_metrics()``):

* cold request (a miss; the prefix is saved: 256, 512, 768 and the tail cut 999), the same
  prompt again in the same process (a hit covering all but the last token: the prompt is
  not a multiple of 256), a prompt sharing only the first 512 tokens (a partial hit);
* a flipped byte in a stored chunk (the worker's verification refuses the load: a refusal,
  the cut is quarantined, vLLM recomputes, the same tokens; the next run hits again: healed);
* a truncated chunk (refused at planning: the cut and the ones built on it are quarantined,
  the deepest intact prefix is loaded);
* a fresh vLLM process on the same store (a hit from disk), and an engine of another
  identity (block size 64) on the same store (a miss).

vLLM's prefix cache is reset before every request, so reuse is the connector's.

Engines: ``first_engine`` serves the same-process cases; the fresh process and the
other-identity engine (:class:`Later`) boot on the other core while those cases run (once
the session's reference engine has stopped and freed it), and are used only after
``first_engine`` has stopped: a process that never computed the prompt finds it on disk.
"""

from __future__ import annotations

import os

import pytest

from kvpack.store import PackStore

from kvpack.testing.vllm_harness import Engine, stop_all

from .conftest import MAX_TOKENS, engine_config, start

pytestmark = pytest.mark.slow


def _kvpack(model: str, store: str, **kw) -> dict:
    # a generous save wait: a loaded CI machine may take long to write a save
    return engine_config(model, "kvpack", extra={"kvpack.store": store, "kvpack.save_wait_s": 300}, **kw)


def _chunks_of_cuts(store_dir: str, cut: int, *, top_only: bool) -> list[str]:
    """Chunk files of every stored pack whose cut is ``cut`` (its own delta span when
    ``top_only``, else also its parents')."""
    store = PackStore.open(store_dir)
    out = []
    for _node, mid in store.index_entries():
        chain = store.load_chain(mid)
        if chain[0].cut.token_count != cut:
            continue
        for manifest in chain[:1] if top_only else chain:
            out += [store.chunk_path(ref.content_id) for _k, _s, ref in manifest.chunk_refs()]
    return sorted(set(out))


def _stored_cuts(store_dir: str) -> set[int]:
    store = PackStore.open(store_dir)
    return {store.load_chain(mid)[0].cut.token_count for _node, mid in store.index_entries()}


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("vllm-store") / "store")


@pytest.fixture(scope="module")
def first_engine(reference, smollm2_dir, store_dir, tmp_path_factory):
    """The connector engine of the same-process cases; it boots beside the reference engine
    (separate cores) and is ready by the time a test calls it."""
    logs = tmp_path_factory.mktemp("vllm-first")
    eng = start(_kvpack(smollm2_dir, store_dir), logs, "kvpack-first", core=0)
    yield eng
    eng.stop()


class Later:
    """The fresh process (vLLM's default multi-process engine: scheduler and worker in
    separate processes) and an engine of another identity (block size 64), both on the
    store, booted ahead of their test so their start overlaps the same-process cases."""

    def __init__(self, model: str, store: str, logs) -> None:
        self.model, self.store, self.logs = model, store, logs
        self.fresh: Engine | None = None
        self.other: Engine | None = None

    def start(self) -> "Later":
        if self.fresh is None:
            self.fresh = start(_kvpack(self.model, self.store, single_process=False), self.logs, "kvpack-fresh", core=1)
            self.other = start(_kvpack(self.model, self.store, block_size=64), self.logs, "kvpack-block64", core=1)
        return self


@pytest.fixture(scope="module")
def later(smollm2_dir, store_dir, reference, tmp_path_factory):
    engines = Later(smollm2_dir, store_dir, tmp_path_factory.mktemp("vllm-later"))
    if reference.done:  # another module used the reference engine: boot beside first_engine now
        engines.start()
    yield engines
    stop_all(engines.fresh, engines.other)


def test_cold_hit_and_partial_hit_give_the_reference_tokens(first_engine, later, prompts, reference, store_dir):
    m0 = first_engine.metrics()
    (cold,) = first_engine.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m1 = first_engine.metrics()
    assert cold["tokens"] == reference["A"]
    later.start()  # (if not yet) the reference engine has stopped: its core boots the later engines
    assert cold["text"].strip() and set(cold["tokens"]) != {0}  # real text, not token 0
    assert _delta(m1, m0, "kvpack_misses") == 1 and _delta(m1, m0, "kvpack_loads") == 0

    (again,) = first_engine.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m2 = first_engine.metrics()
    assert again["tokens"] == reference["A"]
    assert _delta(m2, m1, "kvpack_loads") == 1
    # the tail cut: vLLM computes only the last of the 1,000 tokens
    assert _delta(m2, m1, "kvpack_loaded_tokens") == len(prompts["A"]) - 1 == 999
    assert 999 in _stored_cuts(store_dir)

    (partial,) = first_engine.generate([prompts["B"]], max_tokens=MAX_TOKENS)
    m3 = first_engine.metrics()
    assert partial["tokens"] == reference["B"]
    assert _delta(m3, m2, "kvpack_loads") == 1 and _delta(m3, m2, "kvpack_loaded_tokens") == 512
    assert m3.get("kvpack_refusals", 0) == 0 and m3.get("kvpack_saved_cuts", 0) >= 4  # A: 256/512/768/999 (B's may be pending)


def test_a_flipped_byte_is_refused_recomputed_and_healed(first_engine, prompts, reference, store_dir):
    victims = _chunks_of_cuts(store_dir, 768, top_only=True)  # A's and B's 768 deltas (below A's tail cut)
    assert victims
    for path in victims:
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0x01]))
    m0 = first_engine.metrics()
    (out,) = first_engine.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m1 = first_engine.metrics()
    assert out["tokens"] == reference["A"]
    assert _delta(m1, m0, "kvpack_refusals") >= 1 and _delta(m1, m0, "kvpack_loads") == 0
    assert os.listdir(os.path.join(store_dir, "quarantine"))  # a receipt says what failed

    # the recomputed cut was saved again; a lookup waits for a pending save of its prefix
    (healed,) = first_engine.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m2 = first_engine.metrics()
    assert healed["tokens"] == reference["A"]
    assert _delta(m2, m1, "kvpack_loads") == 1 and _delta(m2, m1, "kvpack_loaded_tokens") == 999


def test_a_truncated_chunk_is_refused_at_planning_and_the_intact_prefix_loads(first_engine, prompts, reference, store_dir):
    victims = _chunks_of_cuts(store_dir, 512, top_only=True)  # the 512 delta A and B share
    assert victims
    for path in victims:
        with open(path, "r+b") as fh:
            fh.truncate(os.path.getsize(path) - 100)
    m0 = first_engine.metrics()
    (out,) = first_engine.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m1 = first_engine.metrics()
    assert out["tokens"] == reference["A"]
    assert _delta(m1, m0, "kvpack_refusals") >= 1
    assert _delta(m1, m0, "kvpack_loads") == 1 and _delta(m1, m0, "kvpack_loaded_tokens") == 256


def test_a_fresh_process_hits_from_disk_and_another_identity_misses(vllm_py, store_dir, prompts, reference, first_engine, later):
    first_engine.generate([prompts["A"]], max_tokens=1)  # waits for A's pending save, if any
    first_engine.stop()  # the store is complete on disk; the process that computed A is gone
    fresh, other = later.start().fresh, later.other
    assert fresh is not None and other is not None
    (hit,) = fresh.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m = fresh.metrics()
    assert hit["tokens"] == reference["A"]
    assert m.get("kvpack_loads") == 1 and m.get("kvpack_loaded_tokens") == 999
    (miss,) = other.generate([prompts["A"]], max_tokens=MAX_TOKENS)
    m = other.metrics()
    assert miss["tokens"] == reference["A"]
    assert m.get("kvpack_misses") == 1 and m.get("kvpack_loads", 0) == 0 and m.get("kvpack_refusals", 0) == 0
