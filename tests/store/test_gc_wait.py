"""A directory store's gc waits for the exclusive store lock visibly and boundedly: one
progress line when it starts waiting (naming what holds the lock: pids from /proc/locks), a
one-line ``locked`` refusal (exit 11) past ``--wait`` / ``KVPACK_GC_WAIT_S`` with nothing
removed, and a fair turn: while a gc waits (it holds ``gc.pending``), new restores and saves
wait behind it, so overlapping restores cannot starve it. Before, gc polled silently for up
to 600 s and a relay of restores held the shared lock forever."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from kvpack.errors import StoreError
from kvpack.store import PackStore
from kvpack.store.env import RESTORE

from .helpers import TOKENS, engine, names, session_with


def _store_with_garbage(tmp_path):
    eng = engine()
    store = PackStore.init(str(tmp_path / "s"), chunk_bytes=4096)
    session_with(eng, TOKENS[:512], store)
    top = store.find_deepest(TOKENS[:512], eng.layout, eng.ids())
    store.forget(top.manifest_id)  # its own chunks, pack and logits are garbage now
    return store


@pytest.mark.timeout(60)
def test_a_waiting_gc_says_what_holds_the_lock_and_refuses_at_its_deadline(tmp_path):
    store = _store_with_garbage(tmp_path)
    before = {p: names(store, p) for p in ("chunks/", "packs/", "logits/", "index/")}
    with store.env.lease(RESTORE):  # a restore in flight, in this process
        r = subprocess.run([sys.executable, "-m", "kvpack.cli", "store", "gc", store.path, "--wait", "1.5"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 11, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("kvpack: gc: waiting for the store lock of ") and f"held by pid {os.getpid()}" in lines[0], lines
    assert lines[-1].startswith("kvpack: locked: ") and "gc waited 1.5 s" in lines[-1] and f"pid {os.getpid()}" in lines[-1], lines
    assert {p: names(store, p) for p in before} == before  # nothing removed
    # the store is idle now: the same gc runs at once, silently, and removes the garbage
    r = subprocess.run([sys.executable, "-m", "kvpack.cli", "store", "gc", store.path, "--wait", "1.5"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert len(names(store, "packs/")) < len(before["packs/"])


def test_gc_wait_settings_refuse_when_not_positive(tmp_path, monkeypatch):
    store = PackStore.init(str(tmp_path / "s"), chunk_bytes=4096)
    r = subprocess.run([sys.executable, "-m", "kvpack.cli", "store", "gc", store.path, "--wait", "0"], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "--wait" in r.stderr
    monkeypatch.setenv("KVPACK_GC_WAIT_S", "never")
    with pytest.raises(StoreError) as info:
        PackStore.open(store.path)
    assert info.value.category == "usage" and "KVPACK_GC_WAIT_S" in info.value.message


@pytest.mark.timeout(60)
def test_overlapping_restores_do_not_starve_a_gc(tmp_path):
    """Two threads relay a shared lease so that one always holds it (each releases only once
    the other holds its own, or after 0.5 s). Before, gc never found the lock free and
    refused after its wait; now new leases wait behind the pending gc, the holder lets go,
    and gc runs while the relay is still going."""
    store = _store_with_garbage(tmp_path)
    env = store.env
    env.lock_timeout_s = 20.0  # the relay's own waits (behind the gc)
    env.gc_wait_s = 4.0
    stop = threading.Event()
    ready = [threading.Event(), threading.Event()]
    held = [0, 0]
    errors: list[BaseException] = []

    def relay(me: int) -> None:
        try:
            while not stop.is_set():
                with env.lease(RESTORE):
                    held[me] += 1
                    ready[me].set()
                    ready[1 - me].wait(0.5)
                    ready[1 - me].clear()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=relay, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    try:
        while min(held) < 3:  # the relay is going: the lock has been shared without a gap
            time.sleep(0.01)
        removed = store.gc()
        assert removed["packs"] >= 1
        assert not stop.is_set() and all(t.is_alive() for t in threads)  # gc ran while the relay went on
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not errors, errors
    assert store.verify(read_data=True)["ok"]


@pytest.mark.timeout(60)
def test_a_gc_stuck_waiting_delays_new_restores_by_its_yield_at_most(tmp_path):
    """A gc that waits behind a hung holder keeps gc.pending: restores and saves started
    meanwhile wait ``gc_yield_s`` for it, then take the lock shared anyway and serve (a
    restore here, and a save), never the gc's whole wait."""
    from kvpack.vocab import FileLock

    eng = engine()
    store = PackStore.init(str(tmp_path / "s"), chunk_bytes=4096)
    session_with(eng, TOKENS[:256], store)
    store.env.gc_yield_s = 0.2
    store.env.lock_timeout_s = 30.0
    with FileLock(os.path.join(store.path, "gc.pending")):  # a gc waiting (for a hung restore)
        live = eng.new_session()
        found = store.lookup_restore(TOKENS[:256], live)
        assert found.hit is not None and live.position == 256
        nxt = eng.new_session()
        nxt.prefill(TOKENS[:512], chunk_size=256)
        assert store.save(nxt).cut == 512


@pytest.mark.timeout(60)
def test_a_relay_of_restores_that_went_ahead_does_not_starve_a_gc(tmp_path):
    """A long restore holds the lock when gc starts and outlasts the gc's turn (``gc_yield_s``
    0.5 s here); meanwhile a restore starts every 0.1 s and holds the lock 0.3 s, so once the
    turn has ended the lock is never free. Before, each restore yielded 0.5 s on its own and
    then went ahead, so they overlapped for ever and gc refused after its whole wait (4 s);
    now the turn is counted from the gc's start, and once the long restore has gone the gc
    opens one more turn: the restores that went ahead finish, new ones queue, and gc runs
    while the relay still goes on."""
    store = _store_with_garbage(tmp_path)
    env = store.env
    env.gc_yield_s = 0.5
    env.lock_timeout_s = 20.0  # the relay's own waits (behind the gc)
    env.gc_wait_s = 4.0
    stop = threading.Event()
    holding = threading.Event()
    errors: list[BaseException] = []
    started: list[threading.Thread] = []

    def long_restore() -> None:
        with env.lease(RESTORE):
            holding.set()
            time.sleep(1.5)

    def short_restore() -> None:
        try:
            with env.lease(RESTORE):
                time.sleep(0.3)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def relay() -> None:
        while not stop.is_set():
            t = threading.Thread(target=short_restore, daemon=True)
            t.start()
            started.append(t)
            time.sleep(0.1)

    slow = threading.Thread(target=long_restore, daemon=True)
    slow.start()
    assert holding.wait(10)
    relaying = threading.Thread(target=relay, daemon=True)
    relaying.start()
    try:
        removed = store.gc()
        assert removed["packs"] >= 1
        assert not stop.is_set() and relaying.is_alive()  # gc ran while the relay went on
    finally:
        stop.set()
        relaying.join(timeout=10)
        slow.join(timeout=10)
        for t in list(started):
            t.join(timeout=10)
    assert not errors, errors
    assert store.verify(read_data=True)["ok"]
