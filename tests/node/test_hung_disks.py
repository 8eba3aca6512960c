"""Hung (not failing) disks under the node tier (issue 14: every wait has a deadline).

A disk that stops answering -- an fsync that never returns -- is simulated with the fault
layer's hang mode (``FaultyOps(hang_ops=...)``): the writing thread really blocks in that step
until the test releases it.

* receipts: a receipt is an audit record, the replay ledger the safety record. With the
  receipts disk hung, a committed transfer still commits and both nodes still answer, each
  receipt ``pending``; the ledger does not latch; the node keeps serving; at most
  ``max_pending`` receipts are held in memory (the rest dropped and counted); once the disk
  answers the pending receipts are written.
* replay ledger: with its volume hung in a reservation's fsync, that reservation and every
  later one are refused ``ledger_unavailable`` within the ledger's deadline (not blocked on its
  lock), nothing is installed or acknowledged, and the node keeps serving other work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import pytest

from kvpack.durable import atomic_write
from kvpack.errors import KvpackError, ProtocolError, UsageError
from kvpack.node import receipts as receipts_mod
from kvpack.node.ledger_gate import LedgerGate, LedgerGuard
from kvpack.node.producer import ProducerNode
from kvpack.node.receipts import ReceiptBudget, ReceiptWriter
from kvpack.node import receiver as receiver_mod
from kvpack.node.receiver import ReceiverNode
from kvpack.security.ledger import ReplayLedger
from kvpack.security.probe import ProbeResult
from kvpack.store import PackStore
from kvpack.testing.faults import FaultyOps

from .helpers import http_get, receipts
from .test_nodes_arrays import PROMPT, Nodes, reference

#: a hang guard, not a timing assert: the old code blocked for as long as the disk did
GUARD_S = 60.0


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".json") and not n.startswith("."))


def test_a_hung_receipts_disk_holds_at_most_the_budget_and_writes_it_when_it_answers(tmp_path):
    hung = FaultyOps(hang_ops={"fsync"})
    w = ReceiptWriter(str(tmp_path), ReceiptBudget(wait_s=0.05, max_pending=4), ops=hung)
    first = w.record({"role": "receiver", "verdict": "committed", "n": 0})
    assert hung.hanging.wait(GUARD_S)  # the writer thread is blocked in the receipt's fsync
    assert first["receipt_state"] == "pending" and first["receipt_path"].startswith(str(tmp_path))
    rest = [w.record({"role": "receiver", "verdict": "committed", "n": i}) for i in range(1, 11)]
    states = [r["receipt_state"] for r in rest]
    assert states == ["pending"] * 3 + ["dropped"] * 7, states  # 4 held in memory, no more
    assert w.stats()["pending"] == 4 and w.dropped == 7 and w.deferred == 4
    assert _files(tmp_path) == []  # nothing on disk yet
    hung.release()  # the disk answers again
    assert w.drain(GUARD_S)
    names = _files(tmp_path)
    assert names == sorted(os.path.basename(r["receipt_path"]) for r in [first, *rest[:3]])
    assert w.late == 4 and w.written == 4 and w.stats()["pending"] == 0
    assert w.write({"role": "receiver", "verdict": "committed"}) is not None  # waits again once healthy
    w.close()


def test_a_hung_receipts_disk_delays_no_commit_and_latches_nothing(tmp_path, monkeypatch):
    n = Nodes(tmp_path / "n")
    try:
        for node in (n.receiver, n.producer):
            node.receipts.budget = dataclasses.replace(node.receipts.budget, wait_s=0.2)
        hung = FaultyOps(hang_ops={"fsync"})
        # every receipt write of both nodes goes through the hung layer (the old writer too)
        monkeypatch.setattr(receipts_mod, "atomic_write", lambda path, data, **kw: atomic_write(path, data, **{**kw, "ops": hung}))
        t, box = _in_thread(lambda: n.receiver.generate(PROMPT, 8))
        t.join(GUARD_S)
        hung_for_the_guard = t.is_alive()
        if hung_for_the_guard:
            hung.release()
            t.join(GUARD_S)
        assert not hung_for_the_guard, "a hung receipts disk held the request"
        assert "error" not in box, box.get("error")
        res = box["value"]
        assert hung.hanging.is_set()  # the receipts really were stuck
        assert (res["tokens"], res["logits_sha256"]) == reference(n.engine, PROMPT)
        assert res["transfer"]["receipt_state"] == "pending" and res["transfer"]["producer_receipt"]["prefill_tokens"] == len(PROMPT) - 1
        assert n.receiver.ledger.degraded is None  # an audit record never latches the safety record
        # the node keeps serving while the disk still hangs
        t2, box2 = _in_thread(lambda: n.receiver.generate(PROMPT[:400] + [9, 9], 4))
        t2.join(GUARD_S)
        assert not t2.is_alive() and "value" in box2, box2
        assert receipts(n.rdir) == [] and not [r for r in receipts(n.pdir) if r.get("verdict") == "committed"]
        assert 'kvpack_receipts_deferred_total{role="receiver"} 2.0' in http_get(n.receiver.metrics.port)
        hung.release()  # the disk answers: the pending receipts are written
        assert n.receiver.receipts.drain(GUARD_S) and n.producer.receipts.drain(GUARD_S)
        committed = [r for r in receipts(n.rdir) if r["verdict"] == "committed"]
        assert len(committed) == 2 and n.receiver.receipts.late == 2
        assert len([r for r in receipts(n.pdir) if r.get("verdict") == "committed"]) == 2
    finally:
        n.stop()


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


def _probe_ok(path):
    return ProbeResult(os.path.dirname(os.path.abspath(path)), (0.5,))


def _join_all(threads, guard_s=GUARD_S):
    end = time.monotonic() + guard_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def test_a_hung_ledger_write_refuses_it_and_every_later_reservation_within_the_deadline(tmp_path):
    path = str(tmp_path / "ledger.json")
    ops = FaultyOps()
    ledger = ReplayLedger.open(path, ops=ops, strict=False, io_deadline_s=0.2)
    guard = LedgerGuard(ledger, reprobe_interval_s=0.0, probe=_probe_ok)
    LedgerGate(guard).reserve("k", 1, 1)
    on_disk = (_read(path), _read(path + ".witness"))
    ops.hang_ops = {"fsync"}  # the ledger volume stops answering
    outcomes: dict[int, str] = {}

    def reserve(generation):
        try:
            LedgerGate(guard).reserve("k", 1, generation)
            outcomes[generation] = "reserved"
        except KvpackError as exc:
            outcomes[generation] = exc.category

    first = threading.Thread(target=reserve, args=(2,), daemon=True)
    first.start()
    assert ops.hanging.wait(GUARD_S)  # a reservation is blocked in the ledger's fsync
    later = [threading.Thread(target=reserve, args=(g,), daemon=True) for g in (3, 4, 5)]
    for t in later:
        t.start()
    stuck = _join_all([first, *later])
    if stuck:
        ops.release()
        _join_all(stuck)
    assert not stuck, "a hung ledger write held reservations with no deadline"
    assert outcomes == {2: "ledger_unavailable", 3: "ledger_unavailable", 4: "ledger_unavailable", 5: "ledger_unavailable"}
    assert "did not return" in (ledger.degraded or "") and ledger.io_outstanding
    # nothing reserved: in memory (read without the lock: a status page never waits) and on disk
    assert ledger.snapshot() == {"k:1": 1} and (_read(path), _read(path + ".witness")) == on_disk
    with pytest.raises(ProtocolError) as info:  # admissions refuse too, with the ledger's category
        LedgerGate(guard).admit("k", 1, 6)
    assert info.value.category == "ledger_unavailable"
    assert "has not returned" in (guard.last_probe_error or "")  # no probe of a hung volume
    ops.release()  # the disk answers: the hung write completes (watermark 2 reaches the disk)
    assert ledger.wait_io(GUARD_S)
    LedgerGate(guard).reserve("k", 1, 7)  # a fresh probe heals the latch; the re-read keeps 2
    assert ledger.degraded is None and guard.recoveries == 1
    assert json.loads(_read(path))["highest_generation"] == {"k:1": 7}
    ledger.close()


class _HungLedgerNodes(Nodes):
    def __init__(self, tmp, ops):
        self.hung_ops = ops
        super().__init__(tmp)

    def _receiver(self, advertised_port=None):
        return ReceiverNode(
            self.rcfg, self.engine, receipts_dir=self.rdir, check_volume=False, tls_fronts=0, ledger_ops=self.hung_ops, ledger_deadline_s=0.3
        ).start()


def test_a_hung_replay_ledger_volume_refuses_with_its_category_and_installs_nothing(tmp_path):
    ops = FaultyOps()
    n = _HungLedgerNodes(tmp_path / "n", ops)
    try:
        n.receiver.generate(PROMPT, 4)  # a live session and a watermark to keep intact
        before, ledger_before = n.snapshot(), n.receiver.ledger.snapshot()
        producer_committed = len([r for r in receipts(n.pdir) if r.get("verdict") == "committed"])
        ops.hang_ops = {"fsync"}  # the ledger volume stops answering
        for prompt in (list(range(2, 600)), list(range(3, 500))):
            t, box = _in_thread(lambda p=prompt: n.receiver.generate(p, 4))
            if _join_all([t]):
                ops.release()
                _join_all([t])
                pytest.fail("a hung ledger volume held the request with no deadline")
            err = box.get("error")
            assert isinstance(err, ProtocolError) and err.category == "ledger_unavailable", box
            assert n.snapshot() == before and n.receiver.ledger.snapshot() == ledger_before  # nothing installed or reserved
        assert ops.hanging.is_set() and n.receiver.ledger.io_outstanding
        # the node keeps serving other work: its status page reads the ledger without waiting
        page = http_get(n.receiver.metrics.port, "/status.json")
        assert " 200 " in page.splitlines()[0] and '"degraded"' in page
        # nothing acknowledged: the producer committed nothing more
        assert n.producer.receipts.drain(GUARD_S)
        assert len([r for r in receipts(n.pdir) if r.get("verdict") == "committed"]) == producer_committed
        refused = [r for r in receipts(n.rdir) if r["verdict"] == "refused"]
        # the first at its reservation (hung), the second at its begin (the ledger latched)
        assert [(r["reason"], r.get("phase")) for r in refused] == [("ledger_unavailable", "admitted"), ("ledger_unavailable", "begin")], refused
        ops.release()  # the disk answers: a fresh probe heals the ledger, no restart
        assert n.receiver.ledger.wait_io(GUARD_S)
        res = n.receiver.generate(list(range(2, 600)), 4)
        assert (res["tokens"], res["logits_sha256"]) == reference(n.engine, list(range(2, 600)), 4)
        assert n.receiver.ledger.degraded is None
    finally:
        ops.release()
        n.stop()


class _HungGenerationNodes(Nodes):
    def __init__(self, tmp, ops):
        self.hung_ops = ops
        super().__init__(tmp)

    def _producer(self):
        return ProducerNode(self.pcfg, self.producer_engine, receipts_dir=self.pdir, prefill_slots=2, ledger_ops=self.hung_ops, ledger_deadline_s=0.3).start()


def test_a_hung_generation_ledger_fails_each_job_within_its_deadline_and_frees_its_slot(tmp_path):
    ops = FaultyOps()
    n = _HungGenerationNodes(tmp_path / "n", ops)
    try:
        n.receiver.generate(PROMPT, 4)
        before, ledger_before = n.snapshot(), n.receiver.ledger.snapshot()
        with open(n.pcfg.generation_ledger, "rb") as fh:
            on_disk = fh.read()
        ops.hang_ops = {"fsync"}  # the producer's ledger volume stops answering
        for i in range(4):  # more requests than prefill slots: none is left holding one
            t, box = _in_thread(lambda i=i: n.receiver.generate(list(range(2 + i, 500)), 4))
            if _join_all([t]):
                ops.release()
                _join_all([t])
                pytest.fail("a hung generation ledger held the job with no deadline")
            err = box.get("error")
            assert isinstance(err, KvpackError) and "ledger_unavailable" in str(err), box
            assert n.snapshot() == before and n.receiver.ledger.snapshot() == ledger_before  # nothing installed or reserved
        with open(n.pcfg.generation_ledger, "rb") as fh:
            assert fh.read() == on_disk  # the hung write never landed
        ops.release()  # the disk answers: the next job takes fresh generations and commits
        _join_all([t for t in threading.enumerate() if t.name == "kvpack-generation-io"])
        res = n.receiver.generate(list(range(2, 500)), 4)
        assert (res["tokens"], res["logits_sha256"]) == reference(n.engine, list(range(2, 500)), 4)
        assert res["transfer"]["generation"] == max(ledger_before.values()) + 2  # the hung write's generation is skipped, never used
    finally:
        ops.release()
        n.stop()


class _HungStoreNodes(Nodes):
    def __init__(self, tmp, ops):
        self.hung_ops = ops
        super().__init__(tmp)

    def _producer(self):
        path = os.path.join(self.tmp, "pstore")
        PackStore.init(path)
        return ProducerNode(self.pcfg, self.producer_engine, receipts_dir=self.pdir, store=PackStore.open(path, ops=self.hung_ops)).start()


def test_a_hung_producer_store_holds_no_control_connection_per_job(tmp_path):
    """The producer saves a committed job's checkpoints to its store after the answer went
    out. With the store's disk hung, those saves never return: they must hold one thread, not
    the job's control connection (each one counts against the receiver's 64 per-peer slots)."""
    ops = FaultyOps(hang_ops={"fsync"})
    n = _HungStoreNodes(tmp_path / "n", ops)
    try:
        prompts = [PROMPT, list(range(3, 700)), list(range(4, 700))]
        for prompt in prompts:
            t, box = _in_thread(lambda p=prompt: n.receiver.generate(p, 4))
            if _join_all([t]):
                ops.release()
                _join_all([t])
                pytest.fail("a hung producer store held the request")
            assert "value" in box, box
            assert (box["value"]["tokens"], box["value"]["logits_sha256"]) == reference(n.engine, prompt, 4)
        assert ops.hanging.is_set()  # a checkpoint save really is stuck in the store's fsync
        listener = n.producer.listener
        end = time.monotonic() + GUARD_S
        while listener.counts.authenticated and time.monotonic() < end:
            time.sleep(0.05)  # the receiver closed each control connection after its answer
        assert listener.counts.authenticated == 0, "control connections held by stuck store saves"
    finally:
        ops.release()
        n.stop()


def test_the_status_page_never_reads_the_receipts_disk(tmp_path):
    """A receipt-named file whose read never returns (a FIFO nobody writes: what a hung
    receipts disk does to a reader) must not hold the status page: the history is read once,
    when the writer opens, and only from regular files."""
    from kvpack.node.status import _recent

    d = str(tmp_path / "receipts")
    os.makedirs(d)
    w0 = ReceiptWriter(d)
    kept = w0.write({"role": "receiver", "verdict": "committed", "request_id": "r-1"})
    w0.close()
    fifo = os.path.join(d, f"{time.time_ns()}-receiver-committed-000000.json")  # the newest
    os.mkfifo(fifo)
    t, box = _in_thread(lambda: ReceiptWriter(d))
    assert not _join_all([t]) and "value" in box, box
    w = box["value"]
    w.recent.clear()  # a node whose history is empty (before: the page then read the directory)
    t, box = _in_thread(lambda: _recent(w))
    stuck = _join_all([t], 20.0)
    if stuck:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # lets the reader go
    assert not stuck, "the status page read a receipt that never answers"
    assert box["value"] == []
    w2 = ReceiptWriter(d)
    assert [r["request_id"] for r in w2.recent] == ["r-1"] and os.path.basename(kept or "").startswith(w2.recent[0]["receipt"])
    assert os.path.exists(fifo)  # passed over, not read


def test_a_refusal_reports_its_own_category_while_its_receipt_is_slow(tmp_path, monkeypatch):
    """The refusing stripe fails the shared install at once, then writes its receipt, then
    tells the request why. The request's waiter sees the failed install meanwhile: it must
    still report the refusal's own category (here ``ledger_unavailable``), not ``aborted``."""
    ops = FaultyOps()
    n = _HungLedgerNodes(tmp_path / "n", ops)
    receipts_hung = FaultyOps(hang_ops={"fsync"})
    try:
        n.receiver.generate(PROMPT, 4)
        n.receiver.receipts.budget = dataclasses.replace(n.receiver.receipts.budget, wait_s=0.5)
        monkeypatch.setattr(receipts_mod, "atomic_write", lambda path, data, **kw: atomic_write(path, data, **{**kw, "ops": receipts_hung}))
        ops.hang_ops = {"fsync"}
        t, box = _in_thread(lambda: n.receiver.generate(list(range(2, 600)), 4))
        assert not _join_all([t]), "the request hung"
        err = box.get("error")
        assert isinstance(err, ProtocolError) and err.category == "ledger_unavailable", box
    finally:
        ops.release()
        receipts_hung.release()
        n.stop()


