"""Host restores in reader processes (``RestoreTuning.host_readers``): each worker reads a
chunk object, verifies it completely (both long hashes) and copies its rows straight into
the install's planes, which live in one shared arena of the engine's plane pool
(``ArrayInstall.share_planes``). The restore is bit-identical to the threads', every
refusal is the one the threads give and installs nothing, a dead worker or an arena a
worker cannot map fails the restore as ``io``, and stores whose reads must stay in this
process (a fault-injecting file layer) keep the threads."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from kvpack.engine.arrays import SharedArena
from kvpack.engine.restore import HostPipeline, RestoreTuning
from kvpack.errors import StoreError
from kvpack.store import PackStore
from kvpack.store.packstore import _EnvChunks, chunk_name
from kvpack.testing.faults import FaultyOps

from .helpers import TOKENS, engine, new_store, session_with
from .test_host_restore_installs import _captured_jobs


def _saved(tmp_path, eng, tokens=TOKENS, **kw):
    store = new_store(tmp_path, **kw)
    store.host_readers = 2
    src = session_with(eng, tokens, store)
    return store, src, store.find_deepest(tokens, eng.layout, eng.ids())


def test_reader_processes_restore_bit_identically_into_shared_planes(tmp_path):
    eng = engine()
    store, src, hit = _saved(tmp_path, eng)
    want = src.cache_digest()
    dst = eng.new_session()
    report = store.restore(hit, dst, TOKENS)
    assert report.phases["host_read_processes"] == 2
    assert report.hashed_on == {"host": report.chunks_verified} and report.chunks_verified > 8
    assert dst.cache_digest() == src.cache_digest()  # windowed layers: rows from inside a chunk
    assert eng.planes.stats()["roots"] == 1  # the install's planes: one arena
    # a second restore while the first session holds its planes gets a second arena, and
    # the first session's rows are untouched by it
    other = eng.new_session()
    store.restore(hit, other, TOKENS)
    assert eng.planes.stats()["roots"] == 2
    assert dst.cache_digest() == other.cache_digest() == src.cache_digest()
    assert dst.decode_greedy(3)[0] == src.decode_greedy(3)[0]
    del dst, other
    again = eng.new_session()
    store.restore(hit, again, TOKENS)  # an idle arena is reused
    assert eng.planes.stats()["roots"] == 2 and eng.planes.stats()["reused"] >= 1
    assert again.cache_digest() == want


def test_encrypted_chunks_are_verified_in_the_workers(tmp_path):
    eng = engine()
    store, src, hit = _saved(tmp_path, eng, TOKENS[:600], encrypted=True)
    dst = eng.new_session()
    assert store.restore(hit, dst, TOKENS[:600]).phases["host_read_processes"] == 2
    assert dst.cache_digest() == src.cache_digest()


def _damage(store, victim: str, damage: str) -> None:
    data = bytearray(store.env.read(victim))
    if damage == "missing":
        store.env.delete(victim)
        return
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[{"payload": len(data) // 2, "padding": len(data) - 1, "header": 130}[damage]] ^= 4
    store.env.write(victim, bytes(data))


@pytest.mark.parametrize("damage", ["payload", "padding", "truncate", "missing", "header"])
@pytest.mark.parametrize("encrypted", [False, True])
def test_refusals_match_the_threads_and_install_nothing(tmp_path, damage, encrypted):
    eng = engine()
    store, _src, hit = _saved(tmp_path, eng, TOKENS[:600], encrypted=encrypted)
    # a chunk of a full-span layer of the cut's own pack: every restore of the cut reads it
    needed = [ref for key, _span, ref in store.load_chain(hit.manifest_id)[0].chunk_refs() if key.layer == 0]
    _damage(store, chunk_name(needed[len(needed) // 2].content_id), damage)
    reasons = {}
    for readers in (0, 2):
        store.host_readers = readers
        live = session_with(eng, [5] * 300)
        before = live.cache_digest()
        with pytest.raises(StoreError) as info:
            store.restore(hit, live, TOKENS[:600])
        reasons[readers] = (type(info.value), info.value.category, getattr(info.value, "format_category", None), str(info.value))
        assert live.cache_digest() == before and live.tokens == [5] * 300
    assert reasons[0] == reasons[2]
    assert reasons[2][1] == ("incomplete" if damage == "missing" else "corrupt")


def test_a_dead_worker_fails_the_restore_as_io_and_is_replaced(tmp_path, monkeypatch):
    eng = engine()
    store, src, hit = _saved(tmp_path, eng)
    # every worker exits as soon as it is told how to read: the batches it held fail
    monkeypatch.setattr(_EnvChunks, "worker_reader", lambda self: ("os", "_exit", (3,)))
    live = session_with(eng, [5] * 300)
    before = live.cache_digest()
    with pytest.raises(StoreError) as info:
        store.restore(hit, live, TOKENS)
    assert info.value.category == "io"
    assert live.cache_digest() == before and live.tokens == [5] * 300
    monkeypatch.undo()
    dst = eng.new_session()
    assert store.restore(hit, dst, TOKENS).phases["host_read_processes"] == 2  # new workers
    assert dst.cache_digest() == src.cache_digest()


def test_an_arena_a_worker_cannot_map_fails_the_restore_as_io(tmp_path, monkeypatch):
    eng = engine()
    store, _src, hit = _saved(tmp_path, eng)
    # an arena id no worker has mapped, at a path that does not exist
    monkeypatch.setattr(SharedArena, "spec", lambda self: (10**9 + self.id, os.path.join(tmp_path, "no-such-arena"), self.nbytes))
    live = session_with(eng, [5] * 300)
    before = live.cache_digest()
    with pytest.raises(StoreError) as info:
        store.restore(hit, live, TOKENS)
    assert info.value.category == "io" and "arena" in str(info.value)
    assert live.cache_digest() == before


def test_a_refusal_stops_the_workers_reading_later_batches(tmp_path, monkeypatch):
    """The first job's chunk is missing: the workers skip the batches after its batch
    instead of reading the rest of the cut (each other read is slowed down, so without the
    skip every job would be read)."""
    eng = engine()
    store, _src, hit = _saved(tmp_path, eng)
    jobs = _captured_jobs(monkeypatch)
    store.restore(hit, eng.new_session(), TOKENS)
    first = jobs[0].ref.content_id
    store.env.delete(chunk_name(first))
    log = os.path.join(tmp_path, "reads.log")
    monkeypatch.setattr(_EnvChunks, "worker_reader", lambda self: ("kvpack.testing.faults", "LoggingChunkReader", (store.path, log, 0.05, first)))
    live = session_with(eng, [5] * 300)
    before = live.cache_digest()
    with pytest.raises(StoreError) as info:
        store.restore(hit, live, TOKENS)
    assert info.value.category == "incomplete" and first.hex() in str(info.value)
    assert live.cache_digest() == before
    with open(log) as fh:
        reads = fh.read().split()
    assert first.hex() in reads and len(jobs) > 40
    assert len(reads) < len(jobs) // 4, (len(reads), len(jobs))


def test_auto_starts_the_workers_in_the_background_and_uses_them_once_running(tmp_path, monkeypatch):
    """``host_readers = "auto"`` on a many-core machine: a large enough restore keeps its
    threads and starts the workers behind it; the next restore finds them running."""
    import time

    from kvpack.engine import chunk_readers, restore

    eng = engine()
    store, src, hit = _saved(tmp_path, eng)
    store.host_readers = "auto"
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr(restore, "HOST_READERS_START_BYTES", 1)
    monkeypatch.setattr(chunk_readers, "_host_pool", None)  # none running yet in this test
    store.workers = 2
    try:
        first = eng.new_session()
        assert store.restore(hit, first, TOKENS).phases["host_read_processes"] == 0
        deadline = time.monotonic() + 60
        while chunk_readers.running_host_readers() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the background start and its probe
        second = eng.new_session()
        assert store.restore(hit, second, TOKENS).phases["host_read_processes"] == 2
        assert first.cache_digest() == second.cache_digest() == src.cache_digest()
    finally:
        if chunk_readers._host_pool is not None:
            chunk_readers._host_pool.close()


def test_auto_keeps_the_threads_when_the_workers_cannot_map_an_arena(tmp_path, monkeypatch):
    """Where the workers cannot open this process's memfds (/proc hiding descriptors), the
    background start's probe says so and ``"auto"`` keeps restoring on threads."""
    import time

    from kvpack.engine import chunk_readers, restore

    eng = engine()
    store, src, hit = _saved(tmp_path, eng)
    store.host_readers, store.workers = "auto", 2
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr(restore, "HOST_READERS_START_BYTES", 1)
    monkeypatch.setattr(chunk_readers, "_host_pool", None)
    monkeypatch.setattr(SharedArena, "spec", lambda self: (self.id, os.path.join(tmp_path, "hidden"), self.nbytes))
    try:
        store.restore(hit, eng.new_session(), TOKENS)  # starts them behind it
        deadline = time.monotonic() + 60
        while (chunk_readers._host_pool is None or chunk_readers._host_pool.arenas_mappable is not False) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert chunk_readers._host_pool is not None and chunk_readers._host_pool.live() == 2
        assert chunk_readers._host_pool.arenas_mappable is False  # the probe said so
        assert chunk_readers.running_host_readers() is None
        dst = eng.new_session()
        assert store.restore(hit, dst, TOKENS).phases["host_read_processes"] == 0
        assert dst.cache_digest() == src.cache_digest()
    finally:
        if chunk_readers._host_pool is not None:
            chunk_readers._host_pool.close()


