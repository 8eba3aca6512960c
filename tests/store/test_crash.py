"""Crash safety of publication: the fault-injecting file layer (crash before every step N,
EIO on fsync) and real subprocesses killed with SIGKILL mid-save. Afterwards the store always
verifies clean and the last good cut restores bit-exactly."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvpack.errors import DurableIOError
from kvpack.store import PackStore
from kvpack.testing.faults import FaultyOps, SimulatedCrash

from .helpers import TOKENS, engine, new_store, session_with


def _faulty(path: str, ops: FaultyOps) -> PackStore:
    store = PackStore.open(path, ops=ops)
    store.workers = 1  # deterministic step numbering
    return store


def _assert_restores(store: PackStore, eng, tokens, expect_cut: int) -> None:
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    assert hit is not None and hit.cut == expect_cut
    live = eng.new_session()
    store.restore(hit, live, tokens)
    assert live.cache_digest() == session_with(eng, tokens[:expect_cut]).cache_digest()


def test_crash_before_every_step_of_a_publication(tmp_path):
    eng = engine()
    base = new_store(tmp_path)
    good = session_with(eng, TOKENS[:512], base)  # committed generation: cuts 256 and 512
    nxt = eng.new_session()
    nxt.prefill(TOKENS[:768], chunk_size=256)
    # count the steps of one full publication of the 768 cut
    probe_dir = tmp_path / "probe"
    os.system(f"cp -a {base.path} {probe_dir}")
    counter = FaultyOps()
    _faulty(str(probe_dir), counter).save(nxt)
    steps = counter.steps
    assert steps > 10
    for n in range(1, steps + 1):
        work = tmp_path / f"crash{n}"
        os.system(f"cp -a {base.path} {work}")
        with pytest.raises(SimulatedCrash):
            _faulty(str(work), FaultyOps(crash_at=n)).save(nxt)
        after = PackStore.open(str(work))
        report = after.verify(read_data=True)
        assert report["ok"], (n, report["problems"])
        hit = after.find_deepest(TOKENS[:768], eng.layout, eng.ids())
        assert hit.cut in (512, 768), n
        _assert_restores(after, eng, TOKENS[:768], hit.cut)
        after.gc()
        assert after.verify(read_data=True)["ok"]
    del good


@pytest.mark.parametrize("failing", ["fsync", "dirsync", "rename"])
def test_eio_during_publication_leaves_previous_generation(tmp_path, failing):
    eng = engine()
    store = new_store(tmp_path)
    session_with(eng, TOKENS[:512], store)
    nxt = eng.new_session()
    nxt.prefill(TOKENS[:768], chunk_size=256)
    faulty = _faulty(store.path, FaultyOps(fail_ops={failing}))
    with pytest.raises(DurableIOError) as info:
        faulty.save(nxt)
    assert info.value.category == failing
    clean = PackStore.open(store.path)
    assert clean.verify()["ok"]
    _assert_restores(clean, eng, TOKENS[:768], 512)


CHILD = textwrap.dedent(
    """
    import itertools, sys
    from kvpack.store import PackStore
    sys.path.insert(0, {tests!r})
    from store.helpers import engine, TOKENS
    store = PackStore.open({path!r})
    eng = engine()
    print("ready", flush=True)
    for k in itertools.count():  # runs until killed
        tokens = [(t + {base} + k) % 64 for t in TOKENS]
        s = eng.new_session()
        s.prefill(tokens, chunk_size=256, on_chunk=lambda ss: store.save(ss))
    """
)


@pytest.mark.slow
def test_sigkill_during_save_loop(tmp_path):
    """>= 50 real processes killed with SIGKILL at random points of saving."""
    eng = engine()
    store = new_store(tmp_path)
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rng = random.Random(1234)
    kills = restored = 0
    for i in range(52):
        base = 3 * i
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(tests=tests_dir, path=store.path, base=base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
        kills += 1
        report = store.verify(read_data=i % 5 == 0)
        assert report["ok"], (i, report["problems"])
        for k in range(3):
            tokens = [(t + base + k) % 64 for t in TOKENS]
            hit = store.find_deepest(tokens, eng.layout, eng.ids())
            if hit is not None:
                _assert_restores(store, eng, tokens, hit.cut)
                restored += 1
        if i % 10 == 9:
            store.gc()
    assert kills >= 50
    assert restored > 20  # the loop really published cuts between kills
    store.gc()
    assert store.verify(read_data=True)["ok"]
