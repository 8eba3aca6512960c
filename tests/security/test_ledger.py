"""The replay ledger (C.9): admission rules, durability under faults and crashes, exclusivity.

Each refusal asserts the typed error and that the ledger file's bytes are unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvpack.errors import SecurityError
from kvpack.security.ledger import ReplayLedger, decode_ledger, encode_ledger
from kvpack.testing.faults import FaultyOps, SimulatedCrash

EMPTY = b'{\n  "highest_generation": {}\n}\n'


def read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def refuse(ledger: ReplayLedger, category: str, key="k", epoch=1, generation=1, *, reserve=True):
    before = read(ledger.path)
    for op in (ledger.admit, ledger.reserve) if reserve else (ledger.admit,):
        with pytest.raises(SecurityError) as info:
            op(key, epoch, generation)
        assert info.value.category == category, info.value
    assert read(ledger.path) == before
    return info.value


def test_created_empty_with_rust_bytes_and_mode(tmp_path):
    path = tmp_path / "state" / "ledger.json"
    with ReplayLedger.open(path) as led:
        assert read(path) == EMPTY
        assert os.stat(path).st_mode & 0o777 == 0o600
        led.reserve("loop-key", 1, 3)
        led.reserve("a:b", 2, 1)
    assert read(path) == (b'{\n  "highest_generation": {\n    "a:b:2": 1,\n    "loop-key:1": 3\n  }\n}\n')
    assert decode_ledger(read(path)) == {"a:b:2": 1, "loop-key:1": 3}


def test_zero_replayed_stale_refused_also_after_restart(tmp_path):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 5)
        assert "ZeroGeneration" in refuse(led, "replay", generation=0).message
        assert "replayed" in refuse(led, "replay", generation=5).message
        assert "stale" in refuse(led, "replay", generation=4).message
        led.admit("k", 1, 6)  # admission alone reserves nothing
        assert led.watermark("k", 1) == 5
    # Process restart: a new object reading the same file.
    with ReplayLedger.open(path) as led:
        assert led.watermark("k", 1) == 5
        refuse(led, "replay", generation=0)
        refuse(led, "replay", generation=5)
        refuse(led, "replay", generation=1)
        led.reserve("k", 1, 6)


def test_new_epoch_is_a_fresh_counter_space_and_minimum_enforced(tmp_path):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 900)
        led.reserve("k", 2, 1)  # new epoch admits generation 1
        assert led.snapshot() == {"k:1": 900, "k:2": 1}
    with ReplayLedger.open(path, minimum_epoch=2) as led:
        err = refuse(led, "epoch", epoch=1, generation=901)
        assert "below the configured minimum 2" in err.message
        refuse(led, "replay", epoch=1, generation=900)  # upstream order: replay before epoch
        led.reserve("k", 2, 2)


def test_fsync_eio_latches_degraded_until_restart(tmp_path):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 1)
    before = read(path)
    ops = FaultyOps(fail_ops={"fsync"})
    with ReplayLedger.open(path, ops=ops) as led:
        with pytest.raises(SecurityError) as info:
            led.reserve("k", 1, 2)
        assert info.value.category == "degraded" and "fsync" in info.value.message
        assert led.degraded is not None
        assert read(path) == before
        ops._fail_ops = ()  # storage "repaired": the latch still holds until restart
        for key, epoch, gen in (("k", 1, 2), ("k", 1, 3), ("other", 5, 1)):
            refuse(led, "degraded", key, epoch, gen)
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with ReplayLedger.open(path) as led:  # restart
        assert led.degraded is None and led.watermark("k", 1) == 1
        led.reserve("k", 1, 2)


@pytest.mark.parametrize("crash_at", range(1, 7))
def test_crash_at_each_step_leaves_old_or_new_watermark(tmp_path, crash_at):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 5)
    old = read(path)
    ops = FaultyOps(crash_at=crash_at)
    led = ReplayLedger.open(path, ops=ops)
    try:
        led.reserve("k", 1, 6)
        crashed = False
    except SimulatedCrash:
        crashed = True
    finally:
        led.close()  # the process died: its lock goes with it
    assert crashed == (crash_at <= 5)  # open, write, fsync, rename, dirsync
    with ReplayLedger.open(path) as after:
        mark = after.watermark("k", 1)
        assert mark in (5, 6)
        # Before the directory fsync nothing is durable: the old watermark survives intact.
        assert mark == (5 if crashed else 6)
        assert read(path) == (old if crashed else encode_ledger({"k:1": 6}))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize("crash_at", range(1, 7))
def test_crash_while_creating_leaves_no_or_empty_ledger(tmp_path, crash_at):
    path = tmp_path / "ledger.json"
    try:
        ReplayLedger.open(path, ops=FaultyOps(crash_at=crash_at)).close()
    except SimulatedCrash:
        pass
    assert not os.path.exists(path) or read(path) == EMPTY
    with ReplayLedger.open(path) as led:
        assert led.snapshot() == {} and read(path) == EMPTY


@pytest.mark.parametrize(
    "tamper, needle",
    [
        (lambda p: os.chmod(p, 0o644), "group/other"),
        (lambda p: os.chmod(p, 0o660), "group/other"),
        (lambda p: _rewrite(p, b'{"highest_generation": {}, "extra": 1}'), "exactly the field"),
        (lambda p: _rewrite(p, b'{"highest_generation": {"k:1": true}}'), "u64"),
        (lambda p: _rewrite(p, b'{"highest_generation": {"k:1": -1}}'), "u64"),
        (lambda p: _rewrite(p, b'{"highest_generation": {"k:1": 1.0}}'), "u64"),
        (lambda p: _rewrite(p, b'{"highest_generation": {"k:1": 1, "k:1": 2}}'), "duplicate"),
        (lambda p: _rewrite(p, b'{"highest_generation": '), "not valid ledger JSON"),
        (lambda p: _symlink_to_copy(p), "symlink"),
    ],
)
def test_tampered_ledger_refuses_to_load(tmp_path, tamper, needle):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 9)
    tamper(str(path))
    before = read(path)
    with pytest.raises(SecurityError) as info:
        ReplayLedger.open(path)
    assert info.value.category == "ledger" and needle in info.value.message
    assert read(path) == before
    # The refused open released its lock: a repaired ledger opens again.
    os.unlink(path)
    ReplayLedger.open(path).close()


def _rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def _symlink_to_copy(path: str) -> None:
    data = read(path)
    real = path + ".real"
    _rewrite(real, data)
    os.chmod(real, 0o600)
    os.unlink(path)
    os.symlink(real, path)


def test_second_open_refused_in_process_and_in_subprocess(tmp_path):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 1)
        before = read(path)
        with pytest.raises(SecurityError) as info:
            ReplayLedger.open(path)
        assert info.value.category == "ledger"
        code = (
            "import sys\n"
            "from kvpack.security.ledger import ReplayLedger\n"
            "from kvpack.errors import SecurityError\n"
            "try:\n"
            f"    ReplayLedger.open({str(path)!r})\n"
            "except SecurityError as e:\n"
            "    print(e); sys.exit(3)\n"
            "sys.exit(0)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert "ledger:" in proc.stdout and f"pid {os.getpid()}" in proc.stdout
        assert read(path) == before
    # Once the holder is gone the other process may open it.
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_concurrent_reservations_are_serialised(tmp_path):
    with ReplayLedger.open(tmp_path / "ledger.json") as led:
        results: list[str] = []
        barrier = threading.Barrier(8)

        def worker() -> None:
            barrier.wait()
            try:
                led.reserve("k", 1, 1)
                results.append("ok")
            except SecurityError as exc:
                results.append(exc.category)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["ok"] + ["replay"] * 7
        assert json.loads(read(led.path)) == {"highest_generation": {"k:1": 1}}


def test_argument_types_refused(tmp_path):
    with ReplayLedger.open(tmp_path / "ledger.json") as led:
        refuse(led, "replay", generation=True)
        refuse(led, "replay", key="", generation=1)
        refuse(led, "epoch", epoch=-1)
    with pytest.raises(SecurityError) as info:
        ReplayLedger.open(tmp_path / "x.json", minimum_epoch=0)
    assert info.value.category == "config"
