"""The transport driver both node daemons share: listeners, limits, TLS handshakes under a
deadline, and reads under deadlines.

Why it exists: a node used to accept one connection at a time and give each TLS handshake
10 s per *read*; two idle TCP connections stopped a prefill node, and a peer sending one
byte every few seconds held a handshake forever. Here:

* **Concurrency model (documented in docs/operations.md, "Limits and deadlines").** One
  *acceptor thread per listener* runs a ``selectors`` loop: it accepts, and drives every TLS
  handshake non-blocking, all at once, each under one whole-handshake deadline. A connection
  that has not authenticated costs a file descriptor and a slot in that loop -- no thread, no
  buffer beyond OpenSSL's -- until its deadline. Only a connection that passed mutual TLS
  (TLS 1.3, CA, pinned leaf, exact ALPN: :func:`kvpack.security.tls.verify_peer`) gets a
  *worker thread* of its own, which runs the daemon's blocking protocol code (``recv_into``
  straight into the handoff decoder's buffers: the fast path stays zero-copy, and OpenSSL,
  hashlib and NumPy release the GIL for the bulk work).
* **Limits** (:class:`Limits`): connections held in any state, handshakes in flight in total
  and per peer address, authenticated connections per peer leaf. A connection over a limit
  is closed at once and counted; it never queues behind the others.
* **Refusals before authentication are aggregated** (:class:`~kvpack.node.receipts.RefusalLog`):
  counted by reason, one summary line per interval; never one receipt per connection.
* **Deadlines after authentication** (:class:`Deadline`, :func:`fill`): every read runs
  under ``min(gap, what is left of the whole)``, so neither a silent nor a trickling
  authenticated peer holds a worker past its deadline.
* **TLS fronts** (optional, ``fronts=``; :mod:`.tls_front`): the acceptor still accepts,
  limits and counts, but hands each connection to a front *process* that runs the
  handshake and, once the peer is verified, relays plaintext over a socketpair; the worker
  gets a :class:`~kvpack.node.tls_front.RelayChannel` instead of a ``TlsChannel``. Why: one
  process's TLS reads take the GIL once per 16 KiB record, which capped a striped handoff
  (docs/bench/nodes_profile.md, rounds 4 and 5).

What it must never do: run protocol code for a peer that has not authenticated, block the
acceptor thread on one peer, or let any wait go without a deadline.
"""

from __future__ import annotations

import errno
import itertools
import logging
import selectors
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

from ..errors import KvpackError, NetworkError, ProtocolError
from ..security.tls import TlsChannel, TlsEndpoint, map_tls_error, tune_socket, verify_peer
from .receipts import RefusalLog
from .tls_front import FrontPool, RelayChannel

log = logging.getLogger("kvpack.node.transport")


@dataclass(frozen=True)
class Limits:
    """Per-listener connection limits and the handshake deadline (docs/operations.md).

    ``max_connections``: sockets held in any state; ``max_handshakes``: TLS handshakes in
    flight; ``max_handshakes_per_ip``: ... from one peer address (loopback peers share one);
    ``max_per_peer``: authenticated connections per peer leaf (a striped transfer uses one per
    stripe); ``handshake_s``: the whole handshake, however the peer paces its bytes.
    """

    max_connections: int = 512
    max_handshakes: int = 256
    max_handshakes_per_ip: int = 128
    max_per_peer: int = 64
    handshake_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_handshakes", "max_handshakes_per_ip", "max_per_peer"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 0 < self.handshake_s <= 600:
            raise ValueError("handshake_s must be in (0, 600]")


