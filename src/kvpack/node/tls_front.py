"""TLS front processes: a listener's TLS record work (handshakes and bulk decryption) in
helper processes, so one daemon's connections decrypt in parallel.

Why it exists: CPython's ``ssl`` hands out at most one 16 KiB TLS record per ``recv_into``
and releases and retakes the GIL around each. Four receiving TLS threads of one process
reached 13 Gbps on the 16-core H200 host where four processes reached 55.8
(benchmarks/diag_stripe_gil.py, docs/bench/nodes_profile.md "Round 4"), so a decode node
striping a handoff over four connections was bound by its GIL, not by the wire. Here the
record work leaves the daemon's process; what the daemon reads is plain bytes from a Unix
socket, in large pieces (one GIL release per ~1 MiB instead of per 16 KiB).

How (docs/operations.md, "TLS front processes"):

* The daemon's :class:`~kvpack.node.transport.Listener` keeps everything it did: it binds,
  accepts raw TCP, applies the connection / handshake / per-address limits, and counts
  refusals. It then passes the raw socket (``SCM_RIGHTS``) to the front holding the fewest
  connections, with one end of a fresh ``socketpair`` whose other end it keeps.
* A front (``python -m kvpack.node.tls_front``, started at bind time, before any model
  loads) builds its own ``SSLContext`` from the endpoint's files (the same secret-file
  checks; nothing secret is pickled or sent), runs every handshake non-blocking under the
  whole-handshake deadline, runs :func:`~kvpack.security.tls.verify_peer` (TLS 1.3, CA,
  pinned leaf, exact ALPN) and reports ``auth`` (the peer's fields) or ``refused``
  (category, detail) on its control socket. The listener releases the handshake slot,
  applies ``max_per_peer`` and, for an authenticated peer, runs the daemon's unchanged
  ``serve(channel)`` with a :class:`RelayChannel` over its socketpair end.
* After authentication the front relays, one thread per connection, non-blocking sockets
  and one selector (one thread owns the ``SSLSocket``: never read and write it from two):
  TLS -> Unix in batches (records read into a 1 MiB buffer until the socket runs dry or the
  buffer fills, then one send), Unix -> TLS for the daemon's small replies (ACKs,
  responses). How the read direction ended (EOF, a TLS error and its category, a reset) is
  reported on the control socket *before* the Unix write side is shut, so the channel
  raises the same typed errors as :class:`~kvpack.security.tls.TlsChannel`.
* Deadlines stay in the daemon: a :class:`RelayChannel` read waits on its Unix socket under
  the same ``settimeout`` / :class:`~kvpack.node.transport.Deadline` as a TLS read, and
  the daemon closing its end makes the front close the TCP connection. A front holds no
  protocol state: an unauthenticated peer costs one bounded handshake slot, as before.
* A front exits when its control socket reaches EOF (the daemon stopped or died): no
  orphans. A front that dies fails the connections it held (handshakes are counted
  ``front_lost``; relayed reads raise ``aborted``) and is **respawned**, at most
  :data:`MAX_RESTARTS` times per :data:`RESTART_WINDOW_S`; past that its slot stays empty
  and, with no front left, the listener runs handshakes in-process again (degraded, logged).

What it must never do: run protocol code (the fronts only move bytes), hand a connection to
the daemon before ``verify_peer`` passed, or leave a front process behind after ``stop()``.
"""

from __future__ import annotations

import array
import errno
import itertools
import json
import logging
import os
import select
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Union

from ..errors import KvpackError, ProtocolError, SecurityError
from ..security.tls import SocketChannel, PeerInfo, TlsEndpoint, _closed_before_speaking, map_tls_error, server_context, verify_peer

log = logging.getLogger("kvpack.node.tls_front")

