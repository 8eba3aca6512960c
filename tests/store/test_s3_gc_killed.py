"""A gc process SIGKILLed in the middle of its sweep (S3): its sweep lease stays behind,
unrenewed. Publishers that see it wait until it lapses -- 2 x the lease ttl after its last
renewal, so at most 2 x ttl after the kill (docs/store.md "gc and leases": the bound) -- and
then check their chain and commit; nothing committed is lost, and the next gc removes the
dead lease. A real ``gc`` in a child process, held inside its sweep right after its first
DELETE (so it dies with deletes done and more pending) and killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvpack.store.s3 import SWEEP_LEASES

from .helpers import TOKENS, S3Backend, engine, names, session_with
from .test_s3_crash import _assert_restores, _child_env

pytestmark = pytest.mark.slow

#: lease ttl of the test (every process of the store uses the same one)
TTL_S = 1.0
#: the grace period: a publication waiting for the dead sweep must finish within half of it
#: (else it is refused), so half of it is 2 x ttl plus room for a loaded 2-core host
GRACE_S = 10.0

GC_CHILD = textwrap.dedent(
    """
    import time
    from kvpack.store import PackStore
    store = PackStore.open({location!r})
    real_delete = store.env.delete

    def delete(name, **kw):
        ok = real_delete(name, **kw)
        if ok and name.startswith("chunks/"):
            print("deleted " + name, flush=True)  # one delete done, more pending: hold here
            time.sleep(3600)
        return ok

    store.env.delete = delete
    store.gc()
    print("finished", flush=True)
    """
)


def test_publisher_proceeds_after_a_sigkilled_gc_sweep_lapses_and_nothing_is_lost(tmp_path, seaweed, monkeypatch):
    monkeypatch.setenv("KVPACK_S3_LEASE_TTL_S", str(TTL_S))
    backend = S3Backend(seaweed, gc_grace_s=GRACE_S)
    store = backend.new(tmp_path, name="gc-killed")
    assert store.env.lease_ttl_s == TTL_S
    eng = engine()
    tokens = TOKENS[:1024]
    session_with(eng, tokens[:768], store)  # cuts 256, 512, 768
    top = store.find_deepest(tokens[:768], eng.layout, eng.ids())
    assert top is not None and top.cut == 768
    store.forget(top.manifest_id)  # its own chunks become garbage for the child's gc
    time.sleep(GRACE_S + 1.0)  # ... old enough to delete

    child_env = _child_env(seaweed, backend.keys[store.path], grace=GRACE_S)
    child_env["KVPACK_S3_LEASE_TTL_S"] = str(TTL_S)
    child = subprocess.Popen([sys.executable, "-c", GC_CHILD.format(location=store.path)], stdout=subprocess.PIPE, text=True, env=child_env)
    try:
        line = child.stdout.readline()
        assert line.startswith("deleted chunks/"), line
        sweeps = [i for i in store.env.list(SWEEP_LEASES)]
        assert len(sweeps) == 1  # the child's, alive (renewed while it is held)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    # a publisher now: a delta on 512 over the span whose chunks the dead gc began deleting
    session = eng.new_session()
    session.prefill(tokens, chunk_size=256)
    assert store.env.gc_seen().sweeping == frozenset({sweeps[0].name})  # still listed as live
    report = store.save(session)  # waits for the lapse, checks its chain, commits
    after = store.env.now()
    assert report.kind in ("delta", "full") and report.cut == 1024
    # it honoured the dead sweep: it committed only once the lease had lapsed (2 x ttl
    # after its last renewal), and not after half the grace period (else: refused, locked)
    assert after >= sweeps[0].mtime + 2 * TTL_S

    for cut in (256, 512, 1024):  # nothing committed is lost, each restores bit-exact
        _assert_restores(store, eng, tokens[:cut], cut)
    assert store.verify(read_data=True)["ok"]
    # the next gc removes the dead sweep lease and leaves the store clean
    store.gc()
    assert names(store, SWEEP_LEASES) == []
    report = store.verify(read_data=True)
    assert report["ok"], report["problems"][:5]
    _assert_restores(store, eng, tokens, 1024)
