"""``kvpack store verify`` is read-only on both backends: it writes nothing to the store (no
lease object, no lock file, no receipt), so it runs with S3 credentials that may only read
and list (a real SeaweedFS identity with the ``Read`` and ``List`` actions only: the server
itself refuses any write) and on a directory mounted read-only (a real read-only bind
mount: the kernel refuses any write). Before, verify took a restore lease: on S3 a PUT of
``leases/<random>.json`` (AccessDenied with read-only credentials), on POSIX an open of
``STORE/lock`` for writing (EROFS)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpack.errors import StoreError
from kvpack.store import PackStore

from .helpers import TOKENS, PosixBackend, S3Backend, engine, flip, session_with

KVPACK = [sys.executable, "-m", "kvpack.cli"]


def _kvpack(*args):
    return subprocess.run([*KVPACK, *args], capture_output=True, text=True, timeout=300)


def _objects(client, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
    """Every object under the prefix (leases and the gc epoch included), as the admin sees it."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", ()):
            out[obj["Key"]] = (obj["Size"], obj["ETag"])
    return out


def _damage_one_chunk(store) -> None:
    name = sorted(i.name for i in store.env.list("chunks/"))[0]
    flip(store, name, 5000)


@pytest.mark.parametrize("damaged", [False, True])
def test_verify_on_s3_runs_with_read_only_credentials_and_writes_nothing(seaweed, tmp_path, damaged):
    from kvpack.store.s3 import S3Env

    backend = S3Backend(seaweed)
    store = backend.new(tmp_path)
    session_with(engine(), TOKENS[:600], store)
    if damaged:
        _damage_one_chunk(store)
    key_file = backend.keys[store.path]
    admin = seaweed.client()
    before = _objects(admin, store.env.bucket, store.env.prefix)

    ro_env = S3Env.from_url(store.path, endpoint=seaweed.endpoint, credentials_file=seaweed.readonly_credentials_file)
    ro = PackStore.open(ro_env, root_key_file=key_file)
    with pytest.raises(StoreError) as info:  # the identity really cannot write (else this test proves nothing)
        ro.env.write("probe", b"x")
    assert info.value.category == "io" and "AccessDenied" in info.value.message
    for read_data in (False, True):
        report = ro.verify(read_data=read_data)
        assert report["cuts"] == 3 and report["withdrawn"] == 0
        assert report["ok"] is (not damaged or not read_data), report["problems"]
    assert len(ro.ls()) == 3

    base = ["--endpoint", seaweed.endpoint, "--s3-credentials", seaweed.readonly_credentials_file, "--root-key-file", key_file]
    r = _kvpack("store", "verify", store.path, "--read-data", *base)
    if damaged:
        assert r.returncode == 1 and "problem: cut" in r.stdout, r.stderr
        assert r.stderr.startswith("kvpack: corrupt:") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    else:
        assert r.returncode == 0 and r.stdout.startswith("ok: 3 cuts"), r.stderr
    # repair must write: with read-only credentials it is one clear io line, and changes nothing
    r = _kvpack("store", "repair", store.path, *base)
    assert r.returncode == 1 and r.stderr.startswith("kvpack: io: s3 put") and "AccessDenied" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert _objects(admin, store.env.bucket, store.env.prefix) == before


@pytest.fixture
def read_only_mount(tmp_path):
    """``(source dir, read-only bind mount of it)``; skipped where mounting is not allowed."""
    source, view = tmp_path / "rw", tmp_path / "ro"
    source.mkdir()
    view.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(source), str(view)], capture_output=True).returncode != 0:
        pytest.skip("a read-only bind mount needs root (mount --bind)")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount the bind mount read-only here")
        yield source, view
    finally:
        subprocess.run(["umount", str(view)], capture_output=True)


