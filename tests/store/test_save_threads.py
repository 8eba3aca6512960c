"""A save's chunk writes on several threads (publish.save_threads): the store it leaves is
the one a single-threaded save leaves, and a write that fails mid-save refuses the save,
publishes nothing, and hands every export buffer back exactly once (the CUDA adapter's
pinned buffers; here a real NumPy-adapter session whose ``export_spans`` counts them)."""

from __future__ import annotations

import threading

import pytest

from kvpack.errors import DurableIOError
from kvpack.store import PackStore
from kvpack.store.publish import save_threads
from kvpack.testing.faults import FaultyOps

from .helpers import TOKENS, engine, names, new_store, session_with


class CountedExports:
    """A real session whose ``export_spans`` hands out ``export_rows`` views with a release
    callback per view, recording how often each was released (the SpanExport contract)."""

    def __init__(self, session) -> None:
        self._session = session
        self.lock = threading.Lock()
        self.released: list[int] = []  # per exported view: how many times it was released

    def __getattr__(self, name):
        return getattr(self._session, name)

    def export_spans(self, requests, *, depth: int = 8):
        for layer, role, start, stop in requests:
            with self.lock:
                index = len(self.released)
                self.released.append(0)
            yield memoryview(bytes(self._session.export_rows(layer, role, start, stop))), self._release(index)

    def _release(self, index: int):
        def release() -> None:
            with self.lock:
                self.released[index] += 1

        return release


def test_threaded_save_writes_the_same_store_as_one_thread(tmp_path):
    eng = engine()
    session = session_with(eng, TOKENS[:768])
    stores = []
    for workers in (1, 3):
        store = new_store(tmp_path, name=f"w{workers}", root_key_file=str(tmp_path / "root.key"))  # same keys: same content ids
        store.workers = workers
        assert save_threads(store) == (1 if workers == 1 else 2 * workers)
        counted = CountedExports(session)
        report = store.save(counted)
        assert report.chunks_written == len(names(store, "chunks/"))
        assert counted.released and all(n == 1 for n in counted.released)
        stores.append(store)
    assert names(stores[0], "chunks/") == names(stores[1], "chunks/")
    for store in stores:
        live = eng.new_session()
        hit = store.find_deepest(TOKENS[:768], eng.layout, eng.ids())
        store.restore(hit, live, TOKENS[:768])
        assert live.cache_digest() == session.cache_digest()


@pytest.mark.parametrize("failing", ["write", "fsync", "link"])
def test_a_failed_chunk_write_refuses_the_save_and_returns_every_buffer(tmp_path, failing):
    eng = engine()
    store = new_store(tmp_path)
    session_with(eng, TOKENS[:512], store)
    before = names(store, "index/")
    nxt = eng.new_session()
    nxt.prefill(TOKENS[:768], chunk_size=256)
    seen = {"n": 0}
    lock = threading.Lock()

    def fifth(_step: int, name: str) -> bool:  # the fifth such call fails, the rest succeed
        if name != failing:
            return False
        with lock:
            seen["n"] += 1
            return seen["n"] == 5

    faulty = PackStore.open(store.path, ops=FaultyOps(fail=fifth))
    faulty.workers = 3
    counted = CountedExports(nxt)
    with pytest.raises(DurableIOError):
        faulty.save(counted)
    assert counted.released and all(n == 1 for n in counted.released), counted.released
    clean = PackStore.open(store.path)
    assert names(clean, "index/") == before
    assert clean.verify(read_data=True)["ok"]
    assert clean.find_deepest(TOKENS[:768], eng.layout, eng.ids()).cut == 512


def test_save_writers_sets_the_writing_threads_and_the_report_times_each_step(tmp_path, monkeypatch):
    from kvpack.store import publish

    eng = engine()
    session = session_with(eng, TOKENS[:768])
    store = new_store(tmp_path, root_key_file=str(tmp_path / "root.key"))
    store.workers = 3
    store.save_writers = 2
    assert save_threads(store) == 2
    writers: set[str] = set()
    real = publish._store_chunk

    def recording(*args, **kw):
        writers.add(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(publish, "_store_chunk", recording)
    report = store.save(session)
    # every chunk written, on at most two threads (an idle one is reused before another starts)
    assert report.chunks_written > 2 and 1 <= len(writers) <= 2
    assert set(report.phases) == {"lookup_s", "plan_s", "chunks_s", "durable_s", "commit_s"}
    assert all(v >= 0 for v in report.phases.values()) and sum(report.phases.values()) == pytest.approx(report.seconds)
    store.save_writers = None
    assert save_threads(store) == 6
    live = eng.new_session()
    store.restore(store.find_deepest(TOKENS[:768], eng.layout, eng.ids()), live, TOKENS[:768])
    assert live.cache_digest() == session.cache_digest()
