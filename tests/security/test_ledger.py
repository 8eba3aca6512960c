"""The replay ledger (C.9): admission rules, durability under faults and crashes, exclusivity.

Each refusal asserts the typed error and that the ledger file's bytes are unchanged."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading

import pytest

from kvpack.cli import main as kvpack_main
from kvpack.errors import KvpackError, SecurityError
from kvpack.security.ledger import ReplayLedger, decode_ledger, encode_ledger, reset_ledger
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
        assert info.value.category == "ledger_unavailable" and "fsync" in info.value.message
        assert led.degraded is not None
        assert read(path) == before
        ops._fail_ops = ()  # storage "repaired": the latch still holds until restart
        for key, epoch, gen in (("k", 1, 2), ("k", 1, 3), ("other", 5, 1)):
            refuse(led, "ledger_unavailable", key, epoch, gen)
        assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    with ReplayLedger.open(path) as led:  # restart
        assert led.degraded is None and led.watermark("k", 1) == 1
        led.reserve("k", 1, 2)


# A reservation: ledger (open, write, fsync, rename, dirsync), then witness (open, write, fsync,
# rename; made durable by the next directory fsync).
RESERVE_STEPS = 9


@pytest.mark.parametrize("crash_at", range(1, RESERVE_STEPS + 3))
def test_crash_at_each_step_leaves_old_or_new_watermark(tmp_path, crash_at):
    path = tmp_path / "ledger.json"
    with ReplayLedger.open(path) as led:
        led.reserve("k", 1, 5)
    old = read(path)
    ops = FaultyOps(crash_at=crash_at)
    led = ReplayLedger.open(path, ops=ops)
    crashed = False
    try:
        led.reserve("k", 1, 6)
        led.close()  # step 10: the directory fsync that makes the witness rename durable
    except SimulatedCrash:
        crashed = True
        with contextlib.suppress(SimulatedCrash):
            led.close()  # the process died: its lock goes with it
    assert crashed == (crash_at <= RESERVE_STEPS + 1)
    # Never a false rollback: whatever survived, the witness is at most the durable ledger.
    with ReplayLedger.open(path) as after:
        mark = after.watermark("k", 1)
        # Before the ledger's directory fsync (step 5) nothing is durable: the old watermark.
        assert mark == (5 if crash_at <= 5 else 6)
        assert read(path) == (old if crash_at <= 5 else encode_ledger({"k:1": 6}))
        assert after.witness_snapshot() == {"k:1": mark}
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


@pytest.mark.parametrize("crash_at", range(1, 12))
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
    # The refused open released its lock: a repaired ledger (same watermark, 0600) opens again.
    os.unlink(path)
    _rewrite(str(path), encode_ledger({"k:1": 9}))
    os.chmod(path, 0o600)
    with ReplayLedger.open(path) as led:
        assert led.watermark("k", 1) == 9


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
        assert info.value.category == "locked"
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
        assert "locked:" in proc.stdout and f"pid {os.getpid()}" in proc.stdout
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


# -- rollback detection (issue 15): the witness, refusals at open, forward-only recovery ----------------


def _witness(path) -> bytes:
    return read(str(path) + ".witness")


def _ledger_at(tmp_path, marks: dict[str, int]):
    """A ledger that reserved ``marks`` in order, closed; returns its path."""
    path = tmp_path / "state" / "replay-ledger.p.json"
    with ReplayLedger.open(path) as led:
        for space, top in marks.items():
            key, _, epoch = space.rpartition(":")
            for g in range(1, top + 1):
                led.reserve(key, int(epoch), g)
    return path


def _delete(path, _old) -> None:
    os.unlink(path)


def _restore_old(path, old: bytes) -> None:
    _rewrite(str(path), old)  # an operator restoring yesterday's copy (watermark 3, not 6)


def _empty_map(path, _old) -> None:
    _rewrite(str(path), EMPTY)


def _drop_witness(path, _old) -> None:
    os.unlink(str(path) + ".witness")


@pytest.mark.parametrize(
    "tamper, needle",
    [(_delete, "is missing"), (_restore_old, "has k:1 at 3"), (_empty_map, "is empty"), (_drop_witness, "witness")],
    ids=["deleted", "old-copy", "emptied-map", "witness-deleted"],
)
def test_rolled_back_ledger_refuses_to_open(tmp_path, tamper, needle):
    path = tmp_path / "state" / "replay-ledger.p.json"
    with ReplayLedger.open(path) as led:
        for g in (1, 2, 3):
            led.reserve("k", 1, g)
        old = read(path)
        for g in (4, 5, 6):
            led.reserve("k", 1, g)
    assert json.loads(_witness(path))["highest_generation"] == {"k:1": 6}
    tamper(path, old)
    files = {n: read(path.parent / n) for n in os.listdir(path.parent) if not n.endswith(".lock")}
    with pytest.raises(SecurityError) as info:
        ReplayLedger.open(path)
    err = info.value
    assert err.category == "rollback" and needle in err.message, err
    assert "\n" not in str(err)  # one line for the operator
    assert "--rotate" in err.message and "kvpack ledger reset" in err.message
    # refused means untouched: no ledger recreated, no witness rewritten
    assert {n: read(path.parent / n) for n in os.listdir(path.parent) if not n.endswith(".lock")} == files
    # a new HMAC epoch recovers (old-epoch seals are refused by the epoch rule anyway) ...
    if tamper is not _drop_witness:
        with ReplayLedger.open(path, minimum_epoch=2) as led:
            refuse(led, "epoch", epoch=1, generation=7)
            refuse(led, "epoch" if tamper is _delete or tamper is _empty_map else "replay", epoch=1, generation=3)
            led.reserve("k", 2, 1)
        assert json.loads(_witness(path))["highest_generation"] == {"k:1": 6, "k:2": 1}


def test_reset_moves_forward_only_and_is_logged(tmp_path):
    path = _ledger_at(tmp_path, {"k:1": 6, "j:1": 2})
    old = encode_ledger({"j:1": 2, "k:1": 3})
    _rewrite(str(path), old)  # rolled back
    with pytest.raises(SecurityError):
        ReplayLedger.open(path)
    for bad in (0, -1, True, 2**64):
        with pytest.raises(SecurityError) as info:
            reset_ledger(path, min_generation=bad)
        assert info.value.category == "config"
    assert read(path) == old  # refused resets wrote nothing
    # forward only: N below the witness still restores the witnessed watermark, never less
    entry = reset_ledger(path, min_generation=1, reason="restored from backup by mistake")
    assert entry["before"] == {"j:1": 2, "k:1": 3} and entry["after"] == {"j:1": 2, "k:1": 6}
    with ReplayLedger.open(path) as led:
        refuse(led, "replay", generation=6)
        led.admit("k", 1, 7)
    # N above: every counter space moves up to N; a named new space is added
    entry = reset_ledger(path, min_generation=40, spaces=["k:1", "k:2"])
    assert entry["after"] == {"j:1": 2, "k:1": 40, "k:2": 40}
    with ReplayLedger.open(path) as led:
        assert led.snapshot() == {"j:1": 2, "k:1": 40, "k:2": 40}
        # while a receiver holds the ledger, a reset is refused
        with pytest.raises(SecurityError) as info:
            reset_ledger(path, min_generation=50)
        assert info.value.category == "locked" and "another process" in info.value.message
    lines = [json.loads(x) for x in read(str(path) + ".resets.log").splitlines()]
    assert [x["min_generation"] for x in lines] == [1, 40]
    assert lines[0]["reason"] == "restored from backup by mistake" and lines[0]["witness_before"] == {"j:1": 2, "k:1": 6}
    assert os.stat(str(path) + ".resets.log").st_mode & 0o777 == 0o600


def test_reset_repairs_a_deleted_ledger_and_witness(tmp_path):
    path = _ledger_at(tmp_path, {"k:1": 4})
    os.unlink(path)
    os.unlink(str(path) + ".witness")  # both gone: indistinguishable from a fresh node ...
    with ReplayLedger.open(path) as led:  # ... which is what the documented model does not detect
        assert led.snapshot() == {}
    with pytest.raises(SecurityError) as info:
        reset_ledger(path, min_generation=9)  # nothing names a counter space
    assert "--key" in info.value.message
    reset_ledger(path, min_generation=9, spaces=["k:1"])
    with ReplayLedger.open(path) as led:
        refuse(led, "replay", generation=4)
        refuse(led, "replay", generation=9)


def test_tampered_witness_refuses_to_open(tmp_path):
    path = _ledger_at(tmp_path, {"k:1": 2})
    wpath = str(path) + ".witness"
    good = read(wpath)
    for tamper, needle in (
        (lambda: os.chmod(wpath, 0o644), "group/other"),
        (lambda: _rewrite(wpath, b"{"), "not valid witness JSON"),
        (lambda: _rewrite(wpath, good.replace(b"replay-ledger.p.json", b"replay-ledger.q.json")), "witnesses ledger"),
        (lambda: _rewrite(wpath, good.replace(b'"k:1": 2', b'"k:1": -2')), "u64"),
    ):
        tamper()
        with pytest.raises(SecurityError) as info:
            ReplayLedger.open(path)
        assert info.value.category == "ledger" and needle in info.value.message
        _rewrite(wpath, good)
        os.chmod(wpath, 0o600)
    ReplayLedger.open(path).close()


def test_clear_degraded_needs_a_passing_probe_of_its_volume(tmp_path):
    from kvpack.security.probe import ProbeResult, probe_volume

    path = _ledger_at(tmp_path, {"k:1": 1})
    ops = FaultyOps(fail_ops={"fsync"})
    with ReplayLedger.open(path, ops=ops) as led:
        with pytest.raises(SecurityError):
            led.reserve("k", 1, 2)
        assert led.degraded is not None
        with pytest.raises(SecurityError) as info:
            led.clear_degraded(probe_volume(tmp_path))  # another directory
        assert info.value.category == "volume" and led.degraded is not None
        with pytest.raises(SecurityError):
            led.clear_degraded(ProbeResult(str(path.parent), (1.0, 250.0)))  # too slow a tail
        ops._fail_ops = ()  # storage repaired
        led.clear_degraded(probe_volume(path.parent, ops=ops))
        assert led.degraded is None
        refuse(led, "replay", generation=1)
        led.reserve("k", 1, 2)
    with ReplayLedger.open(path) as led:
        assert led.watermark("k", 1) == 2 and led.witness_snapshot() == {"k:1": 2}


def test_clear_degraded_refuses_a_ledger_that_went_backwards(tmp_path):
    from kvpack.security.probe import probe_volume

    path = _ledger_at(tmp_path, {"k:1": 1})
    ops = FaultyOps(fail_ops={"fsync"})
    with ReplayLedger.open(path, ops=ops) as led:
        ops._fail_ops = ()
        led.reserve("k", 1, 5)
        ops._fail_ops = {"fsync"}
        with pytest.raises(SecurityError):
            led.reserve("k", 1, 6)
        _rewrite(str(path), encode_ledger({"k:1": 2}))  # someone wrote an older ledger meanwhile
        ops._fail_ops = ()
        with pytest.raises(SecurityError) as info:
            led.clear_degraded(probe_volume(path.parent, ops=ops))
        assert info.value.category == "rollback" and led.degraded is not None


# -- end to end: real receiver and producer nodes (mTLS on loopback, NumPy engine) ------------------------


@pytest.mark.slow
def test_captured_transfer_is_never_committed_twice_across_ledger_rollbacks(tmp_path):
    """A transfer whose id is outside the ``muser-`` namespace is bound to no request (errata
    M8), so only the ledger stands between a captured copy and a second commit. Roll the ledger
    back (delete, old copy, emptied map): the receiver refuses to start. Recover by a logged
    forward reset or by a new HMAC epoch: the captured transfer is refused, never committed."""
    import itertools

    from kvpack.errors import ProtocolError
    from kvpack.node.common import load_engine
    from kvpack.node.producer import ProducerNode
    from kvpack.node.receiver import ReceiverNode
    from kvpack.security.config import load_receiver_config
    from kvpack.security.tls import connect
    from tests.node.helpers import Enrolled

    engine = load_engine("arrays:4:2:8")
    enrolled = Enrolled(str(tmp_path / "cluster"), engine)
    pcfg = enrolled.producer_config()
    tap: list[bytearray] = [bytearray()]
    producer = ProducerNode(pcfg, load_engine("arrays:4:2:8"), receipts_dir=str(tmp_path / "p"), wire_tap=lambda b: tap[0].extend(b)).start()
    enrolled.producer_listening("prefill-a", producer.control_port)
    rcfg = enrolled.receiver_config()
    counter = itertools.count(1)

    def receiver(cfg=rcfg) -> ReceiverNode:
        node = ReceiverNode(cfg, engine, receipts_dir=str(tmp_path / "r"), check_volume=False)  # the probe is not under test
        node._new_request_id = lambda t0: f"ext-{t0}-{next(counter)}"  # ids outside muser-: unbound transfers
        return node.start()

    def replay(node: ReceiverNode, captured: bytes, prompt, endpoint=None) -> ProtocolError:
        pending = node.expect(f"ext-replay-{next(counter)}", prompt, wait_s=3.0)
        ch = connect(endpoint or pcfg.data_endpoint("decode-a"), "127.0.0.1", node.data_port)
        try:
            ch.sendall(captured)
            ch.settimeout(10)
            assert ch.recv(4096) == b""  # dropped, never acknowledged
        except (OSError, KvpackError):
            pass
        finally:
            ch.close()
        with pytest.raises(ProtocolError) as info:
            node.wait(pending)
        return info.value

    first, second = list(range(1, 200)), list(range(300, 500))
    node = receiver()
    try:
        node.generate(first, 2)  # generation 1
        old = read(rcfg.replay_ledger)  # an operator's backup of the ledger at watermark 1
        tap[0] = bytearray()
        res = node.generate(second, 2)  # generation 2: captured on the wire
        captured = bytes(tap[0])
        assert res["transfer"]["transfer_id"].startswith("ext-") and res["transfer"]["generation"] == 2
        assert replay(node, captured, second).category == "replay"
    finally:
        node.stop()
    good = read(rcfg.replay_ledger)
    for tamper in (lambda p: os.unlink(p), lambda p: _rewrite(p, old), lambda p: _rewrite(p, EMPTY)):
        tamper(rcfg.replay_ledger)
        before = read(rcfg.replay_ledger) if os.path.exists(rcfg.replay_ledger) else None
        with pytest.raises(SecurityError) as info:
            receiver()
        assert info.value.category == "rollback" and "\n" not in str(info.value)
        assert (read(rcfg.replay_ledger) if os.path.exists(rcfg.replay_ledger) else None) == before  # untouched
        _rewrite(rcfg.replay_ledger, good)
        os.chmod(rcfg.replay_ledger, 0o600)
    # recovery 1: an explicit, logged, forward-only reset; the captured transfer stays refused
    _rewrite(rcfg.replay_ledger, old)
    assert kvpack_main(["ledger", "show", "--config", rcfg.path]) == 1
    assert kvpack_main(["ledger", "reset", "--config", rcfg.path, "--min-generation", "1", "--reason", "test"]) == 0
    node = receiver()
    try:
        live = (list(node.session.tokens), node.session.cache_digest())
        assert replay(node, captured, second).category == "replay"
        assert (list(node.session.tokens), node.session.cache_digest()) == live
    finally:
        node.stop()
    # recovery 2: a new HMAC epoch (enrollment --rotate); the captured epoch-1 transfer is refused
    os.unlink(rcfg.replay_ledger)
    with pytest.raises(SecurityError):
        receiver()
    assert kvpack_main(["enroll", "node", enrolled.root, "decode-a", "--rotate"]) == 0
    enrolled.listen_on_port_zero()  # the rotation rewrote the configs with the registry's placeholders
    enrolled.producer_listening("prefill-a", producer.control_port)
    rotated = load_receiver_config(rcfg.path)
    assert rotated.minimum_hmac_epoch == 2
    node = receiver(rotated)
    try:
        # the producer's credentials as re-issued by the rotation (the new receiver leaf is pinned)
        err = replay(node, captured, second, enrolled.producer_config().data_endpoint("decode-a"))
        assert "HMAC epoch 1 is below the configured minimum 2" in err.message, err
        assert node.session.position == 0  # nothing installed
    finally:
        node.stop()
        producer.stop()