@pytest.mark.parametrize("damaged", [False, True])
def test_verify_on_a_read_only_mount_writes_nothing(read_only_mount, damaged):
    source, view = read_only_mount
    store = PosixBackend().new(str(source), "s")
    session_with(engine(), TOKENS[:600], store)
    store.gc()  # the lock file exists (gc and saves create it): verify takes it shared, read-only
    assert os.path.exists(os.path.join(store.path, "lock"))
    if damaged:
        _damage_one_chunk(store)
    path = str(view / "s")
    with pytest.raises(OSError):
        open(os.path.join(path, "probe"), "wb")  # the kernel refuses writes here
    ro = PackStore.open(path)
    for read_data in (False, True):
        report = ro.verify(read_data=read_data)
        assert report["cuts"] == 3 and report["ok"] is (not damaged or not read_data), report["problems"]
    r = _kvpack("store", "verify", path, "--read-data")
    assert r.returncode == (1 if damaged else 0), r.stderr
    assert r.stderr.startswith("kvpack: corrupt:") if damaged else r.stdout.startswith("ok: 3 cuts"), r.stderr


def test_verify_takes_no_lock_file_it_would_have_to_create(tmp_path):
    """A store whose lock file is gone (an operator's cleanup) verifies without creating one."""
    store = PosixBackend().new(str(tmp_path))
    session_with(engine(), TOKENS[:600], store)
    os.unlink(os.path.join(store.path, "lock"))
    before = sorted(os.listdir(store.path))
    assert store.verify(read_data=True)["ok"]
    assert sorted(os.listdir(store.path)) == before


def test_verify_waits_for_gc_holding_the_lock_and_gc_waits_for_verify(tmp_path):
    """The read-only shared flock still excludes gc: verify refuses ``locked`` while gc holds
    the lock past the timeout, and a verify in progress keeps gc's exclusive lock away."""
    from kvpack.store.env import GC

    store = PosixBackend().new(str(tmp_path))
    session_with(engine(), TOKENS[:600], store)
    store.env.lock_timeout_s = 0.2
    store.env.gc_wait_s = 0.2  # gc waits gc_wait_s (KVPACK_GC_WAIT_S), everyone else lock_timeout_s
    with store.env.lease(GC):
        with pytest.raises(StoreError) as info:
            store.verify(read_data=False)
        assert info.value.category == "locked"
    with store.env.check_lease():
        with pytest.raises(StoreError) as info:
            with store.env.lease(GC):
                pass
        assert info.value.category == "locked"
    assert store.verify(read_data=False)["ok"]


def test_verify_does_not_report_a_cut_forgotten_and_collected_while_it_ran(monkeypatch, tmp_path):
    """Without a lease (S3) gc may collect a cut forgotten while verify reads it: the objects
    vanish under the check, the index entry is gone too, so it is ``withdrawn``, not a problem."""
    store = PosixBackend().new(str(tmp_path))
    session_with(engine(), TOKENS[:600], store)
    top = max(store.ls(), key=lambda r: r["tokens"])
    mid = bytes.fromhex(top["manifest_id"])
    from kvpack.store import maintenance

    real = maintenance._Checker.cut

    def cut_then_collect(self, node, m):
        if m == mid:  # the operator forgets the cut and gc collects it just before the check reads it
            maintenance.forget(store, mid)
            os.unlink(store.pack_path(mid))
        return real(self, node, m)

    monkeypatch.setattr(maintenance._Checker, "cut", cut_then_collect)
    report = store.verify(read_data=True)
    assert report["ok"] and report["withdrawn"] == 1 and report["cuts"] == 2, report


def test_verify_reports_a_damaged_cut_whose_entry_turned_malformed_while_it_ran(monkeypatch, tmp_path):
    """The entry of a damaged cut is overwritten with garbage while verify checks the cut:
    verify still reports (the cut's problems stand; the malformed entry is not a withdrawal)
    instead of failing with the 'corrupt' refusal re-reading the entry raised."""
    from kvpack.store import maintenance

    store = PosixBackend().new(str(tmp_path))
    session_with(engine(), TOKENS[:600], store)
    top = max(store.ls(), key=lambda r: r["tokens"])
    mid = bytes.fromhex(top["manifest_id"])
    os.unlink(store.logits_path(mid))
    real = maintenance._Checker.cut

    def cut_then_garble(self, node, m):
        problems = real(self, node, m)
        if m == mid:
            store.env.write(f"index/{node.hex()}", b"garbage\n")
        return problems

    monkeypatch.setattr(maintenance._Checker, "cut", cut_then_garble)
    report = store.verify(read_data=False)
    assert not report["ok"] and report["withdrawn"] == 0 and report["cuts"] == 3
    assert any("final-logits" in p for p in report["problems"]), report["problems"]