def test_the_receipt_wait_and_ledger_deadline_are_operator_settings(tmp_path):
    from kvpack.cli import build_parser

    cfg = tmp_path / "node.json"
    cfg.write_text("{}")
    for role in ("receiver", "producer"):
        args = build_parser().parse_args([role, "--config", str(cfg), "--receipt-wait", "250ms", "--ledger-deadline", "2"])
        assert (args.receipt_wait, args.ledger_deadline) == (0.25, 2.0)
        with pytest.raises(UsageError):  # a deadline is > 0
            build_parser().parse_args([role, "--config", str(cfg), "--ledger-deadline", "0"])
    node = ProducerNode(None, receipts_dir=str(tmp_path / "r"), receipt_wait_s=0.25, ledger_deadline_s=2.0)
    assert node.receipts.budget.wait_s == 0.25 and node.ledger_deadline_s == 2.0
    node.receipts.close()


def test_a_written_receipt_is_on_the_status_page_and_in_the_log_when_write_returns(tmp_path):
    """Whoever hears 'written' (a reply, then a look at the status page or the log) finds the
    receipt there, even behind a slow log handler."""
    import logging

    seen: list[str] = []

    class Slow(logging.Handler):
        def emit(self, record):
            time.sleep(0.2)  # a log shipper that takes its time
            seen.append(getattr(record, "msg", ""))

    handler = Slow()
    logger = logging.getLogger("kvpack.node.receipts")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        w = ReceiptWriter(str(tmp_path))
        path = w.write({"role": "receiver", "verdict": "committed", "request_id": "r-9"})
        assert path is not None
        assert len(seen) == 1 and w.recent[-1]["request_id"] == "r-9"
        w.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.mark.parametrize("step", ["probe", "open"])