def test_a_fault_injecting_file_layer_keeps_the_threads(tmp_path):
    eng = engine()
    store, src, hit = _saved(tmp_path, eng)
    ops = FaultyOps()
    faulty = PackStore.open(store.path, ops=ops)
    faulty.host_readers = 2
    dst = eng.new_session()
    report = faulty.restore(hit, dst, TOKENS)
    assert report.phases["host_read_processes"] == 0
    assert sum(1 for _kind, path in ops.reads if "chunks" in path) == report.chunks_verified  # seen by the fault layer
    assert dst.cache_digest() == src.cache_digest()


def test_an_engine_without_a_plane_pool_keeps_the_threads(tmp_path):
    eng = engine(plane_pool_bytes=0)  # no shared arena to write into
    store, src, hit = _saved(tmp_path, eng, TOKENS[:600])
    dst = eng.new_session()
    assert store.restore(hit, dst, TOKENS[:600]).phases["host_read_processes"] == 0
    assert dst.cache_digest() == src.cache_digest()


class _Source:
    def __init__(self, recipe):
        self.recipe = recipe

    def worker_reader(self):
        return self.recipe


class _SharedInstall:
    def share_planes(self) -> bool:
        return True

    def claim_shared_rows(self, layer, role, start, n):
        raise AssertionError("not called")

    def rows_landed(self, layer, role, start, n) -> None:
        raise AssertionError("not called")