def bind_tcp(host: str, port: int, what: str, *, backlog: int = 512) -> socket.socket:
    """A tuned listening socket, or a one-line typed refusal naming the address and what
    it is for (``address_in_use``, ``address_not_available``)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise NetworkError("address_not_available", f"{what} {host}:{port}: cannot resolve ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune_socket(sock)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise NetworkError("address_in_use", f"{what} {host}:{port} is already in use (another node running?)") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise NetworkError("address_not_available", f"{what} {host}:{port}: no interface of this host has that address") from None
        raise NetworkError("address_not_available", f"{what} {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _peer_host(addr) -> str:
    try:
        return str(addr[0])
    except (TypeError, IndexError):
        return "?"


class _Handshake:
    __slots__ = ("tls", "fd", "host", "peer", "deadline")

    def __init__(self, tls: ssl.SSLSocket, host: str, peer: str, deadline: float) -> None:
        self.tls, self.fd, self.host, self.peer, self.deadline = tls, tls.fileno(), host, peer, deadline


@dataclass
class Counts:
    """What a listener holds right now (the status page and tests read it)."""

    connections: int = 0
    handshakes: int = 0
    authenticated: int = 0
    accepted_total: int = 0
    refused_total: int = 0


#: a verified connection: in-process TLS, or relayed by a TLS front process
Channel = Union[TlsChannel, RelayChannel]
#: a worker: called on its own thread with a verified channel; the channel is closed after
Serve = Callable[[Channel], None]


class Listener:
    """One TLS listener: acceptor + handshake loop on one thread, a worker per authenticated
    connection. ``serve(channel)`` runs the daemon's protocol; it must bound its own reads
    (see :func:`fill`)."""

    def __init__(
        self,
        name: str,
        sock: socket.socket,
        endpoint: TlsEndpoint,
        context: ssl.SSLContext,
        serve: Serve,
        *,
        limits: Limits = Limits(),
        refusals: Optional[RefusalLog] = None,
        on_refused: Optional[Callable[[str, str, str], None]] = None,
        fronts: Optional[FrontPool] = None,
    ) -> None:
        self.name = name
        self.sock = sock
        self.endpoint = endpoint
        self.context = context
        self.serve = serve
        self.limits = limits
        self.refusals = refusals or RefusalLog(name)
        #: told of every refusal before authentication (reason, detail, peer): the decode
        #: node hands the category to a request waiting for that producer
        self.on_refused = on_refused
        #: TLS front processes (started by the caller, stopped by :meth:`stop`); None or
        #: none live: handshakes and TLS records in this process
        self.fronts = fronts
        self.port: int = sock.getsockname()[1]
        self.counts = Counts()
        self._per_ip: dict[str, int] = {}
        self._per_peer: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._pending: dict[int, _Handshake] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._workers: set[threading.Thread] = set()
        #: the verified channels the workers serve (stop() shuts them down)
        self._channels: set[Channel] = set()
        self._ids = itertools.count(1)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Listener":
        self.sock.setblocking(False)
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if self.fronts is not None:
            self.fronts.attach(self)
            self.fronts.start()
        self._thread = threading.Thread(target=self._loop, name=f"kvpack-{self.name}-accept", daemon=True)
        self._thread.start()
        return self

    def stop(self, join_s: float = 5.0) -> None:
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=join_s)
        if self.fronts is not None:
            # relayed connections end with their fronts: their workers' reads fail at once
            self.fronts.stop(join_s)
        # in-process TLS: shut down every served socket, so a worker blocked in a read (a
        # silent peer waits up to its first-frame deadline, 30 s) ends at once; then one
        # deadline for all of them. Joining each for join_s made a node with N silent
        # authenticated peers take N x join_s to stop (6 peers: 30 s).
        with self._lock:
            channels = list(self._channels)
        for chan in channels:
            try:  # the plain socket's shutdown: an SSLSocket's would drop its TLS object
                socket.socket.shutdown(chan.sock, socket.SHUT_RDWR)
            except (OSError, TypeError, ValueError):
                pass
        end = time.monotonic() + join_s
        for w in list(self._workers):
            w.join(timeout=max(0.0, end - time.monotonic()))
        for s in (self.sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self.refusals.flush()

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                timeout = self._next_timeout()
                for key, _mask in self._sel.select(timeout):
                    if key.data == "wake":
                        self._drain_wake()
                    elif key.fileobj is self.sock:
                        self._accept_ready()
                    else:
                        self._step(key.fileobj, key.data)
                self._expire()
        except Exception:  # noqa: BLE001 - logged; stop() still releases everything
            log.exception("listener %s loop failed", self.name)
        finally:
            for hs in list(self._pending.values()):
                self._drop(hs, None)
            self._sel.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _next_timeout(self) -> float:
        if not self._pending:
            return 1.0
        soonest = min(hs.deadline for hs in self._pending.values())
        return max(0.0, min(1.0, soonest - time.monotonic()))

    def _expire(self) -> None:
        now = time.monotonic()
        if self.fronts is not None:
            self.fronts.expire(now)
        for hs in [hs for hs in self._pending.values() if hs.deadline <= now]:
            self._drop(hs, ("handshake_timeout", f"no complete TLS handshake within {self.limits.handshake_s:g} s"))

    def _accept_ready(self) -> None:
        for _ in range(64):  # bounded batch: handshakes in flight get their turn too
            try:
                raw, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.refusals.count("resources", str(exc))
                    time.sleep(0.05)  # out of descriptors: let workers finish instead of spinning
                    return
                if self._stopping.is_set():
                    return
                continue
            self._admit(raw, _peer_host(addr), f"{_peer_host(addr)}:{addr[1] if isinstance(addr, tuple) and len(addr) > 1 else '?'}")

    def _over_limit(self, host: str) -> Optional[str]:
        lim, c = self.limits, self.counts
        if c.connections >= lim.max_connections:
            return f"{c.connections} connections held (limit {lim.max_connections})"
        if c.handshakes >= lim.max_handshakes:
            return f"{c.handshakes} handshakes in flight (limit {lim.max_handshakes})"
        if self._per_ip.get(host, 0) >= lim.max_handshakes_per_ip:
            return f"{self._per_ip[host]} handshakes in flight from {host} (limit {lim.max_handshakes_per_ip})"
        return None

    def _admit(self, raw: socket.socket, host: str, peer: str) -> None:
        with self._lock:
            why = self._over_limit(host)
            if why is None:
                self.counts.connections += 1
                self.counts.handshakes += 1
                self.counts.accepted_total += 1
                self._per_ip[host] = self._per_ip.get(host, 0) + 1
        if why is not None:
            raw.close()
            self._refused("limit", why, peer)
            return
        if self.fronts is not None:
            try:
                tune_socket(raw)
            except OSError:
                pass
            if self.fronts.dispatch(raw, host, peer):
                return  # the front reports auth or refusal (front_authenticated / front_refused)
        try:
            tune_socket(raw)
            raw.setblocking(False)
            tls = self.context.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (OSError, ssl.SSLError) as exc:
            raw.close()
            self._release_handshake(host, authenticated=False)
            self._refused("tls", f"cannot start TLS: {exc}", peer)
            return
        hs = _Handshake(tls, host, peer, time.monotonic() + self.limits.handshake_s)
        self._pending[hs.fd] = hs
        self._sel.register(tls, selectors.EVENT_READ, hs)
        self._step(tls, hs)

    def _step(self, tls, hs: _Handshake) -> None:
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            self._sel.modify(tls, selectors.EVENT_READ, hs)
            return
        except ssl.SSLWantWriteError:
            self._sel.modify(tls, selectors.EVENT_WRITE, hs)
            return
        except (OSError, ssl.SSLError) as exc:
            err = map_tls_error(exc, stage="handshake", peer=hs.peer)
            self._drop(hs, (err.category, err.message))
            return
        try:
            info = verify_peer(tls, self.endpoint.peer_pins, self.endpoint.alpn)
        except KvpackError as exc:
            self._drop(hs, (exc.category, exc.message))
            return
        self._authenticated(hs, info)

    def _drop(self, hs: _Handshake, refusal: Optional[tuple[str, str]]) -> None:
        self._pending.pop(hs.fd, None)
        try:
            self._sel.unregister(hs.tls)
        except (KeyError, ValueError, OSError):
            pass
        try:
            hs.tls.close()
        except OSError:
            pass
        self._release_handshake(hs.host, authenticated=False)
        if refusal is not None:
            self._refused(refusal[0], refusal[1], hs.peer)

    def _release_handshake(self, host: str, *, authenticated: bool) -> None:
        with self._lock:
            self.counts.handshakes -= 1
            left = self._per_ip.get(host, 1) - 1
            if left > 0:
                self._per_ip[host] = left
            else:
                self._per_ip.pop(host, None)
            if not authenticated:
                self.counts.connections -= 1

    def _refused(self, reason: str, detail: str, peer: str) -> None:
        with self._lock:
            self.counts.refused_total += 1
        self.refusals.count(reason, detail, peer)
        if self.on_refused is not None:
            try:
                self.on_refused(reason, detail, peer)
            except Exception:  # noqa: BLE001 - a bookkeeping hook never stops the acceptor
                log.exception("on_refused hook failed")

    def _authenticated(self, hs: _Handshake, info) -> None:
        self._pending.pop(hs.fd, None)
        try:
            self._sel.unregister(hs.tls)
        except (KeyError, ValueError):
            pass
        self._release_handshake(hs.host, authenticated=True)
        if not self._admit_peer(info.leaf_sha256, hs.peer):
            hs.tls.close()
            return
        hs.tls.setblocking(True)
        self._start_worker(TlsChannel(hs.tls, info, side="server"))

    def _admit_peer(self, pin: str, peer: str) -> bool:
        """The per-leaf cap of an authenticated connection (counted, or refused and counted)."""
        with self._lock:
            over = self._per_peer.get(pin, 0) >= self.limits.max_per_peer
            if not over:
                self._per_peer[pin] = self._per_peer.get(pin, 0) + 1
                self.counts.authenticated += 1
            else:
                self.counts.connections -= 1
        if over:
            self._refused("limit", f"peer {pin[:16]}... holds {self.limits.max_per_peer} connections (limit)", peer)
        return not over

    # -- reports of the TLS fronts (their reader threads) ---------------------------------------
    def front_refused(self, host: str, peer: str, reason: str, detail: str) -> None:
        self._release_handshake(host, authenticated=False)
        self._refused(reason, detail, peer)

    def front_authenticated(self, host: str, chan: RelayChannel) -> None:
        self._release_handshake(host, authenticated=True)
        if not self._admit_peer(chan.peer.leaf_sha256, chan.peer_address):
            chan.close()  # the front sees EOF and closes the TCP connection
            return
        self._start_worker(chan)

    def _start_worker(self, chan: Channel) -> None:
        worker = threading.Thread(target=self._work, args=(chan,), name=f"kvpack-{self.name}-{next(self._ids)}", daemon=True)
        with self._lock:
            self._workers.add(worker)
            self._channels.add(chan)
        worker.start()

    def _work(self, chan: Channel) -> None:
        try:
            self.serve(chan)
        except Exception:  # noqa: BLE001 - one connection's bug never stops the listener
            log.exception("%s: connection from %s failed", self.name, chan.peer_address)
        finally:
            chan.close()
            with self._lock:
                self.counts.connections -= 1
                self.counts.authenticated -= 1
                pin = chan.peer.leaf_sha256
                left = self._per_peer.get(pin, 1) - 1
                if left > 0:
                    self._per_peer[pin] = left
                else:
                    self._per_peer.pop(pin, None)
                self._workers.discard(threading.current_thread())
                self._channels.discard(chan)

    def snapshot(self) -> dict:
        with self._lock:
            c = self.counts
            return {
                "port": self.port,
                "connections": c.connections,
                "handshakes": c.handshakes,
                "authenticated": c.authenticated,
                "accepted_total": c.accepted_total,
                "refused_total": c.refused_total,
                "limits": self.limits.__dict__.copy(),
                "refusals": self.refusals.snapshot()["totals"],
                "tls_fronts": None if self.fronts is None else self.fronts.snapshot(),
            }


# -- deadlines for authenticated peers -----------------------------------------------------------


class Deadline:
    """A whole-operation deadline with a per-read gap: each read may wait at most
    ``min(gap_s, what is left)``; :meth:`left` raises ``TimeoutError`` once it passed."""

    __slots__ = ("end", "gap_s", "what")

    def __init__(self, total_s: float, gap_s: Optional[float] = None, what: str = "operation") -> None:
        self.end = time.monotonic() + total_s
        self.gap_s = gap_s if gap_s is not None else total_s
        self.what = what

    @classmethod
    def until(cls, end: float, gap_s: Optional[float] = None, what: str = "operation") -> "Deadline":
        d = cls(0.0, gap_s, what)
        d.end = end
        if gap_s is None:
            d.gap_s = max(0.0, end - time.monotonic())
        return d

    def left(self) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{self.what} deadline passed")
        return min(remaining, self.gap_s)


def fill(chan: Channel, buf: memoryview, deadline: Deadline, cancelled: Optional[Callable[[], Union[bool, str, None]]] = None) -> int:
    """Fill ``buf`` from ``chan`` (one ``recv_into`` per TLS record), every read under the
    deadline. Returns fewer bytes only when the peer closed. ``cancelled`` is polled between
    reads (a request whose client went away stops within one read); a string it returns is
    the ``aborted`` refusal's detail (why: the client left, another stripe was refused ...)."""
    want = len(buf)
    got = 0
    current = chan.sock.gettimeout()
    # the bulk path reads the verified SSLSocket directly (one Python step per 16 KiB TLS
    # record is the cost of this loop); the channel's wrapper only for its buffered bytes
    # and its error mapping, which the except clause below applies to the direct reads. A
    # relayed channel's reads are large already, and only its wrapper knows why a read
    # ended (the front's report), so it is always read through the wrapper.
    relayed = not isinstance(chan.sock, ssl.SSLSocket)
    direct = chan.sock.recv_into if chan.peer_has_spoken and not chan.has_pending() and not relayed else None
    monotonic, end, gap = time.monotonic, deadline.end, deadline.gap_s
    while got < want:
        if cancelled is not None:
            why = cancelled()
            if why:
                raise ProtocolError("aborted", why if isinstance(why, str) else "cancelled: the request this transfer serves was cancelled", remote=False)
        left = end - monotonic()
        if left <= 0:
            raise TimeoutError(f"{deadline.what} deadline passed")
        if gap < left:
            left = gap
        # settimeout costs two fcntl calls: only when the wait must shrink (the deadline
        # nears) or may grow a lot (a new deadline), not once per 16 KiB TLS record
        if current is None or left < current or left > 2 * current:
            chan.settimeout(left)
            current = left
        if direct is None:
            n = chan.recv_into(buf[got:])
        else:
            try:
                n = direct(buf[got:])
            except ssl.SSLError as exc:
                raise chan.read_error(exc) from None
        if n == 0:
            break
        got += n
    return got


def socket_owner_alive(path: str, timeout: float = 1.0) -> bool:
    """True if something accepts connections on the Unix socket at ``path`` (a live daemon)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
