"""Receipts and logs that cannot take a node down, and a replay ledger that heals.

* receipt fields are bounded before they are written (a 64 MiB request_id is not echoed);
* the receipt directory stays within its byte/file budget (the oldest are rotated out);
* a failing receipt write returns None and is counted: it never raises;
* refusal receipts beyond the rate are counted in the refusal log, which stays size-capped;
* a ledger latched by a failed reservation refuses as ``ledger_unavailable`` (never
  ``replay``) and clears itself once a fresh probe of its volume passes, without a restart;
  a volume that still fails keeps it refusing, and nothing is reserved meanwhile.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from kvpack.errors import DurableIOError, ProtocolError, SecurityError
from kvpack.node import receipts as receipts_mod
from kvpack.node.ledger_gate import LedgerGate, LedgerGuard
from kvpack.node.receipts import MAX_FIELD_CHARS, ReceiptBudget, ReceiptWriter, RefusalLog
from kvpack.security.ledger import ReplayLedger
from kvpack.security.probe import ProbeResult
from kvpack.testing.faults import FaultyOps


def _files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".json"))


def test_fields_are_bounded_before_they_are_written(tmp_path):
    w = ReceiptWriter(str(tmp_path))
    huge = "x" * (64 << 20)
    path = w.write({"role": "producer", "verdict": "refused", "reason": "manifest", "request_id": huge, "frames": list(range(10_000))})
    assert path is not None
    assert os.path.getsize(path) < 64 << 10
    body = json.loads(open(path, "rb").read())
    assert len(body["request_id"]) < MAX_FIELD_CHARS + 64 and body["request_id"].startswith("xxx")
    assert len(body["frames"]) <= receipts_mod.MAX_LIST_ITEMS + 1


def test_directory_stays_within_its_budget(tmp_path):
    budget = ReceiptBudget(max_bytes=20_000, max_files=30)
    w = ReceiptWriter(str(tmp_path), budget)
    paths = [w.write({"role": "receiver", "verdict": "committed", "n": i, "pad": "p" * 500}) for i in range(200)]
    names = _files(tmp_path)
    total = sum(os.path.getsize(os.path.join(tmp_path, n)) for n in names)
    assert total <= budget.max_bytes and len(names) <= budget.max_files
    assert os.path.basename(paths[-1]) in names  # the newest is kept
    assert os.path.basename(paths[0]) not in names  # the oldest rotated out
    assert w.stats()["rotated"] >= 200 - len(names)
    # a restarted writer indexes what is there and keeps the same budget
    w2 = ReceiptWriter(str(tmp_path), ReceiptBudget(max_bytes=5_000, max_files=30))
    assert sum(os.path.getsize(os.path.join(tmp_path, n)) for n in _files(tmp_path)) <= 5_000
    assert w2.stats()["files"] == len(_files(tmp_path))


def test_a_failing_write_is_counted_never_raised(tmp_path, monkeypatch):
    w = ReceiptWriter(str(tmp_path))

    def full(*_a, **_k):
        raise DurableIOError("write", "No space left on device")

    monkeypatch.setattr(receipts_mod, "atomic_write", full)
    for _ in range(50):
        assert w.write({"role": "receiver", "verdict": "committed"}) is None
    assert w.failures == 50 and "No space left" in (w.last_error or "")
    assert _files(tmp_path) == []
    monkeypatch.undo()
    assert w.write({"role": "receiver", "verdict": "committed"}) is not None  # the disk is back


def test_refusal_receipts_beyond_the_rate_are_counted_in_a_capped_log(tmp_path):
    log_path = str(tmp_path / "refusals.log")
    rlog = RefusalLog("receiver", log_path, interval_s=0.0, max_bytes=4096)
    w = ReceiptWriter(str(tmp_path / "r"), ReceiptBudget(refusals_per_s=0.001, refusal_burst=5), refusal_log=rlog)
    written = [w.write({"role": "receiver", "verdict": "refused", "reason": "pin", "detail": "d" * 300}) for _ in range(40)]
    assert sum(p is not None for p in written) == 5
    assert rlog.totals["pin"] == 35
    for i in range(2000):  # a flood of pre-authentication refusals
        rlog.count("tls", "handshake timed out" * 20, f"127.0.0.1:{i}")
    assert rlog.totals["tls"] == 2000
    rlog.flush(timeout=5.0)  # the summary lines are written by the log's own thread
    size = os.path.getsize(log_path) + (os.path.getsize(log_path + ".1") if os.path.exists(log_path + ".1") else 0)
    assert size <= 2 * 4096
    assert w.write({"role": "receiver", "verdict": "committed"}) is not None  # commits are never rate-limited
    rlog.close(timeout=5.0)


def _probe_ok(path):
    return ProbeResult(os.path.dirname(os.path.abspath(path)), (0.5,))


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


def test_latched_ledger_refuses_as_unavailable_then_heals_after_a_passing_probe(tmp_path):
    path = str(tmp_path / "ledger.json")
    ops = FaultyOps(errno_=errno.ENOSPC)
    ledger = ReplayLedger.open(path, ops=ops)
    ledger.reserve("k", 1, 1)
    clock = _Clock()
    probes = []

    def probe(p):
        probes.append(p)
        if probe.failing:
            raise SecurityError("volume", "probe write: No space left on device")
        return _probe_ok(p)

    probe.failing = True
    guard = LedgerGuard(ledger, reprobe_interval_s=2.0, probe=probe, clock=clock)
    reserved = []
    gate = LedgerGate(guard, lambda ok, s: reserved.append(ok))
    ops._fail_ops = {"fsync"}  # the disk fills
    with pytest.raises(ProtocolError) as info:
        gate.reserve("k", 1, 2)
    assert info.value.category == "ledger_unavailable" and reserved == [False]
    ops._fail_ops = ()
    before = _read(path)
    # latched: refused without touching the file, and the probe is rate-limited
    for gen in (2, 3):
        with pytest.raises(ProtocolError) as info:
            gate.admit("k", 1, gen)
        assert info.value.category == "ledger_unavailable", info.value
    assert len(probes) == 1 and _read(path) == before and ledger.degraded is not None
    clock.t = 5.0  # the volume still fails: still refused
    with pytest.raises(ProtocolError):
        gate.admit("k", 1, 2)
    assert len(probes) == 2 and ledger.degraded is not None
    probe.failing = False  # space freed
    clock.t = 6.0  # within the interval: no new probe yet
    with pytest.raises(ProtocolError):
        gate.admit("k", 1, 2)
    clock.t = 8.0
    gate.admit("k", 1, 2)
    gate.reserve("k", 1, 2)
    assert ledger.degraded is None and ledger.watermark("k", 1) == 2 and guard.recoveries == 1
    with pytest.raises(SecurityError) as replay:  # replay protection is intact after healing
        gate.admit("k", 1, 2)
    assert replay.value.category == "replay"
    ledger.close()


def test_healing_refuses_a_ledger_that_went_backwards(tmp_path):
    path = str(tmp_path / "ledger.json")
    ops = FaultyOps()
    ledger = ReplayLedger.open(path, ops=ops)
    ledger.reserve("k", 1, 5)
    ops._fail_ops = {"fsync"}
    with pytest.raises(SecurityError):
        ledger.reserve("k", 1, 6)
    ops._fail_ops = ()
    with open(path, "wb") as fh:  # someone restored an older copy meanwhile
        fh.write(b'{\n  "highest_generation": {\n    "k:1": 1\n  }\n}\n')
    guard = LedgerGuard(ledger, reprobe_interval_s=0.0, probe=_probe_ok)
    with pytest.raises(ProtocolError) as info:
        guard.ensure_available()
    assert info.value.category == "ledger_unavailable" and "rollback" in info.value.message
    assert ledger.degraded is not None
    ledger.close()


def test_reordering_window_admits_each_generation_once_and_never_after_a_restart(tmp_path):
    """Concurrent transfers of one producer finish out of generation order: within one
    process a generation below the watermark is admitted once (never twice), and after a
    restart nothing at or below the durable watermark is."""
    path = str(tmp_path / "ledger.json")
    led = ReplayLedger.open(path, strict=False)
    led.reserve("k", 1, 5)
    before = _read(path)
    led.reserve("k", 1, 3)  # finished after 5: admitted, no write needed
    led.reserve("k", 1, 4)
    assert _read(path) == before and led.watermark("k", 1) == 5
    for gen in (3, 4, 5):
        with pytest.raises(SecurityError) as info:
            led.admit("k", 1, gen)
        assert info.value.category == "replay" and "replayed" in info.value.message
    led.reserve("k", 1, 6)
    led.close()
    led = ReplayLedger.open(path, strict=False)  # restart: the floor is the durable watermark
    for gen in (1, 2, 6):
        with pytest.raises(SecurityError):
            led.admit("k", 1, gen)
    led.reserve("k", 1, 8)
    led.reserve("k", 1, 7)  # above the floor (6), below the watermark: admitted once
    with pytest.raises(SecurityError):
        led.reserve("k", 1, 7)
    led.close()
    strict = ReplayLedger.open(path)  # upstream's rule: nothing at or below the watermark
    with pytest.raises(SecurityError):
        strict.admit("k", 1, 7)
    strict.close()


def test_reordering_window_is_bounded(tmp_path):
    from kvpack.security.ledger import REORDER_WINDOW

    led = ReplayLedger.open(str(tmp_path / "ledger.json"), strict=False)
    led.reserve("k", 1, 1)
    led.close()
    led = ReplayLedger.open(str(tmp_path / "ledger.json"), strict=False)
    led.reserve("k", 1, REORDER_WINDOW + 10)
    with pytest.raises(SecurityError) as info:
        led.admit("k", 1, 5)  # above the floor, but far below the watermark
    assert "stale" in info.value.message
    led.admit("k", 1, 20)
    led.close()