#: the fronts of a listener at most (one per core is the useful bound)
MAX_FRONTS = 64
#: the parent gives a front this long past the handshake deadline before it drops a
#: connection itself (the front's own deadline is the one that normally fires)
HANDSHAKE_GRACE_S = 1.0
#: socketpair buffers between a front and the daemon (the kernel caps them at wmem_max)
RELAY_SOCKET_BYTES = 4 << 20
#: the TLS -> Unix batch: records are read into it until the socket runs dry or it fills
RELAY_BATCH_BYTES = 1 << 20
#: a read that hit the socketpair's end waits this long for the front's report of why
END_REPORT_WAIT_S = 5.0
#: how long a relay keeps the daemon's last bytes for a peer that does not read them once
#: the daemon has closed its end (its deadline passed or its reply is complete): then the
#: relay ends, so a peer that stops reading holds a front's thread and socket this long at
#: most, not until it closes
RELAY_LINGER_S = 30.0
#: how often a relay with bytes the peer is not taking looks whether the daemon has gone
RELAY_LINGER_POLL_S = 0.5
#: respawns of one front slot within RESTART_WINDOW_S before the slot stays empty
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
#: a front must report ready (context built) within this
START_TIMEOUT_S = 60.0
_MSG_BYTES = 1 << 16

FrontsSetting = Union[int, str]


def auto_fronts(cpus: Optional[int] = None) -> int:
    """``auto``: min(8, cpus // 2) on a host of 8 cores or more, else 0 (in-process TLS:
    on a small host the fronts' processes would only compete with the daemon)."""
    n = (os.cpu_count() or 1) if cpus is None else cpus
    return min(8, n // 2) if n >= 8 else 0


def resolve_fronts(value: FrontsSetting, cpus: Optional[int] = None) -> int:
    """The number of fronts a ``tls_fronts`` setting means (``auto`` or 0..MAX_FRONTS)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return auto_fronts(cpus)
        try:
            value = int(text)
        except ValueError:
            raise SecurityError("config", f"tls_fronts {value!r} is neither 'auto' nor a number") from None
    if isinstance(value, bool) or not 0 <= int(value) <= MAX_FRONTS:
        raise SecurityError("config", f"tls_fronts must be 'auto' or 0..{MAX_FRONTS}, not {value!r}")
    return int(value)


# -- control messages (AF_UNIX SOCK_SEQPACKET: one JSON object per message, fds attached) ---------


def _send(ctl: socket.socket, obj: dict, fds: tuple[int, ...] = (), *, nowait: bool = False) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    ctl.sendmsg([data], anc, socket.MSG_DONTWAIT if nowait else 0)


def _recv(ctl: socket.socket) -> tuple[Optional[dict], list[int]]:
    """One message and its fds; (None, []) at EOF."""
    msg, fds, _flags, _addr = socket.recv_fds(ctl, _MSG_BYTES, 2)
    if not msg:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(msg), list(fds)


# -- the daemon's side of a relayed connection -------------------------------------------------


class RelayChannel(SocketChannel):
    """A verified connection whose TLS a front terminates: what the daemons use of
    :class:`~kvpack.security.tls.TlsChannel`, over the daemon's end of a socketpair.

    Reads return what the front decrypted, in large pieces; at the end of the stream the
    front's report (on its control socket) says why, and the read raises exactly what a
    TLS read would have: a typed :class:`~kvpack.errors.SecurityError` for a TLS failure,
    ``ConnectionResetError`` for a reset, "closed before speaking" for a peer that never
    sent a byte, 0 for an orderly EOF; ``aborted`` when the front itself died."""

    side = "server"

    def __init__(self, sock: socket.socket, peer: PeerInfo, peer_address: str, front: int) -> None:
        self.sock = sock
        self.peer = peer
        self.peer_address = peer_address
        self.front = front
        self.peer_has_spoken = False
        self.bytes_received = 0
        self._read_end: Optional[dict] = None
        self._read_ended = threading.Event()

    def report_read_end(self, status: dict) -> None:
        """The front's report of how the read direction ended (the first one counts)."""
        if self._read_end is None:
            self._read_end = status
            self._read_ended.set()

    # Reads ---------------------------------------------------------------------------------------
    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        if not view:
            return 0
        try:
            n = self.sock.recv_into(view)
        except TimeoutError:  # socket.timeout is TimeoutError
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address) from None
            raise
        except ConnectionError:
            return self._ended()
        if n == 0:
            return self._ended()
        self.peer_has_spoken = True
        self.bytes_received += n
        return n

    def _ended(self) -> int:
        if not self._read_ended.wait(END_REPORT_WAIT_S):
            raise ProtocolError("aborted", f"TLS front {self.front} did not report how the connection from {self.peer_address} ended", remote=False)
        st = self._read_end or {}
        status, detail = st.get("status"), str(st.get("detail", ""))
        if status == "eof":
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address)
            return 0
        if status == "tls":
            category = st.get("category")
            raise SecurityError(category if category in SecurityError.CATEGORIES else "tls", detail)
        if status == "conn":
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address)
            raise ConnectionResetError(int(st.get("errno") or errno.ECONNRESET), detail)
        raise ProtocolError("aborted", detail or f"TLS front {self.front} dropped the connection from {self.peer_address}", remote=False)

    def has_pending(self) -> bool:
        return False

    # Writes --------------------------------------------------------------------------------------
    def sendall(self, data: Any) -> None:
        try:
            self.sock.sendall(data)
        except ConnectionError:
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address) from None
            raise


