"""The shared transport driver (node/transport.py) on real loopback sockets and mutual TLS:
idle and trickling peers cost one slot until the handshake deadline and never the service;
connections over a limit are closed at once and counted; peers without credentials never
reach protocol code; refusals are aggregated, not one receipt each."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from kvpack.errors import KvpackError, NetworkError
from kvpack.node.common import load_engine
from kvpack.node.receipts import RefusalLog
from kvpack.node.transport import Deadline, Limits, Listener, bind_tcp, fill
from kvpack.security.tls import connect, server_context

from .helpers import Enrolled


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("transport")
    engine = load_engine("arrays:2:1:8")
    return Enrolled(str(root / "cluster"), engine, producers=("prefill-a", "prefill-b"))


def _echo(chan):
    buf = memoryview(bytearray(5))
    if fill(chan, buf, Deadline(5.0, what="echo")) == 5:
        chan.sendall(bytes(buf))


def _listener(cluster, tmp_path, serve=_echo, **limits):
    ep = cluster.receiver_config().data_endpoint()
    sock = bind_tcp("127.0.0.1", 0, "data listener")
    refusals = RefusalLog("receiver", str(tmp_path / "refusals.log"), interval_s=0.2)
    return Listener("test", sock, ep, server_context(ep), serve, limits=Limits(**limits), refusals=refusals).start()


def _eventually(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def _legit(cluster, port):
    ep = cluster.producer_config().data_endpoint("decode-a")
    ch = connect(ep, "127.0.0.1", port, timeout=10)
    try:
        ch.sendall(b"hello")
        return ch.recv_exact(5)
    finally:
        ch.close()


def _trickle(port, stop, sent):
    s = socket.create_connection(("127.0.0.1", port))
    hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64)
    try:
        for b in hello:
            if stop.is_set():
                return
            s.sendall(bytes([b]))
            sent.append(1)
            time.sleep(0.2)
    except OSError:
        return
    finally:
        s.close()


def test_idle_and_trickling_peers_never_stop_the_service(cluster, tmp_path):
    lst = _listener(cluster, tmp_path, handshake_s=1.5)
    idle = [socket.create_connection(("127.0.0.1", lst.port)) for _ in range(32)]
    stop = threading.Event()
    sent: list = []
    tricklers = [threading.Thread(target=_trickle, args=(lst.port, stop, sent), daemon=True) for _ in range(8)]
    for t in tricklers:
        t.start()
    try:
        time.sleep(0.3)
        assert lst.snapshot()["handshakes"] >= 32
        t0 = time.monotonic()
        replies = [_legit(cluster, lst.port) for _ in range(20)]
        assert replies == [b"hello"] * 20
        # every idle connection is dropped at its handshake deadline, not held forever
        deadline = time.monotonic() + 10
        while lst.snapshot()["handshakes"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lst.snapshot()["handshakes"] == 0, lst.snapshot()
        assert time.monotonic() - t0 < 10
        for s in idle:
            s.settimeout(2)
            assert s.recv(16) == b""  # closed by the node
    finally:
        stop.set()
        for s in idle:
            s.close()
        for t in tricklers:
            t.join(timeout=5)
        lst.stop()
    snap = lst.snapshot()
    assert snap["refusals"].get("handshake_timeout", 0) >= 32
    assert snap["connections"] == 0 and snap["authenticated"] == 0
    log_lines = open(tmp_path / "refusals.log").read().splitlines()
    assert 1 <= len(log_lines) < 20  # aggregated: a few summary lines, not one per connection


def test_connections_over_the_limit_are_closed_at_once(cluster, tmp_path):
    lst = _listener(cluster, tmp_path, max_connections=4, handshake_s=5)
    held = [socket.create_connection(("127.0.0.1", lst.port)) for _ in range(4)]
    try:
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", lst.port))
        extra.settimeout(2)
        t0 = time.monotonic()
        try:
            assert extra.recv(16) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 1.5
        extra.close()
        assert _eventually(lambda: lst.snapshot()["refusals"].get("limit") == 1)
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while lst.snapshot()["connections"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _legit(cluster, lst.port) == b"hello"  # the held ones went away: served again
    lst.stop()


def test_peer_without_a_pinned_leaf_never_reaches_protocol_code(cluster, tmp_path):
    served = []
    lst = _listener(cluster, tmp_path, serve=lambda ch: served.append(ch.peer.leaf_sha256))
    try:
        # prefill-b is enrolled (same CA) but not pinned by decode-a's per-producer config
        ep = cluster.producer_config("prefill-b").data_endpoint("decode-a")
        with pytest.raises((KvpackError, OSError)):
            ch = connect(ep, "127.0.0.1", lst.port, timeout=5)
            ch.sendall(b"hello")
            ch.recv_exact(5)
        assert _eventually(lambda: sum(lst.snapshot()["refusals"].values()) >= 1)
        assert served == []
    finally:
        lst.stop()


def test_authenticated_peers_are_capped_per_leaf(cluster, tmp_path):
    release = threading.Event()
    lst = _listener(cluster, tmp_path, serve=lambda ch: release.wait(10), max_per_peer=2)
    ep = cluster.producer_config().data_endpoint("decode-a")
    chans = []
    try:
        chans = [connect(ep, "127.0.0.1", lst.port, timeout=5) for _ in range(2)]
        with pytest.raises((KvpackError, OSError)):  # refused: closed before or right after the handshake
            third = connect(ep, "127.0.0.1", lst.port, timeout=5)
            third.settimeout(3)
            third.sendall(b"x")
            assert third.recv(1) == b""
            raise ConnectionResetError
        assert _eventually(lambda: lst.snapshot()["refusals"].get("limit") == 1)
    finally:
        release.set()
        for c in chans:
            c.close()
        lst.stop()


def test_bind_failures_are_one_typed_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(NetworkError) as info:
            bind_tcp("127.0.0.1", port, "data listener")
        assert info.value.category == "address_in_use" and f"127.0.0.1:{port}" in info.value.message
    with pytest.raises(NetworkError) as info:
        bind_tcp("192.0.2.77", 0, "data listener")
    assert info.value.category == "address_not_available"


def _drain(fd):
    got = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return got
        if not chunk:
            return got
        got += chunk


def test_a_hung_refusal_log_disk_never_stops_accepts(cluster, tmp_path):
    # the refusal summary's file is a FIFO nobody reads: opening it for writing blocks
    # forever, like a write to a hung disk. The summary used to be written on the accept
    # thread (count -> flush -> append): after the first refused connection the listener
    # accepted nothing more.
    fifo = str(tmp_path / "refusals.log")
    os.mkfifo(fifo)
    refusals = RefusalLog("receiver", fifo, interval_s=0.0)
    ep = cluster.receiver_config().data_endpoint()
    lst = Listener("test", bind_tcp("127.0.0.1", 0, "data listener"), ep, server_context(ep), _echo, refusals=refusals).start()
    try:
        for _ in range(3):  # refused before authentication: not TLS at all
            with socket.create_connection(("127.0.0.1", lst.port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n" * 4)
                s.settimeout(5)
                try:
                    s.recv(16)
                except OSError:
                    pass
        assert _eventually(lambda: refusals.snapshot()["writer_stuck_s"] is not None)
        assert _eventually(lambda: sum(lst.snapshot()["refusals"].values()) >= 3)
        # the writer is stuck in the log's open(); accepts and handshakes go on
        assert [_legit(cluster, lst.port) for _ in range(3)] == [b"hello"] * 3
        assert refusals.flush(timeout=0.2) is None  # a stuck writer holds a flush only this long
        assert refusals.lines_written == 0
        counted = sum(lst.snapshot()["refusals"].values())
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the disk answers again
        try:
            lst.stop()  # its final flush waits for the writer, now unblocked
            refusals.close(timeout=5.0)
            written = _drain(reader)
        finally:
            os.close(reader)
    # every refusal counted while the disk hung went out in the summary lines
    lines = [json.loads(x) for x in written.splitlines()]
    assert lines and all(x["event"] == "refusals" for x in lines)
    assert sum(sum(x["counts"].values()) for x in lines) == counted


def test_a_failing_refusal_log_write_costs_the_line_not_the_counts(tmp_path):
    rlog = RefusalLog("producer", str(tmp_path / "missing-dir" / "refusals.log"), interval_s=0.0)
    for i in range(50):
        rlog.count("handshake_timeout", "idle", f"127.0.0.1:{i}")
    rlog.flush(timeout=5.0)
    rlog.close(timeout=5.0)
    snap = rlog.snapshot()
    assert snap["totals"] == {"handshake_timeout": 50}
    assert snap["write_failures"] >= 1 and snap["writer_stuck_s"] is None


def test_the_rest_of_a_burst_of_refusals_is_written_without_another_refusal(tmp_path):
    # a burst: the first refusal's line is due at once, the rest are counted after it. They
    # used to wait in memory for the next refusal after the interval (hours, on a quiet node;
    # never, if none came); the writer now writes them once the interval passed.
    path = tmp_path / "refusals.log"
    rlog = RefusalLog("receiver", str(path), interval_s=0.5)
    rlog._flushed -= 1.0  # the first count is due

    def written() -> list:
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    try:
        rlog.count("handshake_timeout", "idle", "127.0.0.1:1")
        assert _eventually(lambda: len(written()) == 1, 5.0)
        for i in range(4):  # within the interval of that line: none is due
            rlog.count("handshake_timeout", "idle", f"127.0.0.1:{2 + i}")
        assert _eventually(lambda: sum(x["counts"]["handshake_timeout"] for x in written()) == 5, 5.0), written()
    finally:
        rlog.close(timeout=5.0)


def test_a_closed_refusal_log_answers_a_flush_at_once(tmp_path):
    # a node stopped twice (a failed start, then the caller's stop) flushes a closed log:
    # no writer will answer, so the flush must not wait out its timeout
    rlog = RefusalLog("producer", str(tmp_path / "refusals.log"), interval_s=0.0)
    rlog.count("tls", "not TLS", "127.0.0.1:1")
    rlog.close(timeout=5.0)
    assert rlog._writer is not None
    rlog._writer.join(5.0)  # the writer ends after its last pass
    assert not rlog._writer.is_alive() and rlog.lines_written == 1
    rlog.count("tls", "not TLS", "127.0.0.1:2")  # counted after close: totals only
    t0 = time.monotonic()
    assert rlog.flush(timeout=30.0) is None
    assert time.monotonic() - t0 < 10.0  # not the 30 s timeout
    assert rlog.snapshot()["totals"] == {"tls": 2} and rlog.lines_written == 1