@pytest.mark.parametrize(
    "mode, cpus, recipe, shared, running, mib, expected, started",
    [
        ("auto", 16, ("m", "f", ()), True, True, 1, 12, False),
        ("auto", 8, ("m", "f", ()), True, True, 1, 12, False),
        ("auto", 16, ("m", "f", ()), True, False, 64, 0, True),  # large: start them, keep threads now
        ("auto", 16, ("m", "f", ()), True, False, 63, 0, False),  # small: never pay the start
        ("auto", 4, ("m", "f", ()), True, True, 64, 0, False),  # few cores: threads, as on the 2-core CI
        ("auto", 16, None, True, True, 64, 0, False),  # S3, a fault layer: no recipe
        ("auto", 16, ("m", "f", ()), False, True, 64, 0, False),  # an install without shared planes
        (0, 16, ("m", "f", ()), True, True, 64, 0, False),
        (3, 2, ("m", "f", ()), True, False, 1, 3, False),  # forced (waits for them to start)
        (3, 2, None, True, True, 1, 0, False),
    ],
)
def test_which_restores_use_reader_processes(monkeypatch, mode, cpus, recipe, shared, running, mib, expected, started):
    from types import SimpleNamespace

    from kvpack.engine import chunk_readers

    starts: list[int] = []
    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    monkeypatch.setattr(chunk_readers, "running_host_readers", lambda: object() if running else None)
    monkeypatch.setattr(chunk_readers, "start_host_readers", starts.append)
    tuning = replace(RestoreTuning(), workers=12, host_readers=mode)
    install = _SharedInstall() if shared else object()
    jobs = [SimpleNamespace(ref=SimpleNamespace(object_bytes=1 << 20))] * mib
    assert HostPipeline(_Source(recipe), install, None, tuning).reader_processes(jobs) == expected
    assert starts == ([12] if started else [])
