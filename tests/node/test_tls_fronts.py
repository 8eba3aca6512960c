"""TLS front processes (node/tls_front.py) behind the shared listener, on real loopback
sockets and mutual TLS: legitimate peers are served through the relay; a peer failing mTLS
is refused in the front with its category and counted by the daemon; idle and trickling
peers, authenticated or not, still cost one slot until their deadline; a front killed with
SIGKILL fails exactly the connections it held and is respawned (or, past its restart
budget, the listener handshakes in-process); stop() leaves no child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import socket
import threading
import time

import pytest

from kvpack.errors import KvpackError, ProtocolError, SecurityError
from kvpack.node import tls_front
from kvpack.node.common import load_engine
from kvpack.node.receipts import RefusalLog
from kvpack.node.tls_front import FrontPool, RelayChannel, auto_fronts, resolve_fronts
from kvpack.node.transport import Deadline, Limits, Listener, bind_tcp, fill
from kvpack.security.tls import TlsEndpoint, connect, server_context

from .helpers import Enrolled


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("fronts")
    return Enrolled(str(root / "cluster"), load_engine("arrays:2:1:8"), producers=("prefill-a", "prefill-b"))


def _echo(chan):
    buf = memoryview(bytearray(5))
    if fill(chan, buf, Deadline(5.0, what="echo")) == 5:
        chan.sendall(bytes(buf))


def _fronted(cluster, tmp_path, serve=_echo, fronts=2, linger_s=tls_front.RELAY_LINGER_S, **limits):
    ep = cluster.receiver_config().data_endpoint()
    lim = Limits(**limits)
    pool = FrontPool("test", ep, fronts, lim.handshake_s, linger_s=linger_s).start()
    refusals = RefusalLog("receiver", str(tmp_path / "refusals.log"), interval_s=0.2)
    sock = bind_tcp("127.0.0.1", 0, "data listener")
    return Listener("test", sock, ep, server_context(ep), serve, limits=lim, refusals=refusals, fronts=pool).start()


def _eventually(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def _legit(cluster, port, data=b"hello"):
    ch = connect(cluster.producer_config().data_endpoint("decode-a"), "127.0.0.1", port, timeout=10)
    try:
        ch.sendall(data)
        return ch.recv_exact(len(data))
    finally:
        ch.close()


def _children(parent: int | None = None) -> set[int]:
    """Live child processes of ``parent`` (default: this process), from /proc."""
    me, out = os.getpid() if parent is None else parent, set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(name))
    return out


def test_auto_is_half_the_cores_from_eight_and_settings_are_checked():
    assert [auto_fronts(n) for n in (1, 2, 4, 7, 8, 12, 16, 64)] == [0, 0, 0, 0, 4, 6, 8, 8]
    assert resolve_fronts("auto", 16) == 8 and resolve_fronts("3") == 3 and resolve_fronts(0) == 0
    for bad in ("many", -1, tls_front.MAX_FRONTS + 1, True):
        with pytest.raises(SecurityError) as info:
            resolve_fronts(bad)
        assert info.value.category == "config"


def test_relayed_peers_are_served_and_stop_leaves_no_child(cluster, tmp_path):
    before = _children()
    lst = _fronted(cluster, tmp_path)
    pids = set(lst.fronts.pids())
    assert len(pids) == 2 and pids <= _children()
    try:
        # larger than one relay batch, both ways through the front, byte-exact
        big = os.urandom(3 * tls_front.RELAY_BATCH_BYTES + 12345)

        def serve_big(chan):
            assert isinstance(chan, RelayChannel)
            buf = memoryview(bytearray(len(big)))
            assert fill(chan, buf, Deadline(30.0, what="big")) == len(big)
            chan.sendall(bytes(buf[:1000]))

        lst.serve = serve_big
        ch = connect(cluster.producer_config().data_endpoint("decode-a"), "127.0.0.1", lst.port, timeout=10)
        ch.sendall(big)
        assert ch.recv_exact(1000) == big[:1000]
        ch.close()
        lst.serve = _echo
        assert [_legit(cluster, lst.port) for _ in range(6)] == [b"hello"] * 6
        snap = lst.snapshot()["tls_fronts"]
        assert snap["relayed_total"] == 7 and snap["live"] == 2
    finally:
        lst.stop()
    assert _children() == before  # every front exited and was reaped
    assert lst.snapshot()["connections"] == 0


def test_a_peer_failing_mtls_is_refused_in_the_front_and_counted(cluster, tmp_path):
    served = []
    refused = []
    lst = _fronted(cluster, tmp_path, serve=lambda ch: served.append(ch.peer.leaf_sha256))
    lst.on_refused = lambda reason, detail, peer: refused.append(reason)
    try:
        # prefill-b is enrolled (same CA) but its leaf is not pinned by decode-a's config
        ep = cluster.producer_config("prefill-b").data_endpoint("decode-a")
        with pytest.raises((KvpackError, OSError)):
            ch = connect(ep, "127.0.0.1", lst.port, timeout=5)
            ch.sendall(b"hello")
            ch.recv_exact(5)
        assert _eventually(lambda: lst.snapshot()["refusals"].get("pin") == 1)
        assert refused == ["pin"] and served == []
        snap = lst.snapshot()
        assert snap["handshakes"] == 0 and snap["connections"] == 0 and snap["tls_fronts"]["relayed_total"] == 0
    finally:
        lst.stop()


def test_idle_and_trickling_peers_time_out_while_legitimate_ones_are_served(cluster, tmp_path):
    outcomes: list = []

    def serve(chan):
        # a whole-read deadline with shorter gaps, as the daemons give a first frame
        buf = memoryview(bytearray(5))
        try:
            got = fill(chan, buf, Deadline(1.5, 1.0, what="first frame"))
            if got == 5 and bytes(buf[:5]) == b"hello":
                chan.sendall(b"hello")
                outcomes.append("served")
                return
            outcomes.append(("short", got))
        except Exception as exc:  # noqa: BLE001 - recorded for the asserts
            outcomes.append(type(exc))

    lst = _fronted(cluster, tmp_path, serve=serve, handshake_s=1.5)
    stop = threading.Event()
    ep = cluster.producer_config().data_endpoint("decode-a")
    idle_tcp = [socket.create_connection(("127.0.0.1", lst.port)) for _ in range(16)]
    silent = [connect(ep, "127.0.0.1", lst.port, timeout=10) for _ in range(2)]
    trickler = connect(ep, "127.0.0.1", lst.port, timeout=10)

    def trickle():
        try:
            while not stop.is_set():
                trickler.sendall(b"x")  # 5 bytes would take 2.4 s: past the 1.5 s deadline
                time.sleep(0.6)
        except (OSError, KvpackError):
            return

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        hello = []
        for _ in range(10):
            ch = connect(ep, "127.0.0.1", lst.port, timeout=10)
            ch.sendall(b"hello")
            hello.append(ch.recv_exact(5))
            ch.close()
        assert hello == [b"hello"] * 10
        # the unauthenticated ones are dropped at the handshake deadline, in the fronts
        assert _eventually(lambda: lst.snapshot()["refusals"].get("handshake_timeout", 0) >= 16)
        for s in idle_tcp:
            s.settimeout(10)
            assert s.recv(16) == b""
        # the silent and the trickling authenticated peers hit their read deadlines
        assert _eventually(lambda: len(outcomes) == 13)
    finally:
        stop.set()
        th.join(timeout=10)
        for s in idle_tcp:
            s.close()
        for c in (*silent, trickler):
            c.close()
        lst.stop()
    assert outcomes.count("served") == 10
    rest = [o for o in outcomes if o != "served"]
    # silent: "closed before speaking" (SecurityError) as over in-process TLS; the trickler spoke
    assert sorted(o.__name__ for o in rest) == ["SecurityError", "SecurityError", "TimeoutError"]
    snap = lst.snapshot()
    assert snap["connections"] == 0 and snap["handshakes"] == 0 and snap["authenticated"] == 0


def test_a_killed_front_fails_its_connections_and_is_respawned(cluster, tmp_path):
    outcomes: list = []
    holding = threading.Event()

    def serve(chan):
        buf = memoryview(bytearray(10))
        try:
            fill(chan, buf[:5], Deadline(60.0, what="hold"))
            if bytes(buf[:5]) == b"hello":
                chan.sendall(b"hello")
                return
            holding.set()
            fill(chan, buf[5:], Deadline(60.0, what="hold"))  # only 2 of 5 will come
            outcomes.append("no error")
        except Exception as exc:  # noqa: BLE001 - recorded for the asserts
            outcomes.append(exc)

    lst = _fronted(cluster, tmp_path, serve=serve, fronts=1, handshake_s=30)
    victim = lst.fronts.pids()[0]
    ep = cluster.producer_config().data_endpoint("decode-a")
    held = connect(ep, "127.0.0.1", lst.port, timeout=10)
    try:
        held.sendall(b"0123456")  # 7 of 10 bytes: the worker waits for the rest
        assert holding.wait(20)
        idle = socket.create_connection(("127.0.0.1", lst.port))  # a handshake in flight there
        assert _eventually(lambda: lst.snapshot()["handshakes"] == 1)
        os.kill(victim, signal.SIGKILL)
        assert _eventually(lambda: len(outcomes) == 1)
        assert isinstance(outcomes[0], ProtocolError) and outcomes[0].category == "aborted"
        assert "exited" in outcomes[0].message
        assert _eventually(lambda: lst.snapshot()["refusals"].get("front_lost") == 1)
        assert _eventually(lambda: lst.snapshot()["tls_fronts"]["restarts"] == 1 and lst.snapshot()["tls_fronts"]["live"] == 1)
        assert victim not in lst.fronts.pids()
        assert _legit(cluster, lst.port) == b"hello"  # served by the new front
        assert lst.snapshot()["tls_fronts"]["relayed_total"] == 2
        idle.close()
    finally:
        held.close()
        lst.stop()
    snap = lst.snapshot()
    assert snap["connections"] == 0 and snap["handshakes"] == 0 and snap["authenticated"] == 0


def test_past_the_restart_budget_the_listener_handshakes_in_process(cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(tls_front, "MAX_RESTARTS", 0)
    before = _children()
    lst = _fronted(cluster, tmp_path, fronts=2)
    try:
        for pid in lst.fronts.pids():
            os.kill(pid, signal.SIGKILL)
        assert _eventually(lambda: lst.fronts.live == 0)
        assert [_legit(cluster, lst.port) for _ in range(3)] == [b"hello"] * 3
        snap = lst.snapshot()
        assert snap["tls_fronts"]["relayed_total"] == 0 and snap["tls_fronts"]["restarts"] == 0
    finally:
        lst.stop()
    assert _children() == before


def test_the_per_leaf_cap_applies_to_relayed_peers(cluster, tmp_path):
    release = threading.Event()
    lst = _fronted(cluster, tmp_path, serve=lambda ch: release.wait(20), max_per_peer=1)
    ep = cluster.producer_config().data_endpoint("decode-a")
    first = connect(ep, "127.0.0.1", lst.port, timeout=5)
    try:
        assert _eventually(lambda: lst.snapshot()["authenticated"] == 1)
        with pytest.raises((KvpackError, OSError)):
            second = connect(ep, "127.0.0.1", lst.port, timeout=5)
            second.settimeout(10)
            second.sendall(b"x")
            assert second.recv(1) == b""
            raise ConnectionResetError
        assert _eventually(lambda: lst.snapshot()["refusals"].get("limit") == 1)
    finally:
        release.set()
        first.close()
        lst.stop()


def test_a_front_that_cannot_load_the_key_fails_the_start_typed(cluster, tmp_path):
    before = _children()
    ep = cluster.receiver_config().data_endpoint()
    broken = TlsEndpoint(ep.certificate_chain, str(tmp_path / "missing.key"), ep.peer_ca, ep.peer_pins, ep.alpn)
    with pytest.raises(SecurityError) as info:
        FrontPool("test", broken, 2, 5.0).start()
    assert info.value.category == "secret_file" and "missing.key" in info.value.message
    assert _children() == before


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except OSError:
        return True


def test_fronts_exit_when_their_daemon_dies(cluster, tmp_path):
    """No orphans: a daemon killed with SIGKILL (no stop()) leaves no front running."""
    ep = cluster.receiver_config().data_endpoint()
    script = (
        "import sys\n"
        "from kvpack.node.tls_front import FrontPool\n"
        "from kvpack.security.tls import TlsEndpoint\n"
        f"ep = TlsEndpoint({ep.certificate_chain!r}, {ep.private_key!r}, {ep.peer_ca!r}, frozenset({sorted(ep.peer_pins)!r}), {ep.alpn!r})\n"
        "pool = FrontPool('orphans', ep, 2, 5.0).start()\n"
        "print(' '.join(map(str, pool.pids())), flush=True)\n"
        "sys.stdin.read()\n"
    )
    daemon = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in daemon.stdout.readline().split()]
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        daemon.kill()
        daemon.wait(30)
        assert _eventually(lambda: all(_gone(p) for p in pids))
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(30)


def test_the_receiver_daemon_runs_its_fronts_and_leaves_none(tmp_path):
    """``kvpack receiver --tls-fronts 2``: the ready line says 2, a 4-stripe handoff through
    them commits and decodes, and SIGTERM leaves no front behind."""
    import tempfile

    from kvpack.node.local_api import request_local

    from .helpers import Daemon, producer_daemon

    spec = "arrays:4:2:32"
    enrolled = Enrolled(str(tmp_path / "cluster"), load_engine(spec))
    common = ["--engine", spec, "--no-store", "--no-metrics"]
    producer = producer_daemon(enrolled, common)
    sock = os.path.join(tempfile.mkdtemp(prefix="kvf-"), "r.sock")
    receiver = Daemon(["receiver", "--config", enrolled.receiver_config_path(), *common, "--socket", sock, "--tls-fronts", "2", "--stripes", "4"])
    try:
        ready = receiver.wait_ready()
        assert ready["tls_fronts"] == 2
        fronts = sorted(_children(receiver.proc.pid))
        assert len(fronts) == 2
        reply = request_local(sock, {"tokens": [(k * 7) % 50 + 1 for k in range(1500)], "max_new_tokens": 2}, timeout=120)
        assert reply["ok"], reply
        assert reply["result"]["plan"]["action"] == "full_transfer" and reply["result"]["transfer"]["stripes"] == 4
    finally:
        receiver.stop()
        producer.stop()
    assert receiver.proc.returncode == 0
    assert _eventually(lambda: all(_gone(p) for p in fronts))


def test_a_wedged_front_costs_its_handshakes_only_until_the_parents_backstop(cluster, tmp_path):
    """A front that stops answering (SIGSTOP) cannot hold a handshake slot past the deadline
    plus the grace: the daemon drops it and counts ``handshake_timeout``; the front's late
    report for it, once it runs again, changes nothing."""
    lst = _fronted(cluster, tmp_path, fronts=1, handshake_s=1.0)
    pid = lst.fronts.pids()[0]
    idle = None
    try:
        os.kill(pid, signal.SIGSTOP)
        idle = socket.create_connection(("127.0.0.1", lst.port))
        assert _eventually(lambda: lst.snapshot()["handshakes"] == 1)
        assert _eventually(lambda: lst.snapshot()["refusals"].get("handshake_timeout") == 1)
        snap = lst.snapshot()
        assert snap["handshakes"] == 0 and snap["connections"] == 0
        os.kill(pid, signal.SIGCONT)
        idle.settimeout(20)
        assert idle.recv(16) == b""  # the front closed it at its own deadline, then reported
        # that report precedes this connection's on the front's one control stream
        assert _legit(cluster, lst.port) == b"hello"
        snap = lst.snapshot()
        assert snap["refusals"] == {"handshake_timeout": 1} and snap["connections"] == 0 and snap["tls_fronts"]["restarts"] == 0
    finally:
        os.kill(pid, signal.SIGCONT)
        if idle is not None:
            idle.close()
        lst.stop()


def _relay_pair():
    from kvpack.security.tls import PeerInfo

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return RelayChannel(mine, PeerInfo("a" * 64, "muser-kvpack-v2", "TLSv1.3", "x"), "127.0.0.1:9", 0), theirs


@pytest.mark.parametrize(
    "spoke,report,expect",
    [
        (True, {"status": "eof"}, 0),
        (False, {"status": "eof"}, ("SecurityError", "tls", "closed the connection before sending anything")),
        (True, {"status": "tls", "category": "tls", "detail": "read: TLS failure (BAD_RECORD_MAC)"}, ("SecurityError", "tls", "BAD_RECORD_MAC")),
        (True, {"status": "tls", "category": "not-a-category", "detail": "odd"}, ("SecurityError", "tls", "odd")),
        (True, {"status": "conn", "errno": 104, "detail": "ConnectionResetError: reset"}, ("ConnectionResetError", None, "reset")),
        (False, {"status": "conn", "errno": 104, "detail": "reset"}, ("SecurityError", "tls", "before sending anything")),
        (True, {"status": "aborted", "detail": "TLS front 0 (pid 1) exited"}, ("ProtocolError", "aborted", "exited")),
    ],
)
def test_a_relayed_read_ends_as_a_tls_read_would(spoke, report, expect):
    chan, theirs = _relay_pair()
    try:
        buf = bytearray(8)
        if spoke:
            theirs.sendall(b"abc")
            assert chan.recv_into(buf) == 3 and chan.peer_has_spoken and chan.bytes_received == 3
        chan.report_read_end(report)
        chan.report_read_end({"status": "eof"})  # only the first report counts
        theirs.shutdown(socket.SHUT_WR)
        if expect == 0:
            assert chan.recv_into(buf) == 0
            return
        with pytest.raises(Exception) as info:
            chan.recv_into(buf)
        kind, category, text = expect
        assert type(info.value).__name__ == kind and text in str(info.value)
        if category is not None:
            assert info.value.category == category
    finally:
        chan.close()
        theirs.close()


def test_a_relayed_read_without_a_report_is_aborted_and_timeouts_stay_timeouts(monkeypatch):
    monkeypatch.setattr(tls_front, "END_REPORT_WAIT_S", 0.05)
    chan, theirs = _relay_pair()
    try:
        chan.settimeout(0.05)
        with pytest.raises(SecurityError):  # silent since the handshake: as TlsChannel
            chan.recv_into(bytearray(4))
        theirs.sendall(b"x")
        chan.recv_into(bytearray(4))
        with pytest.raises(TimeoutError):
            chan.recv_into(bytearray(4))
        theirs.close()
        with pytest.raises(ProtocolError) as info:
            chan.recv_into(bytearray(4))
        assert info.value.category == "aborted" and "did not report" in info.value.message
    finally:
        chan.close()


def test_concurrent_relayed_streams_arrive_byte_exact_over_both_fronts(cluster, tmp_path):
    import hashlib

    size = 2 * tls_front.RELAY_BATCH_BYTES + 777
    seen_fronts: list = []

    def serve(chan):
        seen_fronts.append(chan.front)
        buf = memoryview(bytearray(size))
        assert fill(chan, buf, Deadline(60.0, what="stream")) == size
        chan.sendall(hashlib.sha256(buf).digest())

    lst = _fronted(cluster, tmp_path, serve=serve)
    ep = cluster.producer_config().data_endpoint("decode-a")
    results: dict = {}

    def client(i):
        data = os.urandom(size)
        ch = connect(ep, "127.0.0.1", lst.port, timeout=20)
        try:
            ch.sendall(data)
            results[i] = ch.recv_exact(32) == hashlib.sha256(data).digest()
        finally:
            ch.close()

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        lst.stop()
    assert results == {i: True for i in range(12)}
    assert sorted(set(seen_fronts)) == [0, 1]  # dispatched to the least loaded: both used


def test_a_peer_that_stops_reading_does_not_keep_a_relay_after_the_daemon_closes(cluster, tmp_path):
    """The daemon answers more than the socket buffers hold and closes its end (as a
    deadline would); the authenticated peer never reads. The front must drop the relay --
    its thread, its TLS socket -- instead of waiting on the peer forever: the daemon
    released the slot, so nothing else bounds what such relays would hold."""
    answered = threading.Event()

    def flood(chan):
        buf = memoryview(bytearray(1))
        if fill(chan, buf, Deadline(5.0, what="flood")) == 1:
            chan.settimeout(0.5)
            try:
                while True:  # until the socketpair and the peer's buffers are full
                    chan.sendall(b"x" * (1 << 20))
            except OSError:
                pass
        answered.set()

    lst = _fronted(cluster, tmp_path, serve=flood, fronts=1, linger_s=1.0)
    try:
        ch = connect(cluster.producer_config().data_endpoint("decode-a"), "127.0.0.1", lst.port, timeout=10)
        try:
            ch.sendall(b"!")
            assert answered.wait(20)  # the daemon gave up and closed its end
            assert _eventually(lambda: lst.fronts.snapshot()["connections"] == [0], timeout=10)
        finally:
            ch.close()
    finally:
        lst.stop()