# -- the pool (daemon side) --------------------------------------------------------------------


@dataclass
class _Conn:
    id: int
    host: str
    peer: str
    parent_end: socket.socket
    deadline: float
    chan: Optional[RelayChannel] = None


@dataclass
class _Front:
    index: int
    proc: subprocess.Popen
    ctl: socket.socket
    conns: dict = field(default_factory=dict)
    alive: bool = True
    pid: int = 0


class FrontHost(Protocol):
    """What a pool tells its listener (implemented by :class:`~kvpack.node.transport.Listener`)."""

    def front_refused(self, host: str, peer: str, reason: str, detail: str) -> None: ...

    def front_authenticated(self, host: str, chan: RelayChannel) -> None: ...


class FrontPool:
    """``count`` TLS front processes for one listener endpoint (see the module docstring)."""

    def __init__(self, name: str, endpoint: TlsEndpoint, count: int, handshake_s: float, *, linger_s: float = RELAY_LINGER_S) -> None:
        if count < 1:
            raise ValueError("a front pool needs at least one front")
        self.name = name
        self.endpoint = endpoint
        self.count = count
        self.handshake_s = handshake_s
        self.linger_s = linger_s
        self.host: Optional[FrontHost] = None
        self._fronts: list[Optional[_Front]] = [None] * count
        self._restarts: list[list[float]] = [[] for _ in range(count)]
        self.restarts_total = 0
        #: connections a front authenticated and relayed
        self.relayed_total = 0
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._stopping = False
        self._started = False
        #: fronts being respawned (not yet ready): stop() kills them too
        self._starting: list[_Front] = []

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "FrontPool":
        """Spawn every front and wait until each built its TLS context; the first failure
        (unreadable key, bad CA ...) is raised as the front reported it, typed."""
        if self._started:
            return self
        self._started = True
        spawned: list[_Front] = []
        try:
            for i in range(self.count):
                spawned.append(self._spawn(i))
            for front in spawned:
                self._await_ready(front)
        except BaseException:
            for front in spawned:
                self._kill(front)
            raise
        for front in spawned:
            self._install(front)
        return self

    def attach(self, host: FrontHost) -> None:
        self.host = host

    def _spawn(self, index: int) -> _Front:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        # the front runs this very package, whatever put it on the daemon's path
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpack.node.tls_front", str(child.fileno())],
                pass_fds=(child.fileno(),),
                # stdout is the daemon's (its ready line): a front never writes there;
                # stderr stays shared, so a front's crash shows in the daemon's log
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            parent.close()
            child.close()
            raise
        child.close()
        ep = self.endpoint
        try:
            _send(
                parent,
                {
                    "op": "config",
                    "name": f"{self.name}-front{index}",
                    "certificate_chain": ep.certificate_chain,
                    "private_key": ep.private_key,
                    "peer_ca": ep.peer_ca,
                    "peer_pins": sorted(ep.peer_pins),
                    "alpn": ep.alpn,
                    "handshake_s": self.handshake_s,
                    "linger_s": self.linger_s,
                },
            )
        except OSError:
            pass  # the front died at once: _await_ready reports it
        return _Front(index, proc, parent, pid=proc.pid)

    def _await_ready(self, front: _Front) -> None:
        try:
            front.ctl.settimeout(START_TIMEOUT_S)
            obj, fds = _recv(front.ctl)
            front.ctl.settimeout(None)
        except (OSError, ValueError) as exc:
            obj, fds = {"op": "fatal", "category": "tls", "detail": f"no answer: {exc}"}, []
        for fd in fds:
            os.close(fd)
        if obj is None:
            try:
                code: Optional[int] = front.proc.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            obj = {"op": "fatal", "category": "tls", "detail": f"closed its control socket (exit status {code}) before it was ready"}
        if obj.get("op") != "ready":
            category = obj.get("category")
            cls = SecurityError
            raise cls(category if category in cls.CATEGORIES else "tls", f"{self.name}: TLS front {front.index}: {obj.get('detail', obj)}")

    def _install(self, front: _Front) -> None:
        with self._lock:
            self._fronts[front.index] = front
        threading.Thread(target=self._read_loop, args=(front,), name=f"kvpack-{self.name}-front{front.index}", daemon=True).start()

    def stop(self, join_s: float = 5.0) -> None:
        """Close every control socket (a front exits at its EOF), then wait for the
        processes, killing any still there at ``join_s``."""
        with self._lock:
            self._stopping = True
            fronts = [f for f in self._fronts if f is not None]
            starting = list(self._starting)
        for front in starting:
            self._kill(front)
        for front in fronts:
            try:
                front.ctl.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        end = time.monotonic() + join_s
        for front in fronts:
            try:
                front.proc.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(front)
            front.ctl.close()

    @staticmethod
    def _kill(front: _Front) -> None:
        try:
            front.proc.kill()
        except OSError:
            pass
        try:
            front.proc.wait(10)
        except subprocess.TimeoutExpired:
            log.error("TLS front pid %s did not exit after SIGKILL", front.pid)
        front.ctl.close()

    # -- dispatch (the acceptor thread) --------------------------------------------------------
    def dispatch(self, raw: socket.socket, host: str, peer: str) -> bool:
        """Hand an accepted, counted TCP connection to the least-loaded live front; False
        when no front took it (the caller then handshakes in-process)."""
        tried: set[int] = set()
        while True:
            with self._lock:
                live = [f for f in self._fronts if f is not None and f.alive and f.index not in tried]
                if not live:
                    return False
                front = min(live, key=lambda f: len(f.conns))
                cid = next(self._ids)
                mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                conn = _Conn(cid, host, peer, mine, time.monotonic() + self.handshake_s + HANDSHAKE_GRACE_S)
                front.conns[cid] = conn
            tried.add(front.index)
            try:
                for s in (mine, theirs):
                    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                        s.setsockopt(socket.SOL_SOCKET, opt, RELAY_SOCKET_BYTES)
                # never block the acceptor on a wedged front: its queue full = not taken
                _send(front.ctl, {"op": "conn", "id": cid, "peer": peer}, (raw.fileno(), theirs.fileno()), nowait=True)
            except OSError as exc:
                with self._lock:
                    front.conns.pop(cid, None)
                mine.close()
                log.warning("%s: TLS front %d did not take a connection: %s", self.name, front.index, exc)
                continue
            finally:
                theirs.close()
            raw.close()
            return True

    def expire(self, now: float) -> None:
        """The parent's backstop: a handshake its front neither finished nor refused by the
        deadline plus a grace (a wedged front) is dropped and counted here."""
        stale: list[_Conn] = []
        with self._lock:
            for front in self._fronts:
                if front is None:
                    continue
                for cid, conn in list(front.conns.items()):
                    if conn.chan is None and conn.deadline <= now:
                        del front.conns[cid]
                        stale.append(conn)
        for conn in stale:
            conn.parent_end.close()
            self._refused(conn, "handshake_timeout", f"no complete TLS handshake within {self.handshake_s:g} s (front did not answer)")

    # -- reports (one reader thread per front) ------------------------------------------------
    def _read_loop(self, front: _Front) -> None:
        try:
            while True:
                try:
                    obj, fds = _recv(front.ctl)
                except (OSError, ValueError):
                    obj, fds = None, []
                for fd in fds:
                    os.close(fd)
                if obj is None:
                    break
                try:
                    self._report(front, obj)
                except Exception:  # noqa: BLE001 - one bad report never stops the reader
                    log.exception("%s: TLS front %d report %r", self.name, front.index, obj.get("op"))
        finally:
            self._lost(front)

    def _report(self, front: _Front, obj: dict) -> None:
        op, cid = obj.get("op"), obj.get("id")
        with self._lock:
            conn = front.conns.get(cid)
            if conn is not None and op in ("refused", "closed"):
                del front.conns[cid]
        if conn is None:
            return  # dropped by the backstop, or already ended
        if op == "auth":
            info = PeerInfo(str(obj["leaf"]), str(obj["alpn"]), str(obj["version"]), str(obj.get("cipher", "")))
            conn.parent_end.setblocking(True)
            with self._lock:
                self.relayed_total += 1
            conn.chan = RelayChannel(conn.parent_end, info, conn.peer, front.index)
            if self.host is not None:
                self.host.front_authenticated(conn.host, conn.chan)
            else:
                conn.chan.close()
        elif op == "refused":
            conn.parent_end.close()
            self._refused(conn, str(obj.get("category", "tls")), str(obj.get("detail", "")))
        elif op == "rd_end" and conn.chan is not None:
            conn.chan.report_read_end(obj)
        elif op == "closed":
            if conn.chan is not None:
                conn.chan.report_read_end({"status": "aborted", "detail": f"TLS front {front.index} closed the connection from {conn.peer}"})
            else:
                conn.parent_end.close()

    def _refused(self, conn: _Conn, reason: str, detail: str) -> None:
        if self.host is not None:
            self.host.front_refused(conn.host, conn.peer, reason, detail)

    def _lost(self, front: _Front) -> None:
        """A front's control socket ended: fail what it held; respawn unless stopping."""
        with self._lock:
            front.alive = False
            conns = list(front.conns.values())
            front.conns.clear()
            stopping = self._stopping
        detail = f"TLS front {front.index} (pid {front.pid}) exited"
        for conn in conns:
            if conn.chan is None:
                conn.parent_end.close()
                self._refused(conn, "front_lost", detail + " during the handshake")
            else:
                conn.chan.report_read_end({"status": "aborted", "detail": detail + f" while relaying the connection from {conn.peer}"})
        if stopping:
            return
        try:
            code = front.proc.wait(5)
        except subprocess.TimeoutExpired:
            self._kill(front)
            code = front.proc.returncode
        front.ctl.close()
        log.error("%s: %s with status %s; %d connections failed", self.name, detail, code, len(conns))
        self._respawn(front.index)

    def _respawn(self, index: int) -> None:
        now = time.monotonic()
        with self._lock:
            recent = [t for t in self._restarts[index] if now - t < RESTART_WINDOW_S]
            self._restarts[index] = recent
            if self._stopping or len(recent) >= MAX_RESTARTS:
                self._fronts[index] = None
                left = sum(1 for f in self._fronts if f is not None and f.alive)
                give_up = not self._stopping
            else:
                recent.append(now)
                give_up = False
        if give_up:
            log.error(
                "%s: TLS front %d restarted %d times in %g s: slot left empty (%d fronts live%s)",
                self.name,
                index,
                MAX_RESTARTS,
                RESTART_WINDOW_S,
                left,
                "; handshakes run in-process" if not left else "",
            )
            return
        if self._stopping:
            return
        try:
            front = self._spawn(index)
        except OSError as exc:
            log.error("%s: TLS front %d could not be restarted: %s", self.name, index, exc)
            with self._lock:
                self._fronts[index] = None
            return
        with self._lock:
            self._starting.append(front)
        try:
            self._await_ready(front)
        except KvpackError as exc:
            log.error("%s: TLS front %d could not be restarted: %s", self.name, index, exc)
            self._kill(front)
            with self._lock:
                self._fronts[index] = None
            return
        finally:
            with self._lock:
                self._starting.remove(front)
        with self._lock:
            self.restarts_total += 1
            stopping = self._stopping
        if stopping:
            self._kill(front)
            return
        self._install(front)

    # -- views ---------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        with self._lock:
            return sum(1 for f in self._fronts if f is not None and f.alive)

    def pids(self) -> list[int]:
        with self._lock:
            return [f.pid for f in self._fronts if f is not None and f.alive]

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "configured": self.count,
                "live": sum(1 for f in self._fronts if f is not None and f.alive),
                "restarts": self.restarts_total,
                "relayed_total": self.relayed_total,
                "connections": [len(f.conns) if f is not None else None for f in self._fronts],
            }


