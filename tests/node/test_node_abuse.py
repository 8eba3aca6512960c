"""Real daemons (``kvpack producer`` / ``kvpack receiver`` subprocesses) under abuse (issue 14):

* frames declaring 2^32-byte lengths (and 512 MiB segments before a begin, and a 4 GiB
  control message), from peers with and without credentials: the receiver's and the
  producer's peak RSS stay under the documented bound (64 MiB above their peak after start);
* a 60 s flood of refused connections into a 16 MiB filesystem holding the receipts and the
  replay ledger: the node keeps serving during the flood, the flood leaves the filesystem
  almost empty (aggregated refusals, budgeted receipts), and after the filesystem is filled
  on purpose a transfer is refused ``ledger_unavailable`` -- then, once space is freed, the
  next request commits without a restart;
* fail fast: a taken data port is reported before any model is loaded.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time

import pytest

from kvpack.handoff.control import MAGIC as CONTROL_MAGIC
from kvpack.handoff.frames import MAGIC, PREAMBLE
from kvpack.node.common import load_engine
from kvpack.node.local_api import request_local
from kvpack.node.receipts import ReceiptBudget
from kvpack.security.tls import connect

from .helpers import Daemon, Enrolled, producer_daemon

ENGINE = "arrays:4:2:8"
#: documented in docs/operations.md ("Limits and deadlines"): peak RSS growth under abuse
RSS_BOUND = 64 << 20


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _sock_path() -> str:
    return os.path.join(tempfile.mkdtemp(prefix="kva-"), "r.sock")


def _daemons(root: str, *, rcfg_path: str | None = None, receipts: str | None = None):
    engine = load_engine(ENGINE)
    enrolled = Enrolled(os.path.join(root, "cluster"), engine, producers=("prefill-a", "prefill-b"))
    common = ["--engine", ENGINE, "--no-store", "--no-metrics"]
    producer = producer_daemon(enrolled, common)
    sock = _sock_path()
    rargs = ["receiver", "--config", rcfg_path or enrolled.receiver_config_path(), *common, "--socket", sock, "--decode-slots", "2"]
    if receipts:
        rargs += ["--receipts", receipts]
    receiver = Daemon(rargs)
    return enrolled, producer, receiver, sock


def _stop(*daemons):
    for d in daemons:
        d.stop()


def _quietly(fn, *a):
    try:
        fn(*a)
    except (OSError, Exception):  # noqa: BLE001 - every one of these is refused by the node
        pass


def _raw_junk(port: int, data: bytes, wait: float = 5.0) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        s.settimeout(wait)
        try:
            s.recv(1)
        except OSError:
            pass


def _authenticated(ep, port: int, data: bytes) -> None:
    ch = connect(ep, "127.0.0.1", port, timeout=10)
    try:
        ch.sendall(data)
        ch.settimeout(10)
        ch.recv(1)
    finally:
        ch.close()


def _segment_header(length: int) -> bytes:
    body = json.dumps({"kind": "segment", "sequence": 0}).encode()
    return PREAMBLE.pack(MAGIC, len(body), length) + body


@pytest.mark.slow
def test_frames_declaring_huge_lengths_stay_under_the_rss_bound(tmp_path):
    enrolled, producer, receiver, _sock = _daemons(str(tmp_path))
    try:
        pr, rr = producer.wait_ready(), receiver.wait_ready()
        base = {"producer": _hwm(producer.proc.pid), "receiver": _hwm(receiver.proc.pid)}
        data_ep = enrolled.producer_config().data_endpoint("decode-a")
        ctl_ep = enrolled.receiver_config().control_endpoint()
        frames = [
            PREAMBLE.pack(MAGIC, (1 << 32) - 1, 0),  # header length 2^32 - 1
            PREAMBLE.pack(MAGIC, 64, 1 << 32),  # payload length 2^32
            PREAMBLE.pack(MAGIC, 64, (1 << 64) - 1),
            PREAMBLE.pack(MAGIC, 8 << 20, 0),  # a legal header size, but not for a first frame
            _segment_header(512 << 20),  # a 512 MiB segment before any begin
        ]
        for _round in range(4):
            threads = []
            for f in frames:
                threads.append(threading.Thread(target=_quietly, args=(_raw_junk, rr["data_port"], f)))
                threads.append(threading.Thread(target=_quietly, args=(_authenticated, data_ep, rr["data_port"], f)))
            ctl = struct.pack("<8sI", CONTROL_MAGIC, (1 << 32) - 1)  # a 4 GiB control message
            threads.append(threading.Thread(target=_quietly, args=(_authenticated, ctl_ep, pr["control_port"], ctl)))
            threads.append(threading.Thread(target=_quietly, args=(_raw_junk, pr["control_port"], ctl)))
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
        grown = {"producer": _hwm(producer.proc.pid) - base["producer"], "receiver": _hwm(receiver.proc.pid) - base["receiver"]}
        assert grown["receiver"] < RSS_BOUND and grown["producer"] < RSS_BOUND, grown
        assert producer.proc.poll() is None and receiver.proc.poll() is None
    finally:
        _stop(receiver, producer)


def _mount_tmpfs(path: str, size: str = "16m") -> bool:
    if os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path], capture_output=True)
    return r.returncode == 0


def _used(path: str) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _fill(path: str) -> str:
    """Fill the filesystem to the last byte (big writes, then ever smaller ones)."""
    junk = os.path.join(path, "junk.bin")
    fd = os.open(junk, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        size = 1 << 20
        while size >= 1:
            try:
                os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno in (errno.ENOSPC, errno.EDQUOT)
                size //= 2
    finally:
        os.close(fd)
    return junk


class _Flood:
    """Threads that keep opening refused connections of several kinds until stopped."""

    def __init__(self, enrolled, data_port: int) -> None:
        self.stop = threading.Event()
        self.count = 0
        unpinned = enrolled.producer_config("prefill-b").data_endpoint("decode-a")  # same CA, not pinned
        pinned = enrolled.producer_config().data_endpoint("decode-a")
        self.kinds = [
            lambda: _raw_junk(data_port, b"", 0.01),  # connect and go away
            lambda: _raw_junk(data_port, b"GET / HTTP/1.0\r\n\r\n", 2.0),  # not TLS: refused at once
            lambda: _authenticated(unpinned, data_port, b"x"),
            lambda: _authenticated(pinned, data_port, PREAMBLE.pack(MAGIC, 64, 1 << 40)),  # refused with a (budgeted) receipt
        ]
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(6)]

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            _quietly(self.kinds[k % len(self.kinds)])
            self.count += 1
            k += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)


@pytest.mark.slow
def test_refused_connection_flood_into_a_16_mib_filesystem(tmp_path):
    fs = str(tmp_path / "small")
    if not _mount_tmpfs(fs):
        pytest.skip("needs root to mount a 16 MiB tmpfs for the receipts and the ledger")
    try:
        engine = load_engine(ENGINE)
        enrolled = Enrolled(str(tmp_path / "cluster"), engine, producers=("prefill-a", "prefill-b"))
        common = ["--engine", ENGINE, "--no-store", "--no-metrics"]
        producer = producer_daemon(enrolled, common)  # before the copy below: it carries the control port
        sock = _sock_path()
        with open(enrolled.receiver_config_path()) as fh:
            cfg = json.load(fh)
        cfg["replay_ledger"] = os.path.join(fs, "ledger", "replay-ledger.json")
        rcfg_path = os.path.join(os.path.dirname(enrolled.receiver_config_path()), "receiver.small-fs.json")
        with open(rcfg_path, "w") as fh:
            json.dump(cfg, fh)
        os.chmod(rcfg_path, 0o600)
        receiver = Daemon(["receiver", "--config", rcfg_path, *common, "--socket", sock, "--receipts", os.path.join(fs, "receipts")])
        try:
            rr = receiver.wait_ready()
            served = 0
            t_start = time.monotonic()
            t_end = t_start + float(os.environ.get("KVPACK_FLOOD_S", "60"))
            with _Flood(enrolled, rr["data_port"]) as flood:
                i = 0
                while time.monotonic() < t_end:
                    reply = request_local(sock, {"tokens": [(7 * i + k) % 50 + 1 for k in range(300)], "max_new_tokens": 2}, timeout=120)
                    assert reply.get("ok"), reply
                    served += 1
                    i += 1
                    time.sleep(2.0)
            seconds = float(os.environ.get("KVPACK_FLOOD_S", "60"))
            assert flood.count > 5 * seconds and served >= seconds / 12, (flood.count, served)
            # aggregated refusals, rate-limited refusal receipts: at most the budget's burst plus
            # its rate over the flood (one tmpfs page each), far below what fills the volume
            budget = ReceiptBudget()
            receipts = [n for n in os.listdir(os.path.join(fs, "receipts")) if n.endswith(".json")]
            allowed = budget.refusal_burst + budget.refusals_per_s * (time.monotonic() - t_start) + served
            assert len(receipts) <= allowed, (len(receipts), allowed)
            assert _used(fs) < 8 << 20, _used(fs)
            # the disk is full (someone else filled it): a transfer is refused, the ledger
            # cannot reserve, and says so -- not "replay"
            junk = _fill(fs)
            reply = request_local(sock, {"tokens": list(range(5, 400)), "max_new_tokens": 2}, timeout=120)
            assert not reply.get("ok") and reply["error"]["reason"] == "ledger_unavailable", reply
            os.unlink(junk)
            time.sleep(2.5)  # the ledger re-probes its volume at most every 2 s
            reply = request_local(sock, {"tokens": list(range(5, 400)), "max_new_tokens": 2}, timeout=120)
            assert reply.get("ok"), reply  # healed without a restart
            assert receiver.proc.poll() is None and producer.proc.poll() is None
        finally:
            _stop(receiver, producer)
    finally:
        subprocess.run(["umount", "-l", fs], capture_output=True)


def test_taken_data_port_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """In process: the engine loader must never be reached when the port is taken."""
    from kvpack import cli
    from kvpack.node import common

    engine = load_engine(ENGINE)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        enrolled = Enrolled(str(tmp_path / "cluster"), engine)
        with open(enrolled.receiver_config_path()) as fh:
            cfg = json.load(fh)
        cfg["listen"] = f"127.0.0.1:{port}"
        path = enrolled.receiver_config_path()
        with open(path, "w") as fh:
            json.dump(cfg, fh)

        def never(*_a, **_k):
            raise AssertionError("the engine was loaded before the port was bound")

        monkeypatch.setattr(common, "load_engine", never)
        # the loose ledger gate: a loaded box's slow fsync must not refuse first (exit 1 as well)
        code = cli.main(
            ["receiver", "--config", path, "--engine", ENGINE, "--no-store", "--no-metrics", "--socket", _sock_path(), "--ledger-max-tail-ms", "5000"]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("kvpack: address_in_use: ") and f"127.0.0.1:{port}" in err[-1], err


def test_api_socket_of_a_live_daemon_is_not_taken_over_by_a_second(tmp_path):
    enrolled, producer, receiver, sock = _daemons(str(tmp_path))
    try:
        receiver.wait_ready()
        second = subprocess.run(
            [
                *__import__("shlex").split(f"{__import__('sys').executable} -m kvpack.cli"),
                "receiver",
                "--config",
                enrolled.receiver_config_path(),
                "--engine",
                ENGINE,
                "--no-store",
                "--no-metrics",
                "--socket",
                sock,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0 and "kvpack: " in second.stderr.splitlines()[-1], (second.returncode, second.stderr[-2000:])
        assert os.path.exists(sock)  # never removed by the loser
        assert "Traceback" not in second.stderr
    finally:
        _stop(receiver, producer)
    shutil.rmtree(os.path.dirname(sock), ignore_errors=True)
