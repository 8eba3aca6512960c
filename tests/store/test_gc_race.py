"""gc racing a publisher in another process never deletes a referenced chunk."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from .helpers import TOKENS, engine, new_store, session_with

PUBLISHER = textwrap.dedent(
    """
    import sys
    from kvpack.store import PackStore
    sys.path.insert(0, {tests!r})
    from store.helpers import engine, TOKENS
    store = PackStore.open({path!r})
    eng = engine()
    print("ready", flush=True)
    for k in range({rounds}):
        sys.stdin.readline()  # the test's go: its gc is running while this round publishes
        tokens = [(t + k) % 64 for t in TOKENS]
        s = eng.new_session()
        s.prefill(tokens, chunk_size=256, on_chunk=lambda ss: store.save(ss))
        print("round", k, flush=True)
    print("done", flush=True)
    """
)


@pytest.mark.slow
def test_gc_racing_a_publisher_process(tmp_path):
    eng = engine()
    store = new_store(tmp_path)
    # garbage for gc to find while the publisher runs: an abandoned half-publication
    session_with(eng, [9] * 300, store)
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rounds = 12
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER.format(tests=tests_dir, path=store.path, rounds=rounds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    collections = 0
    deadline = time.monotonic() + 600
    # Rounds are paced by the test so that gc runs at least once while each round publishes,
    # however fast or slow either side is on the machine at hand.
    for _ in range(rounds):
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while True:
            for name in os.listdir(os.path.join(store.path, "index")):
                if collections % 3 == 0:
                    # drop an index entry now and then so gc has live garbage to remove
                    os.unlink(os.path.join(store.path, "index", name))
                    break
            store.gc()
            collections += 1
            try:
                lines.get(timeout=0.01)
                break
            except queue.Empty:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
    proc.stdin.close()
    proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read()
    assert collections >= rounds
    report = store.verify(read_data=True)
    assert report["ok"], report["problems"]
    # every cut the publisher left indexed restores bit-exactly
    restored = 0
    for k in range(rounds):
        tokens = [(t + k) % 64 for t in TOKENS]
        hit = store.find_deepest(tokens, eng.layout, eng.ids())
        if hit is None:
            continue
        live = eng.new_session()
        store.restore(hit, live, tokens)
        assert live.cache_digest() == session_with(eng, tokens[: hit.cut]).cache_digest()
        restored += 1
    assert restored >= rounds - 2
