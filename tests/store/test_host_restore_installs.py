"""The host restore pipeline installs each verified chunk's rows on the worker that verified
it when the install takes disjoint rows from several threads (``concurrent_row_writes``),
and on the restore's own thread otherwise; either way the first refused chunk in job order
is the refusal (also with reader processes), nothing is installed, and no worker still runs
when the restore returns."""

from __future__ import annotations

import threading

import pytest

import kvpack.store.packstore as packstore
from kvpack.engine.arrays import ArrayInstall
from kvpack.errors import StoreError
from kvpack.store.packstore import chunk_name

from .helpers import TOKENS, engine, flip, new_store, session_with


class CallRecorder:
    """Wraps ``ArrayInstall.write_rows`` (monkeypatched) to record the calling threads."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def wrap(self, write_rows):
        def recorded(install, *args, **kw):
            with self.lock:
                self.threads.append(threading.current_thread())
            return write_rows(install, *args, **kw)

        return recorded


def _captured_jobs(monkeypatch) -> list:
    """The chunk jobs of the next restores, in job order, as the store hands them over."""
    jobs: list = []
    real = packstore.install_chunks

    def spy(job_list, *args):
        jobs[:] = job_list
        return real(job_list, *args)

    monkeypatch.setattr(packstore, "install_chunks", spy)
    return jobs


@pytest.mark.parametrize(
    "concurrent, worker_installs, workers, on_workers",
    [(True, True, 4, True), (True, True, 3, True), (False, True, 4, False), (True, False, 4, False), (True, True, 2, False), (True, True, 1, False)],
)
def test_rows_are_installed_by_the_workers_only_when_the_install_allows_it(tmp_path, monkeypatch, concurrent, worker_installs, workers, on_workers):
    store = new_store(tmp_path)
    store.workers = workers
    store.tuning.worker_installs = worker_installs
    store.host_readers = 0
    eng = engine()
    src = session_with(eng, TOKENS, store)
    recorder = CallRecorder()
    monkeypatch.setattr(ArrayInstall, "write_rows", recorder.wrap(ArrayInstall.write_rows))
    monkeypatch.setattr(ArrayInstall, "concurrent_row_writes", concurrent)
    jobs = _captured_jobs(monkeypatch)
    dst = eng.new_session()
    store.restore(store.find_deepest(TOKENS, eng.layout, eng.ids()), dst, TOKENS)
    assert dst.cache_digest() == src.cache_digest()
    assert len(recorder.threads) == len(jobs) > 8
    on_main = [t is threading.main_thread() for t in recorder.threads]
    assert on_main == [not on_workers] * len(jobs)


@pytest.mark.parametrize("concurrent, readers", [(True, 0), (False, 0), (True, 2)])
def test_first_refusal_in_job_order_wins_and_nothing_is_installed(tmp_path, monkeypatch, concurrent, readers):
    """Threads (installing on the workers or on the restoring thread) and reader processes
    (``host_readers``: batches raised in job order) give the same first refusal."""
    store = new_store(tmp_path)
    store.workers = 4
    store.host_readers = readers
    eng = engine()
    session_with(eng, TOKENS, store)
    hit = store.find_deepest(TOKENS, eng.layout, eng.ids())
    jobs = _captured_jobs(monkeypatch)
    store.restore(hit, eng.new_session(), TOKENS)
    assert len(jobs) > 8
    # an early job's object fails authentication, a later one's is missing: the later one
    # may be seen first by another worker, but the refusal is the earlier job's
    early, late = jobs[1].ref, jobs[-1].ref
    assert early.content_id != late.content_id
    flip(store, chunk_name(early.content_id), early.object_bytes // 2, 0x10)
    store.env.delete(chunk_name(late.content_id))
    recorder = CallRecorder()
    monkeypatch.setattr(ArrayInstall, "write_rows", recorder.wrap(ArrayInstall.write_rows))
    monkeypatch.setattr(ArrayInstall, "concurrent_row_writes", concurrent)
    live = session_with(eng, [5] * 300)
    before = live.cache_digest()
    with pytest.raises(StoreError) as info:
        store.restore(hit, live, TOKENS)
    assert getattr(info.value, "format_category", info.value.category) == "authentication"
    assert live.cache_digest() == before and live.tokens == [5] * 300
    assert bool(readers) == (not recorder.threads)  # processes write rows into shared planes
    # every thread that wrote rows into the (aborted) install has stopped
    assert not any(t.is_alive() for t in recorder.threads if t is not threading.main_thread())


@pytest.mark.parametrize(
    "cpus, workers, concurrent, expected",
    [(16, 16, True, 15), (16, 32, True, 15), (16, 8, True, 8), (16, 16, False, 16), (2, 2, True, 2), (4, 4, True, 3), (4, 4, False, 4)],
)
def test_installing_workers_leave_one_core_to_the_restoring_thread(monkeypatch, cpus, workers, concurrent, expected):
    """Workers that install take every core but one when they would otherwise take them all
    (the restoring thread still drains results and raises refusals); a pipeline whose
    restoring thread installs keeps the configured count."""
    from dataclasses import replace

    from kvpack.engine.restore import HostPipeline, RestoreTuning

    class Install:
        concurrent_row_writes = concurrent

    monkeypatch.setattr("os.cpu_count", lambda: cpus)
    pipeline = HostPipeline(source=None, install=Install(), layout=None, tuning=replace(RestoreTuning(), workers=workers))
    assert pipeline.threads() == expected