def test_a_hung_ledger_volume_refuses_the_start_instead_of_hanging_it(tmp_path, step, monkeypatch):
    from kvpack.errors import SecurityError
    from kvpack.node.common import load_engine

    from .helpers import Enrolled

    enrolled = Enrolled(str(tmp_path / "cluster"), load_engine("arrays:4:2:8"))
    cfg = enrolled.receiver_config()
    hung = FaultyOps(hang_ops={"fsync"})

    monkeypatch.setattr(receiver_mod, "OPEN_GRACE_S", 0.5)

    def node(ops):
        kw = {"ledger_ops": ops, "ledger_deadline_s": 0.3, "ledger_max_tail_ms": 5000.0 if ops is not hung else 10.0}
        # "open": the volume answers the probe (skipped), then hangs while the ledger opens
        return ReceiverNode(cfg, None, receipts_dir=str(tmp_path / "r"), metrics_port=None, tls_fronts=0, check_volume=step == "probe", **kw)

    try:
        first = node(hung)
        t, box = _in_thread(first.bind)
        assert not _join_all([t]), "the start hung on the ledger volume"
        err = box.get("error")
        assert isinstance(err, SecurityError) and err.category == "volume" and "did not" in err.message, box
        assert first.data_port is None and not first.links  # nothing bound, no ledger lock kept
    finally:
        hung.release()
    if step == "open":  # the late open released its lock
        assert hung.hanging.is_set()
        _join_all([t for t in threading.enumerate() if t.name == "kvpack-ledger-open"])
    second = node(FaultyOps()).bind()  # the volume answers again: the same config starts
    second.stop()
