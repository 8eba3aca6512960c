"""gc racing a publisher in another process never deletes a referenced chunk."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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
        tokens = [(t + k) % 64 for t in TOKENS]
        s = eng.new_session()
        s.prefill(tokens, chunk_size=256, on_chunk=lambda ss: store.save(ss))
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    collections = 0
    while proc.poll() is None:
        for name in os.listdir(os.path.join(store.path, "index")):
            if collections % 3 == 0:
                # drop an index entry now and then so gc has live garbage to remove
                os.unlink(os.path.join(store.path, "index", name))
                break
        store.gc()
        collections += 1
        time.sleep(0.01)
    assert proc.returncode == 0, proc.stderr.read()
    assert collections >= 5
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
