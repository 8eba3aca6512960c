"""The failure-mode matrix, storage tier (docs/failure-modes.md), against a real sshd.

The source is a ``kvpack decode-node-api`` process; the destination is an enrolled storage
node reached with ``ssh`` (pinned host key) on a loopback sshd started by the fixture. Crashes
are SIGKILL of the source (failure points) or of the remote shell running the pinned commit
fragment (``kill -KILL $$`` after K steps); every row is then restarted and reconciled.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

import pytest

from kvpack.errors import MigrationError
from kvpack.migrate import machine as M
from kvpack.migrate import storage_tier as ST
from kvpack.migrate.storage_tier import StorageDestination, load_storage_node

from .conftest import Node, remote_files

SID = "sess-store"
MV_STEP = ST.COMMIT_STEPS.index('mv -f -- "$t" "$f"')
N_TOKENS = 600


def source(nodes, sshd, fp: str = "") -> Node:
    return nodes("dec-a", ssh_identity=str(sshd.root / "client_key")).start(fp)


def remote_final(sshd, tid: str) -> bytes | None:
    return remote_files(sshd).get(f"{tid}.bundle")


def check_invariants(a: Node, sshd, tid: str) -> None:
    j = a.journal(tid)
    final = remote_final(sshd, tid)
    committed = final is not None and j is not None and hashlib.sha256(final).hexdigest() == j["sha256"]
    assert a.has_session(SID) or committed, "session lost"
    if j and j["status"] in ("destination_committed", "destination_committed_source_retained", "completed") and j.get("phase") == "export":
        assert committed, "source records a destination commit the storage node does not hold"
    if not a.has_session(SID) and j and j.get("phase", "export") == "export":
        assert committed, "source deleted before the storage node committed"


def export_then_restore(a: Node, sshd, tid: str, digest: str) -> None:
    """After reconciliation: exactly once on storage; then a move restore brings it back."""
    v = a.view(tid)
    assert v["status"] == "completed" and v["source_deleted"] and v["tier"] == "storage" and v["destination"] == "st-a", v
    assert not a.has_session(SID)
    final = remote_final(sshd, tid)
    assert final is not None and hashlib.sha256(final).hexdigest() == v["sha256"] and len(final) == v["bytes"]
    assert f".{tid}.tmp" not in remote_files(sshd)
    assert a.migrate(SID, "local", "move", tid, tier="storage").status_code == 202
    r = a.wait_restore(tid)
    assert r["status"] == "completed", r
    assert a.info(SID).json()["cache_sha256"] == digest and a.has_session(SID)
    assert remote_final(sshd, tid) is None


def run_row(nodes, sshd, fp: str, tid: str, expect: str | None = "transferring") -> Node:
    a = source(nodes, sshd, fp)
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    assert a.migrate(SID, "st-a", "move", tid, tier="storage").status_code == 202
    if fp.split("=")[1].startswith("kill") and "commit_interrupt" not in fp:
        assert a.wait_dead() == -9
        assert a.journal(tid)["status"] == expect
        assert a.has_session(SID)
        check_invariants(a, sshd, tid)
        a.start()
        assert a.info(SID).json()["state"] == "fenced"
        rc, view = a.reconcile_cli(tid)
        assert rc == 0 and view["status"] == "completed", view
    else:
        a.wait_final(tid)
    check_invariants(a, sshd, tid)
    export_then_restore(a, sshd, tid, digest)
    return a


def test_storage_happy_copy_restore(nodes, sshd):
    a = source(nodes, sshd)
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    assert a.migrate(SID, "st-a", "copy", "st-copy", tier="storage").status_code == 202
    v = a.wait_final("st-copy")
    assert v["status"] == "completed" and not v["source_deleted"] and a.has_session(SID)
    assert os.stat(sshd.lane / "session-bundles").st_mode & 0o777 == 0o700
    # restore needs the session gone here, the transfer id, and matching mode
    assert a.migrate(SID, "local", "copy", None, tier="storage").status_code == 400
    assert a.migrate(SID, "local", "move", "st-copy", tier="storage").status_code == 409
    assert a.migrate(SID, "local", "copy", "st-missing", tier="storage").status_code == 404
    assert a.client.delete(f"/v1/sessions/{SID}").status_code == 200
    assert a.migrate(SID, "local", "copy", "st-copy", tier="storage").status_code == 202
    r = a.wait_restore("st-copy")
    assert r["status"] == "source_restored", r
    assert a.info(SID).json()["cache_sha256"] == digest
    assert remote_final(sshd, "st-copy") is not None  # copy semantics: the remote copy stays


def test_storage_row_crash_before_prepare(nodes, sshd):
    run_row(nodes, sshd, "source.before_prepare=kill", "st-before-prepare")


def test_storage_row_crash_after_prepare(nodes, sshd):
    run_row(nodes, sshd, "source.after_prepare=kill", "st-after-prepare")


def test_storage_row_crash_mid_upload_then_resume(nodes, sshd):
    killed_at = 2 * 1024 * 1024
    a = run_row(nodes, sshd, f"source.upload=kill@{killed_at}", "st-mid-upload")
    j = a.journal("st-mid-upload")
    starts = [int(h["note"].split()[2]) for h in j["history"] if h["note"].startswith("upload from ")]
    # first run from 0; the reconciled run from the remote temp file's synced size, not from zero
    assert starts[0] == 0 and len(starts) == 2 and 0 < starts[1] <= killed_at, starts
    print("STORAGE RESUME", {"payload_bytes": j["bytes"], "killed_after_sending": killed_at, "resumed_from": starts[1]})


def test_storage_row_crash_after_upload_before_commit(nodes, sshd):
    run_row(nodes, sshd, "source.after_upload=kill", "st-after-upload")


def test_storage_row_commit_applied_reply_lost(nodes, sshd):
    a = run_row(nodes, sshd, "source.after_remote_commit=lost", "st-reply-lost")
    notes = [h["note"] for h in a.journal("st-reply-lost")["history"]]
    assert any("destination lookup: committed" in n for n in notes), notes


def test_storage_row_source_crash_after_remote_commit(nodes, sshd):
    # the remote commit is durable; the source dies before recording it
    run_row(nodes, sshd, "source.after_remote_commit=kill", "st-after-remote-commit")


def test_storage_row_destination_crash_before_durable_commit(nodes, sshd):
    # the remote shell dies by SIGKILL just before mv (ssh reports a remote killed by a signal as 255): nothing committed, the source is ambiguous
    a = source(nodes, sshd, f"storage.commit_interrupt={MV_STEP}")
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    tid = "st-dest-before"
    assert a.migrate(SID, "st-a", "move", tid, tier="storage").status_code == 202
    v = a.wait_final(tid)
    assert v["status"] == "ambiguous" and "commit: ssh exit 255" in v["last_error"], v
    assert remote_final(sshd, tid) is None and f".{tid}.tmp" in remote_files(sshd)
    assert a.has_session(SID)
    check_invariants(a, sshd, tid)
    a.kill()
    a.start()
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed"
    check_invariants(a, sshd, tid)
    export_then_restore(a, sshd, tid, digest)


def test_storage_row_destination_crash_after_durable_commit(nodes, sshd):
    # the remote shell dies after mv and both syncs, before it could answer: the lookup finds
    # the committed file and the source finishes without guessing
    a = source(nodes, sshd, f"storage.commit_interrupt={len(ST.COMMIT_STEPS) - 1}")
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    tid = "st-dest-after"
    assert a.migrate(SID, "st-a", "move", tid, tier="storage").status_code == 202
    v = a.wait_final(tid)
    assert v["status"] == "completed", v
    notes = [h["note"] for h in a.journal(tid)["history"]]
    assert any("commit: ssh exit 255" in n and "destination lookup: committed" in n for n in notes), notes
    a.kill()
    a.start()
    export_then_restore(a, sshd, tid, digest)


def test_storage_row_source_crash_after_destination_commit_before_delete(nodes, sshd):
    run_row(nodes, sshd, "source.after_destination_committed=kill", "st-src-after-commit", expect="destination_committed")


def test_storage_row_source_delete_fails(nodes, sshd):
    a = source(nodes, sshd, "source.delete=error")
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    tid = "st-delete-fails"
    assert a.migrate(SID, "st-a", "move", tid, tier="storage").status_code == 202
    v = a.wait_final(tid)
    assert v["status"] == "destination_committed_source_retained" and "source.delete" in v["last_error"]
    assert a.has_session(SID) and a.decode(SID, 1).status_code == 409
    check_invariants(a, sshd, tid)
    a.kill()
    a.start()
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed"
    export_then_restore(a, sshd, tid, digest)


def test_storage_row_remote_delete_fails_after_move_restore(nodes, sshd):
    a = source(nodes, sshd, "source.remote_delete=error")
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    tid = "st-remote-delete"
    assert a.migrate(SID, "st-a", "move", tid, tier="storage").status_code == 202
    assert a.wait_final(tid)["status"] == "completed"
    assert a.migrate(SID, "local", "move", tid, tier="storage").status_code == 202
    v = a.wait_restore(tid)
    assert v["status"] == "source_restored_remote_retained" and "source.remote_delete" in v["last_error"], v
    # restored and live here; the remote copy is retained and reported, not silently dropped
    assert a.info(SID).json() == {**a.info(SID).json(), "state": "live", "cache_sha256": digest}
    assert remote_final(sshd, tid) is not None
    a.kill()
    a.start()
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed", view
    assert remote_final(sshd, tid) is None and a.has_session(SID)


# -- the pinned commit fragment, interrupted at every step and re-run ----------------------------


def record(tid: str, size: int, sha256: str) -> M.TransferRecord:
    """An outgoing storage-tier record as the orchestrator would hand it to the tier."""
    return replace(M.new_outgoing(tid, "sess-direct", "copy", "storage", "st-a", now=0.0), bytes=size, sha256=sha256)


@pytest.fixture
def direct(sshd, cluster, tmp_path):
    node = load_storage_node(str(cluster), "st-a")
    return StorageDestination(node, str(sshd.root / "client_key"), str(tmp_path / "ssh"))


@pytest.mark.slow
def test_remote_commit_script_interrupted_at_every_step_and_rerun(direct, sshd):
    """For every K, the remote shell running the pinned commit fragment is SIGKILLed after K
    steps; the lookup then tells committed from not, and re-running the fragment finishes (or
    re-verifies and exits clean), twice. The uploaded temp file is placed on the storage node's
    disk directly: the upload is covered by the rows above, the fragment is what is tested."""
    payload = os.urandom(300_000)
    bundles = sshd.lane / "session-bundles"
    direct.prepare(record("intr", 1, ""))
    for k in range(len(ST.COMMIT_STEPS) + 1):
        rec = record(f"intr-{k}", len(payload), hashlib.sha256(payload).hexdigest())
        (bundles / f".intr-{k}.tmp").write_bytes(payload)
        killed = "\n".join((*ST.COMMIT_STEPS[:k], "kill -KILL $$")).format(**direct.vars(rec))
        with pytest.raises(MigrationError, match="ssh exit 255"):
            direct.run(killed, what="interrupted commit")
        status, _ = direct.lookup(rec)
        assert status == ("committed" if k > MV_STEP else "uploaded"), (k, status)
        assert direct.commit(rec) == "committed"  # re-run: completes, or re-verifies and exits clean
        assert direct.commit(rec) == "committed"  # and again (idempotent)
        files = remote_files(sshd)
        assert files[f"intr-{k}.bundle"] == payload and f".intr-{k}.tmp" not in files
        (bundles / f"intr-{k}.bundle").unlink()


def test_remote_commit_refuses_other_bytes(direct, sshd, tmp_path):
    payload = b"x" * 5000
    (tmp_path / "p").write_bytes(payload)
    rec = record("bad-final", len(payload), hashlib.sha256(payload).hexdigest())
    direct.prepare(rec)
    direct.upload(rec, str(tmp_path / "p"), 0)
    assert direct.commit(rec) == "committed"
    (sshd.lane / "session-bundles" / "bad-final.bundle").write_bytes(b"y" * 5000)
    with pytest.raises(MigrationError, match="exit 4"):
        direct.commit(rec)
    with pytest.raises(MigrationError, match="other bytes"):
        direct.lookup(rec)
    # a temp file with wrong content never becomes final
    rec2 = record("bad-tmp", len(payload), "0" * 64)
    direct.prepare(rec2)
    direct.upload(rec2, str(tmp_path / "p"), 0)
    with pytest.raises(MigrationError, match="exit 5"):
        direct.commit(rec2)
    assert "bad-tmp.bundle" not in remote_files(sshd)


def test_host_key_pin_is_enforced(sshd, cluster, tmp_path):
    import subprocess

    node = load_storage_node(str(cluster), "st-a")
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = node.__class__(**{**node.__dict__, "host_key": " ".join((other.with_suffix(".pub")).read_text().split()[:2])})
    d = StorageDestination(wrong, str(sshd.root / "client_key"), str(tmp_path / "ssh"))
    with pytest.raises(MigrationError, match="ssh exit 255"):
        d.run("echo hi")
    good = StorageDestination(node, str(sshd.root / "client_key"), str(tmp_path / "ssh2"))
    assert good.run("echo hi") == b"hi\n"