# -- the front process ---------------------------------------------------------------------------


class _Handshake:
    __slots__ = ("id", "tls", "unix", "peer", "deadline")

    def __init__(self, cid: int, tls: ssl.SSLSocket, unix: socket.socket, peer: str, deadline: float) -> None:
        self.id, self.tls, self.unix, self.peer, self.deadline = cid, tls, unix, peer, deadline


class _FrontServer:
    """The front's main thread: control messages and every handshake, one selector."""

    def __init__(self, ctl: socket.socket, endpoint: TlsEndpoint, context: ssl.SSLContext, handshake_s: float, linger_s: float = RELAY_LINGER_S) -> None:
        self.ctl = ctl
        self.endpoint = endpoint
        self.context = context
        self.handshake_s = handshake_s
        self.linger_s = linger_s
        self.sel = selectors.DefaultSelector()
        self.pending: dict[int, _Handshake] = {}
        self._send_lock = threading.Lock()

    def report(self, obj: dict) -> None:
        with self._send_lock:
            try:
                _send(self.ctl, obj)
            except OSError:
                pass  # the daemon is gone: the main loop sees EOF and the process exits

    def run(self) -> None:
        self.sel.register(self.ctl, selectors.EVENT_READ, None)
        while True:
            timeout = None
            if self.pending:
                timeout = max(0.0, min(hs.deadline for hs in self.pending.values()) - time.monotonic())
            for key, _mask in self.sel.select(timeout):
                if key.data is None:
                    if not self._control():
                        return
                else:
                    self._step(key.data)
            now = time.monotonic()
            for hs in [hs for hs in self.pending.values() if hs.deadline <= now]:
                self._drop(hs, "handshake_timeout", f"no complete TLS handshake within {self.handshake_s:g} s")

    def _control(self) -> bool:
        try:
            obj, fds = _recv(self.ctl)
        except (OSError, ValueError):
            return False
        if obj is None:
            return False
        if obj.get("op") != "conn" or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return True
        raw = socket.socket(fileno=fds[0])
        unix = socket.socket(fileno=fds[1])
        cid, peer = int(obj["id"]), str(obj.get("peer", "?"))
        try:
            raw.setblocking(False)
            tls = self.context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            unix.close()
            self.report({"op": "refused", "id": cid, "category": "tls", "detail": f"cannot start TLS: {exc}"})
            return True
        hs = _Handshake(cid, tls, unix, peer, time.monotonic() + self.handshake_s)
        self.pending[tls.fileno()] = hs
        self.sel.register(tls, selectors.EVENT_READ, hs)
        self._step(hs)
        return True

    def _step(self, hs: _Handshake) -> None:
        try:
            hs.tls.do_handshake()
        except ssl.SSLWantReadError:
            self.sel.modify(hs.tls, selectors.EVENT_READ, hs)
            return
        except ssl.SSLWantWriteError:
            self.sel.modify(hs.tls, selectors.EVENT_WRITE, hs)
            return
        except (OSError, ssl.SSLError) as exc:
            err = map_tls_error(exc, stage="handshake", peer=hs.peer)
            self._drop(hs, err.category, err.message)
            return
        try:
            info = verify_peer(hs.tls, self.endpoint.peer_pins, self.endpoint.alpn)
        except KvpackError as exc:
            self._drop(hs, exc.category, exc.message)
            return
        self._forget(hs)
        # the report precedes every report of the relay (one ordered control stream)
        self.report({"op": "auth", "id": hs.id, "leaf": info.leaf_sha256, "alpn": info.alpn, "version": info.version, "cipher": info.cipher})
        threading.Thread(target=relay, args=(hs.tls, hs.unix, hs.id, hs.peer, self.report, self.linger_s), name=f"relay-{hs.id}", daemon=True).start()

    def _forget(self, hs: _Handshake) -> None:
        self.pending.pop(hs.tls.fileno(), None)
        try:
            self.sel.unregister(hs.tls)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, hs: _Handshake, category: str, detail: str) -> None:
        self._forget(hs)
        for s in (hs.tls, hs.unix):
            try:
                s.close()
            except OSError:
                pass
        self.report({"op": "refused", "id": hs.id, "category": category, "detail": detail})


