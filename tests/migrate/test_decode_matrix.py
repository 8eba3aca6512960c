"""The failure-mode matrix, decode tier (docs/failure-modes.md): every row runs for real.

Two ``kvpack decode-node-api`` processes over HTTPS on loopback. A failure point makes the
process that would act next die by SIGKILL at the named step (or injects the fault); the
test then restarts what died and reconciles (``kvpack transfer reconcile`` as a subprocess),
checking at every stage the invariants:

* the session exists in a committed place (source file or a destination ``committed``);
* the source is never deleted before the destination's durable commit is on record;
* after reconciliation it exists exactly once (move) and is live on one node only;
* the statuses are the ones D.4 specifies.
"""

from __future__ import annotations

import json


from .conftest import Node

SID = "sess-matrix"
N_TOKENS = 600  # ~4.9 MB sealed payload: five 1 MiB upload checkpoints


def dest_status(b: Node, tid: str) -> str | None:
    j = b.journal(tid)
    return j["status"] if j else None


def check_invariants(a: Node, b: Node, sid: str, tid: str) -> None:
    """Never lost, never deleted early (read from the files on disk, whatever runs)."""
    ja = a.journal(tid)
    b_committed = dest_status(b, tid) == "committed"
    assert a.has_session(sid) or b_committed, "session lost: not at the source and not committed at the destination"
    if not a.has_session(sid):
        assert b_committed, "source deleted before the destination committed"
        assert ja and ja["status"] in ("destination_committed", "destination_committed_source_retained", "completed")
    if ja and ja["status"] in ("destination_committed", "destination_committed_source_retained", "completed"):
        assert b_committed, f"source records {ja['status']} but the destination has not committed"


def check_settled_move(a: Node, b: Node, sid: str, tid: str, digest: str) -> dict:
    """After reconciliation: exactly once, at the destination, live there only, bit-identical."""
    v = a.view(tid)
    assert v["status"] == "completed" and v["source_deleted"] is True, v
    assert "last_error" not in v
    assert not a.has_session(sid) and a.info(sid).status_code == 404
    assert a.decode(sid, 1).status_code == 404
    assert b.has_session(sid) and dest_status(b, tid) == "committed"
    info = b.info(sid).json()
    assert info["cache_sha256"] == digest and info["state"] == "live"
    assert b.decode(sid, 2).status_code == 200
    return v


def start_pair(nodes, *, a_fp: str = "", b_fp: str = "") -> tuple[Node, Node, str]:
    a = nodes("dec-a").start(a_fp)
    b = nodes("dec-b").start(b_fp)
    digest = a.create(SID, N_TOKENS)["cache_sha256"]
    return a, b, digest


def crash_source_then_reconcile(nodes, failpoint: str, tid: str, expect_a: str, expect_b: str | None) -> tuple[Node, Node]:
    a, b, digest = start_pair(nodes, a_fp=failpoint)
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    assert a.wait_dead() == -9  # SIGKILL at the failure point
    assert a.journal(tid)["status"] == expect_a
    assert dest_status(b, tid) == expect_b
    assert a.has_session(SID)  # not deleted: the destination has not committed
    check_invariants(a, b, SID, tid)
    a.start()
    # restarted source: the session is fenced by the unfinished move, not live
    assert a.info(SID).json()["state"] == "fenced"
    assert a.decode(SID, 1).status_code == 409
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed", view
    check_invariants(a, b, SID, tid)
    check_settled_move(a, b, SID, tid, digest)
    return a, b


def test_happy_move_and_copy(nodes):
    a, b, digest = start_pair(nodes)
    assert a.migrate(SID, b.url, "copy", "xfer-copy").status_code == 202
    v = a.wait_final("xfer-copy")
    assert v["status"] == "completed" and v["source_deleted"] is False and v["bytes"] > 0 and len(v["sha256"]) == 64
    assert list(v) == ["id", "session_id", "direction", "mode", "tier", "destination", "status", "bytes", "sha256", "source_deleted"]
    # copy: the session runs on both nodes, and both continue identically (bit-exact adoption)
    da, db = a.decode(SID, 5).json(), b.decode(SID, 5).json()
    assert da["tokens"] == db["tokens"] and da["logits_sha256"] == db["logits_sha256"]
    bv = b.view("xfer-copy")
    assert bv["direction"] == "incoming" and bv["status"] == "committed" and bv["destination"] == "kvpack-decode-source"
    # move to a third node
    c = nodes("dec-c").start()
    digest2 = a.info(SID).json()["cache_sha256"]
    assert a.migrate(SID, c.url, "move", "xfer-move").status_code == 202
    v = a.wait_final("xfer-move")
    check_settled_move(a, c, SID, "xfer-move", digest2)
    # a reused transfer id bound to the same (session, destination, mode) returns the view
    r = a.migrate(SID, c.url, "move", "xfer-move")
    assert r.status_code == 202 and r.json()["status"] == "completed"
    # ... bound to anything else: 409 conflict
    r = a.migrate(SID, b.url, "move", "xfer-move")
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict"


def test_row_crash_before_prepare(nodes):
    crash_source_then_reconcile(nodes, "source.before_prepare=kill", "xfer-before-prepare", "transferring", None)


def test_row_crash_after_prepare(nodes):
    crash_source_then_reconcile(nodes, "source.after_prepare=kill", "xfer-after-prepare", "transferring", "prepared")


