"""Reader processes (kvpack.engine.chunk_readers): the GPU verify restore's reads and host
checks in worker processes over the ring's shared staging. Forced on the CPU here
(``read_processes = "always"``; on CUDA they are the default for POSIX stores): the restore
is bit-identical, every refusal is the one the reading threads give and installs nothing,
a dead worker fails the restore cleanly and is replaced, and stores whose reads must stay
in this process (a fault-injecting file layer) keep the threads."""

from __future__ import annotations

import os

import pytest

from kvpack.engine import device_verify
from kvpack.errors import StoreError
from kvpack.store import PackStore
from kvpack.store.packstore import _EnvChunks
from kvpack.testing.faults import FaultyOps

from .conftest import llama_engine, random_tokens

WAVE_CHUNKS, WAVES = 6, 3


@pytest.fixture(scope="module")
def eng():
    return llama_engine("f16")


def _store(path, mode="always", **kw) -> PackStore:
    store = (
        PackStore.init(os.path.join(path, "s"), chunk_bytes=4096, **kw)
        if not os.path.exists(os.path.join(path, "s"))
        else PackStore.open(os.path.join(path, "s"), **kw)
    )
    store.verify_on = "device"
    store.read_processes = mode
    store.wave_chunks = WAVE_CHUNKS
    store.device_waves = WAVES
    store.workers = 2
    return store


def _ring():
    return device_verify.wave_ring("cpu", wave_chunks=WAVE_CHUNKS, waves=1)


def _saved(eng, tmp_path, n=600, seed=1):
    tokens = random_tokens(n, eng.layout.vocab_size, seed=seed)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path)
    store.save(s)
    return s, tokens, store


def test_reader_processes_restore_bit_identically(eng, tmp_path):
    s, tokens, store = _saved(eng, tmp_path)
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert report.phases["device_read_processes"] == 2
    assert report.hashed_on == {"device": report.chunks_verified, "host": 0}
    assert report.chunks_verified > WAVES * WAVE_CHUNKS  # the ring wrapped around
    assert r.cache_digest() == s.cache_digest()
    assert r.decode_greedy(3)[0] == s.decode_greedy(3)[0]
    assert _ring()._free.qsize() == _ring().waves


def test_encrypted_chunks_are_verified_in_the_workers(eng, tmp_path):
    tokens = random_tokens(300, eng.layout.vocab_size, seed=2)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, encrypted=True)
    store.save(s)
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert report.phases["device_read_processes"] == 2
    assert report.hashed_on == {"device": 0, "host": report.chunks_verified}
    assert r.cache_digest() == s.cache_digest()


@pytest.mark.parametrize("damage", ["payload", "padding", "truncate", "missing", "header"])
def test_refusals_match_the_reading_threads_and_install_nothing(eng, tmp_path, damage):
    _s, tokens, store = _saved(eng, tmp_path, n=400, seed=3)
    d = os.path.join(store.path, "chunks")
    victim = os.path.join(d, sorted(os.listdir(d))[7])
    data = bytearray(open(victim, "rb").read())
    if damage == "missing":
        os.unlink(victim)
    elif damage == "truncate":
        open(victim, "wb").write(bytes(data[:4096]))
    else:
        data[{"payload": 4096 + 16 + 5, "padding": len(data) - 1, "header": 130}[damage]] ^= 4
        open(victim, "wb").write(bytes(data))
    reasons = {}
    for mode in ("never", "always"):
        store.read_processes = mode
        r = eng.new_session()
        r.prefill(tokens[:9])
        before = r.cache_digest()
        with pytest.raises(StoreError) as exc:
            store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
        reasons[mode] = str(exc.value)
        assert r.cache_digest() == before and len(r.tokens) == 9
        assert _ring()._free.qsize() == _ring().waves
    assert reasons["never"] == reasons["always"]
    assert reasons["always"].startswith("incomplete" if damage == "missing" else "corrupt")


def test_a_dead_worker_fails_the_restore_and_is_replaced(eng, tmp_path, monkeypatch):
    s, tokens, store = _saved(eng, tmp_path, n=300, seed=4)
    # every worker exits as soon as it is told how to read: the batches it held fail
    monkeypatch.setattr(_EnvChunks, "worker_reader", lambda self: ("os", "_exit", (3,)))
    r = eng.new_session()
    r.prefill(tokens[:5])
    before = r.cache_digest()
    with pytest.raises(StoreError) as exc:
        store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert exc.value.category == "io"
    assert r.cache_digest() == before
    assert _ring()._free.qsize() == _ring().waves
    monkeypatch.undo()
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)  # new workers
    assert report.phases["device_read_processes"] == 2
    assert r.cache_digest() == s.cache_digest()


def test_a_fault_injecting_file_layer_keeps_the_reading_threads(eng, tmp_path):
    s, tokens, store = _saved(eng, tmp_path, n=300, seed=5)
    ops = FaultyOps()
    faulty = _store(tmp_path, ops=ops)
    r = eng.new_session()
    report = faulty.restore(faulty.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert report.phases["device_read_processes"] == 0
    assert sum(1 for kind, path in ops.reads if "chunks" in path) == report.chunks_verified  # seen by the fault layer
    assert r.cache_digest() == s.cache_digest()