def _daemon_closed(unix: socket.socket) -> bool:
    """Whether the daemon closed its end of the socketpair, even with bytes of it still
    unread here (``POLLRDHUP``; a read would only see them first)."""
    probe = select.poll()
    probe.register(unix, select.POLLRDHUP | select.POLLHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _fd, ev in probe.poll(0))


def relay(tls: ssl.SSLSocket, unix: socket.socket, cid: int, peer: str, report: Callable[[dict], None], linger_s: float = RELAY_LINGER_S) -> None:
    """Move bytes between an authenticated TLS connection and the daemon's socketpair end
    until the daemon closes its end (see the module docstring). Reports ``rd_end`` (how the
    TLS read direction ended) before the Unix write side shuts, and ``closed`` last.

    Readiness-driven: a socket is read only after the selector said so (or while the last
    read stopped at a full buffer), so a stream that runs dry between records costs one
    failed TLS read, one send and one ``epoll_wait`` -- not a round of failed reads."""
    tls.setblocking(False)
    unix.setblocking(False)
    sel = selectors.DefaultSelector()
    buf = bytearray(RELAY_BATCH_BYTES)
    view = memoryview(buf)
    cap = len(buf)
    start = end = 0  # decrypted bytes not yet sent to the daemon: buf[start:end]
    out = b""  # the daemon's bytes not yet written to TLS
    tls_open = unix_open = True
    tls_ready = unix_ready = True  # may have bytes: read without waiting (first round: yes)
    tls_read_wants_write = False
    gone_at: Optional[float] = None  # when the daemon was first seen closed while the peer would not read
    ended = False  # rd_end reported
    registered: dict[Any, int] = {}

    def read_end(status: dict) -> None:
        nonlocal ended
        if not ended:
            ended = True
            report({"op": "rd_end", "id": cid, **status})

    def watch(sock: Any, events: int) -> None:
        old = registered.get(sock, 0)
        if events == old:
            return
        if not events:
            sel.unregister(sock)
            del registered[sock]
        elif old:
            sel.modify(sock, events)
            registered[sock] = events
        else:
            sel.register(sock, events)
            registered[sock] = events

    try:
        while True:
            # 1. TLS -> buffer: records until the socket runs dry or the buffer fills
            if tls_open and tls_ready and end < cap:
                try:
                    while end < cap:
                        n = tls.recv_into(view[end:])
                        if n == 0:
                            tls_open = False
                            break
                        end += n
                except ssl.SSLWantReadError:
                    tls_ready = False
                except ssl.SSLWantWriteError:
                    tls_ready, tls_read_wants_write = False, True
                except ssl.SSLError as exc:
                    err = map_tls_error(exc, stage="read", peer=peer)
                    # what the peer sent before a bad record is not delivered
                    read_end({"status": "tls", "category": err.category, "detail": err.message})
                    return
                except OSError as exc:
                    read_end({"status": "conn", "errno": exc.errno or errno.ECONNRESET, "detail": f"{type(exc).__name__}: {exc}"})
                    return
            # 2. buffer -> daemon
            if end > start:
                try:
                    start += unix.send(view[start:end])
                except BlockingIOError:
                    pass
                except OSError:
                    # the daemon closed its end: it wants no more bytes, but its last reply
                    # (an ACK) may still be queued for the peer; drain that, then close
                    start = end = 0
                    tls_open = False
                    ended = True
                if start == end:
                    start = end = 0
                elif end == cap and start:
                    buf[: end - start] = buf[start:end]
                    end -= start
                    start = 0
            if not tls_open and start == end and not ended:
                read_end({"status": "eof"})
                try:
                    unix.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
            # 3. daemon -> TLS (ACKs, responses: small)
            if unix_open and unix_ready and not out:
                try:
                    data = unix.recv(1 << 16)
                    if data:
                        out = data
                    else:
                        unix_open = False
                except BlockingIOError:
                    unix_ready = False
                except OSError:
                    unix_open = False
            if out:
                try:
                    out = out[tls.send(out) :]
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    pass
                except (OSError, ssl.SSLError) as exc:
                    read_end({"status": "conn", "errno": getattr(exc, "errno", None) or errno.EPIPE, "detail": f"write: {type(exc).__name__}: {exc}"})
                    return
            if not unix_open and not out:
                return  # the daemon is done and its last bytes are written
            # more to do at once: records left behind a full buffer that has room again, or
            # the next reply after one that went out
            if (tls_open and tls_ready and end < cap) or (unix_open and unix_ready and not out):
                continue
            tls_events = selectors.EVENT_READ if tls_open and not tls_ready and end < cap else 0
            if out or tls_read_wants_write:
                tls_events |= selectors.EVENT_WRITE
            unix_events = selectors.EVENT_WRITE if end > start else 0
            if unix_open and not out:
                unix_events |= selectors.EVENT_READ
            watch(tls, tls_events)
            watch(unix, unix_events)
            ready = sel.select(RELAY_LINGER_POLL_S if out else None)
            if out and not ready:  # the peer is not taking the daemon's bytes
                if gone_at is None and _daemon_closed(unix):
                    gone_at = time.monotonic()
                if gone_at is not None and time.monotonic() - gone_at >= linger_s:
                    read_end({"status": "conn", "errno": errno.ETIMEDOUT, "detail": f"peer took no bytes for {linger_s:g} s after the daemon closed"})
                    return
            for key, mask in ready:
                if key.fileobj is tls:
                    if mask & selectors.EVENT_READ or (tls_read_wants_write and mask & selectors.EVENT_WRITE):
                        tls_ready, tls_read_wants_write = True, False
                elif mask & selectors.EVENT_READ:
                    unix_ready = True
    except Exception as exc:  # noqa: BLE001 - a relay bug fails this connection, not the front
        read_end({"status": "aborted", "detail": f"TLS front relay failed: {type(exc).__name__}: {exc}"})
    finally:
        sel.close()
        for s in (tls, unix):
            try:
                s.close()
            except OSError:
                pass
        report({"op": "closed", "id": cid})


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m kvpack.node.tls_front CONTROL_FD``: started by :class:`FrontPool` only."""
    args = sys.argv[1:] if argv is None else argv
    # the daemon handles Ctrl-C and stops its fronts; a front ends at its control EOF
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctl = socket.socket(fileno=int(args[0]))
    obj, fds = _recv(ctl)
    for fd in fds:
        os.close(fd)
    if obj is None or obj.get("op") != "config":
        return 2
    try:
        endpoint = TlsEndpoint(obj["certificate_chain"], obj["private_key"], obj["peer_ca"], frozenset(obj["peer_pins"]), obj["alpn"])
        context = server_context(endpoint)
    except KvpackError as exc:
        _send(ctl, {"op": "fatal", "category": exc.category, "detail": exc.message})
        return 2
    _send(ctl, {"op": "ready", "pid": os.getpid()})
    _FrontServer(ctl, endpoint, context, float(obj["handshake_s"]), float(obj.get("linger_s", RELAY_LINGER_S))).run()
    # relay threads die with the process; their sockets close with it (the daemon's ends
    # see EOF and its deadlines and reports do the rest)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