def test_row_crash_mid_upload_then_resume(nodes, record_property):
    total_hint = 2 * 1024 * 1024 + 512 * 1024
    a, b = crash_source_then_reconcile(nodes, f"source.upload=kill@{total_hint}", "xfer-mid-upload", "transferring", "prepared")
    hist = b.journal("xfer-mid-upload")["history"]
    notes = [h["note"] for h in hist]
    resumed = [n for n in notes if n.startswith("payload verified") and "resumed from" in n]
    assert resumed, notes
    offset = int(resumed[0].split("resumed from ")[1].rstrip(")"))
    total = b.journal("xfer-mid-upload")["bytes"]
    # the destination resumed from a durable offset at least one checkpoint in, and not past the crash
    assert 1024 * 1024 <= offset <= total_hint < total
    figures = {"payload_bytes": total, "killed_after_sending": total_hint, "durable_offset": offset, "resent_bytes": total - offset, "saved_vs_restart": offset}
    record_property("resume_figures", json.dumps(figures))
    print("RESUME FIGURES", json.dumps(figures))


def test_row_crash_after_upload_before_commit(nodes):
    crash_source_then_reconcile(nodes, "source.after_upload=kill", "xfer-after-upload", "transferring", "uploaded")


def test_row_commit_applied_reply_lost(nodes):
    a, b, digest = start_pair(nodes, a_fp="source.commit_reply=lost")
    tid = "xfer-reply-lost"
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    a.wait_final(tid)
    # the error was reconciled by a lookup of the destination's status, not by a guess
    notes = [h["note"] for h in a.journal(tid)["history"]]
    assert any("commit reply lost" in n and "destination lookup: committed" in n for n in notes), notes
    check_settled_move(a, b, SID, tid, digest)


def test_row_destination_crash_before_durable_commit(nodes):
    a, b, digest = start_pair(nodes, b_fp="dest.commit.before_journal=kill")
    tid = "xfer-dest-before"
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    assert b.wait_dead() == -9
    v = a.wait_final(tid)
    assert v["status"] == "ambiguous" and "lookup failed" in v["last_error"], v
    assert dest_status(b, tid) == "uploaded" and not b.has_session(SID)
    assert a.has_session(SID) and a.info(SID).json()["state"] == "fenced"
    check_invariants(a, b, SID, tid)
    b.start()
    assert b.view(tid)["status"] == "uploaded"
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed"
    check_settled_move(a, b, SID, tid, digest)


def test_row_destination_crash_after_durable_commit(nodes):
    a, b, digest = start_pair(nodes, b_fp="dest.commit.after_journal=kill")
    tid = "xfer-dest-after"
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    assert b.wait_dead() == -9
    v = a.wait_final(tid)
    assert v["status"] == "ambiguous", v
    j = b.journal(tid)
    assert j["status"] == "committed" and j["installed"] is False and not b.has_session(SID)
    assert a.has_session(SID)
    check_invariants(a, b, SID, tid)
    b.start()  # recovery installs the committed payload
    assert b.has_session(SID) and b.journal(tid)["installed"] is True
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed"
    check_settled_move(a, b, SID, tid, digest)


def test_row_source_crash_after_destination_commit_before_delete(nodes):
    a, b, digest = start_pair(nodes, a_fp="source.after_destination_committed=kill")
    tid = "xfer-src-after-commit"
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    assert a.wait_dead() == -9
    assert a.journal(tid)["status"] == "destination_committed"
    assert a.has_session(SID) and b.has_session(SID)
    a.start()
    # both hold the bytes, but only the destination runs it: the source is fenced
    assert a.info(SID).json()["state"] == "fenced" and a.decode(SID, 1).status_code == 409
    assert b.info(SID).json()["state"] == "live"
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed"
    check_settled_move(a, b, SID, tid, digest)


def test_row_source_delete_fails(nodes):
    a, b, digest = start_pair(nodes, a_fp="source.delete=error")
    tid = "xfer-delete-fails"
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    v = a.wait_final(tid)
    assert v["status"] == "destination_committed_source_retained" and v["source_deleted"] is False
    assert "injected failure at source.delete" in v["last_error"]
    assert a.has_session(SID) and a.decode(SID, 1).status_code == 409  # retained, never live
    check_invariants(a, b, SID, tid)
    a.kill()
    a.start()
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed"
    check_settled_move(a, b, SID, tid, digest)


def test_row_destination_crash_mid_upload_durable_offset_lag(nodes, record_property):
    """B is SIGKILLed mid-upload (after writing ``kill_at`` bytes): its durable offset trails
    what it had written by less than one checkpoint (1 MiB in these nodes) plus one network read
    (<= 256 KiB), and the reconciled transfer resumes from it."""
    kill_at = 3 * 1024 * 1024 + 300 * 1024
    a, b, digest = start_pair(nodes, b_fp=f"dest.upload=kill@{kill_at}")
    tid = "xfer-dest-mid-upload"
    assert a.migrate(SID, b.url, "move", tid).status_code == 202
    assert b.wait_dead() == -9
    written = (b.home / "session-transfers" / f".{tid}.incoming").stat().st_size
    received = b.journal(tid)["received"]
    lag = written - received
    assert written >= kill_at and 0 <= lag < 1024 * 1024 + 256 * 1024, (written, received)
    assert a.wait_final(tid)["status"] == "ambiguous" and a.has_session(SID)
    check_invariants(a, b, SID, tid)
    b.start()
    rc, view = a.reconcile_cli(tid)
    assert rc == 0 and view["status"] == "completed", view
    notes = [h["note"] for h in b.journal(tid)["history"]]
    assert any(n == f"payload verified ({b.journal(tid)['bytes']} bytes, resumed from {received})" for n in notes), notes
    check_settled_move(a, b, SID, tid, digest)
    figures = {"written_at_crash": written, "durable_offset": received, "lag_bytes": lag, "checkpoint_bytes": 1024 * 1024}
    record_property("dest_crash_figures", json.dumps(figures))
    print("DEST CRASH FIGURES", json.dumps(figures))
