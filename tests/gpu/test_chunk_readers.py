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
from kvpack.store.packstore import _EnvChunks, chunk_name
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


@pytest.mark.parametrize("submit", ["table", "items"])
def test_a_dead_worker_fails_the_restore_and_is_replaced(eng, tmp_path, monkeypatch, submit):
    s, tokens, store = _saved(eng, tmp_path, n=300, seed=4)
    store.tuning.read_submit = submit
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


def _job_refs(store, hit):
    """The chunk refs of a one-pack cut in the order the restore reads them (its jobs)."""
    return [ref for manifest in store.load_chain(hit.manifest_id) for _key, _span, ref in manifest.chunk_refs()]


@pytest.mark.parametrize("submit", ["table", "items"])
@pytest.mark.parametrize("tail", [0, 7])
def test_both_submit_protocols_restore_bit_identically(eng, tmp_path, submit, tail):
    """Wave slices (one compact table per worker per wave) and per-chunk batches give the
    same restore; a host tail gets waves of its own after the device's."""
    s, tokens, store = _saved(eng, tmp_path, n=500, seed=6)
    store.tuning.read_submit = submit
    store.device_host_tail = tail
    r = eng.new_session()
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    report = store.restore(hit, r, tokens)
    n = report.chunks_verified
    assert n == len(_job_refs(store, hit)) > WAVES * WAVE_CHUNKS
    assert report.hashed_on == {"device": n - tail, "host": tail}
    assert report.phases["device_host_tail"] == tail
    device_waves = -(-(n - tail) // WAVE_CHUNKS)
    assert report.phases["device_waves"] == device_waves + -(-tail // WAVE_CHUNKS)  # no wave mixes the two
    assert r.cache_digest() == s.cache_digest()
    assert _ring()._free.qsize() == _ring().waves


def test_wave_slices_report_what_host_verification_costs(eng, tmp_path):
    """The workers time the chunks they verify completely: what sizes a calibrated tail."""
    _s, tokens, store = _saved(eng, tmp_path, n=300, seed=7)
    store.device_host_tail = 5
    store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), eng.new_session(), tokens)
    pool = _ring().readers(2)
    assert pool.timing[3] >= 5 * 4096 and pool.timing[1] > 0
    assert pool.host_seconds_per_byte() == pool.timing[2] / pool.timing[3] > 0


@pytest.mark.parametrize("damage", ["payload", "padding", "header"])
@pytest.mark.parametrize("where", ["device_wave", "host_tail"])
def test_a_tampered_chunk_refuses_in_an_ordered_wave_and_in_the_host_tail(eng, tmp_path, where, damage):
    """One damaged chunk, in the second device wave or in the host tail: every way of
    reading (threads; processes with batches or wave slices) refuses it with the same first
    refusal and installs nothing."""
    _s, tokens, store = _saved(eng, tmp_path, n=400, seed=8)
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    refs = _job_refs(store, hit)
    tail = 8
    index = len(refs) - 3 if where == "host_tail" else WAVE_CHUNKS + 2
    victim = os.path.join(store.path, chunk_name(refs[index].content_id))
    data = bytearray(open(victim, "rb").read())
    data[{"payload": 4096 + 16 + 5, "padding": len(data) - 1, "header": 130}[damage]] ^= 4
    open(victim, "wb").write(bytes(data))
    store.device_host_tail = tail
    reasons = {}
    for mode, submit in (("never", "table"), ("always", "items"), ("always", "table")):
        store.read_processes, store.tuning.read_submit = mode, submit
        r = eng.new_session()
        r.prefill(tokens[:9])
        before = r.cache_digest()
        with pytest.raises(StoreError) as exc:
            store.restore(hit, r, tokens)
        reasons[(mode, submit)] = str(exc.value)
        assert r.cache_digest() == before and len(r.tokens) == 9
        assert _ring()._free.qsize() == _ring().waves
    assert len(set(reasons.values())) == 1, reasons
    assert next(iter(reasons.values())).startswith("corrupt")


def test_wave_slices_are_read_in_wave_order(eng, tmp_path, monkeypatch):
    """Every worker serves its slices in the order sent, one slice of each wave: so no wave's
    reads finish after a later wave's (the timeline's ``reads_done``)."""
    import json

    path = os.path.join(tmp_path, "timeline.jsonl")
    monkeypatch.setenv("KVPACK_RESTORE_TIMELINE", path)
    s, tokens, store = _saved(eng, tmp_path, n=500, seed=9)
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert r.cache_digest() == s.cache_digest()
    with open(path) as fh:
        rows = json.loads(fh.readline())
    assert len(rows) == report.phases["device_waves"] > WAVES
    done = [row["reads_done"] for row in sorted(rows, key=lambda row: row["wave"])]
    assert done == sorted(done)


@pytest.mark.parametrize("mode", ["never", "always"])
def test_waves_verified_wholly_on_the_host_queue_no_hashing(eng, tmp_path, monkeypatch, mode):
    """The host tail's waves (every chunk verified on the host) are uploaded but hash no job
    rows; the device's waves hash all of theirs."""
    calls: list[int] = []
    real = device_verify.hash_jobs_on_host
    monkeypatch.setattr(device_verify, "hash_jobs_on_host", lambda table, count: calls.append(count) or real(table, count))
    s, tokens, store = _saved(eng, tmp_path, n=500, seed=10)
    store.read_processes, store.device_host_tail = mode, 7
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    device_waves = -(-(report.chunks_verified - 7) // WAVE_CHUNKS)
    assert len(calls) == report.phases["device_waves"] == device_waves + 2
    assert sum(calls) == 2 * (report.chunks_verified - 7) and calls.count(0) == 2
    assert r.cache_digest() == s.cache_digest()
