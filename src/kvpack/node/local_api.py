"""The decode node's local API: one JSON request line in, one JSON reply line out, over a Unix
socket (filesystem permissions, never the network) -- what ``kvpack request`` talks to.

Why it exists as its own module: the API is a door into the engine, and a door needs a frame.

* **Own the socket.** :class:`ApiSocket` takes an exclusive ``flock`` on ``<path>.lock``
  before it touches ``<path>``; a socket file whose lock is held, or that still accepts
  connections (a live process of an older release), is never taken over (``locked``). Only
  a stale socket (nothing listening, lock free) is replaced, and on shutdown the node removes
  the socket only if it is still the one it bound (same inode).
* **Bounded requests.** A request line is read into one buffer, newline searched only in the
  new bytes (linear, never the quadratic ``data += chunk``), refused past
  ``max_request_bytes`` or ``request_read_s``; ``max_new_tokens`` and the prompt length are
  capped (:class:`ApiLimits`); at most ``max_clients`` requests at once. Every refusal is a
  one-line reply ``{"ok": false, "error": {"reason", "detail"}}``; a request refused while
  it was read is drained (bounded bytes and time) before the close, so a client still
  sending it reads the reason instead of a reset.
* **Cancellation.** While a request is served, one watcher thread polls every in-flight
  client socket; a client that hangs up (Ctrl-C on ``kvpack request``) cancels its
  :class:`CancelToken`, which the node checks between decode steps, while waiting for a
  decode slot and while a transfer is in flight, so the slot is free within a second.

What it must never do: read an unbounded request, keep serving a request whose client left,
or unlink anything at its path but a stale socket (a live one is refused `locked`; a file,
directory, symlink or FIFO there is the operator's: refused `file`, never deleted).
"""

from __future__ import annotations

import json
import logging
import os
import select
import selectors
import socket
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..vocab import strict_json_loads
from ..errors import KvpackError, ProtocolError, SecurityError, UsageError
from ..vocab import FileLock, LockHeld
from .common import verdict_of
from .transport import socket_owner_alive

log = logging.getLogger("kvpack.node.local_api")

#: a Unix socket path the kernel accepts (sun_path is 108 bytes with its NUL)
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class ApiLimits:
    """Caps of the local API (docs/operations.md, "Limits and deadlines")."""

    max_request_bytes: int = 8 << 20  # a 131,072-token prompt as JSON is ~1.5 MiB
    max_new_tokens: int = 4096
    max_prompt_chars: int = 1 << 20
    request_read_s: float = 30.0
    max_clients: int = 64


class Cancelled(ProtocolError):
    """The request's client went away (or the node is stopping): stop its work."""

    def __init__(self, message: str = "the client went away; request cancelled") -> None:
        super().__init__("aborted", message, remote=False)


class CancelToken:
    """Set once the client of a request hung up; checked by the work it started."""

    __slots__ = ("_event", "reason")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def cancel(self, reason: str = "the client went away") -> None:
        self.reason = reason
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled(f"{self.reason}; request cancelled")

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)


#: a token that is never cancelled (library callers of ReceiverNode.generate)
NEVER = CancelToken()


class ApiSocket:
    """A Unix listening socket owned through ``<path>.lock`` (see the module docstring)."""

    def __init__(self, path: str, backlog: int = 64) -> None:
        self.path = os.path.abspath(path)
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH:
            raise UsageError("usage", f"local API socket path {self.path!r} is {len(os.fsencode(self.path))} bytes; the limit is {MAX_SOCKET_PATH}")
        self._lock = self._take_lock()
        self.sock: Optional[socket.socket] = None
        try:
            self._bind(backlog)
        except BaseException:
            self._lock.release()
            raise

    def _take_lock(self) -> FileLock:
        lock = FileLock(self.path + ".lock", record_pid=True)
        try:
            lock.acquire()
        except LockHeld as held:
            raise SecurityError("locked", f"local API socket {self.path} is served by another process ({held})") from None
        except OSError as exc:
            raise UsageError("file", f"cannot open {self.path}.lock: {exc.strerror}") from None
        return lock

    def _bind(self, backlog: int) -> None:
        try:
            st: Optional[os.stat_result] = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise UsageError("file", f"local API socket {self.path}: {exc.strerror}") from None
        if st is not None:
            # only a stale *socket* is ever removed: a regular file, a directory, a symlink or
            # a FIFO at the path is the operator's (a mistyped --socket), never deleted
            if not stat.S_ISSOCK(st.st_mode):
                raise UsageError("file", f"local API socket path {self.path} exists and is not a socket: not removed (choose another --socket)")
            if socket_owner_alive(self.path):
                raise SecurityError("locked", f"local API socket {self.path} accepts connections: another process serves it (not taken over)")
            try:
                os.unlink(self.path)  # stale: nothing listens and the lock was free
            except OSError as exc:
                raise UsageError("file", f"cannot remove the stale local API socket {self.path}: {exc.strerror}") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        except OSError as exc:
            sock.close()
            raise UsageError("file", f"cannot bind local API socket {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old)
        sock.listen(backlog)
        self.sock = sock
        self._inode = os.stat(self.path).st_ino

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None
            try:
                if os.stat(self.path).st_ino == self._inode:
                    os.unlink(self.path)
            except OSError:
                pass
        self._lock.release()


def read_request_line(conn: socket.socket, limits: ApiLimits) -> Optional[bytes]:
    """One newline-terminated request, within the byte cap and the read deadline; None if the
    client closed before sending one."""
    buf = bytearray()
    end = time.monotonic() + limits.request_read_s
    chunk = bytearray(1 << 16)
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise UsageError("usage", f"request not complete within {limits.request_read_s:g} s")
        conn.settimeout(left)
        try:
            n = conn.recv_into(chunk)
        except socket.timeout:
            raise UsageError("usage", f"request not complete within {limits.request_read_s:g} s") from None
        if n == 0:  # EOF: a half-closing client's request may end without its newline
            if buf and len(buf) <= limits.max_request_bytes:
                return bytes(buf)
            return None
        start = len(buf)
        buf += chunk[:n]
        nl = buf.find(b"\n", start)
        if (nl if nl >= 0 else len(buf)) > limits.max_request_bytes:
            raise UsageError("usage", f"request line longer than {limits.max_request_bytes} bytes")
        if nl >= 0:
            return bytes(buf[:nl])


#: what a refused client may still send after its refusal before the node closes anyway
DRAIN_BYTES = 64 << 20
DRAIN_S = 2.0


def _drain_before_close(conn: socket.socket, limits: ApiLimits) -> None:
    """Read and discard what a refused client is still sending (at most :data:`DRAIN_BYTES`,
    for at most :data:`DRAIN_S`), after its refusal line went out and our side is shut.

    Closing a socket with unread bytes resets the connection: a client that is still
    sending its (too long) request gets EPIPE before it ever reads the reason, which was
    queued for it. Draining lets a plain send-then-read client (``nc``, a script) finish
    sending and read its refusal. The bounds keep the slot's cost fixed: a client that
    sends more, or longer, is cut off as before."""
    try:
        conn.shutdown(socket.SHUT_WR)  # the refusal is complete: the client reads EOF after it
    except OSError:
        return
    end = time.monotonic() + min(DRAIN_S, limits.request_read_s)
    left = DRAIN_BYTES
    sink = bytearray(1 << 16)
    while left > 0:
        wait = end - time.monotonic()
        if wait <= 0:
            return
        try:
            conn.settimeout(wait)
            n = conn.recv_into(sink)
        except OSError:  # timeout, reset: nothing more to wait for
            return
        if n == 0:
            return
        left -= n


def _int_field(req: dict, name: str, default: int, lo: int, hi: int) -> int:
    value = req.get(name, default)
    if type(value) is not int or not lo <= value <= hi:
        raise UsageError("usage", f"{name} must be an integer in {lo}..{hi} (this node's limit)")
    return value


def parse_request(data: bytes, limits: ApiLimits, max_prompt_tokens: int) -> dict[str, Any]:
    """The checked request: ``tokens`` or ``prompt``, ``max_new_tokens`` and the flags."""
    try:
        req = strict_json_loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError("usage", f"a local API request is one JSON object: {exc}") from None
    if not isinstance(req, dict):
        raise UsageError("usage", "a local API request is one JSON object")
    unknown = set(req) - {"tokens", "prompt", "max_new_tokens", "save", "chat", "stop_at_eos", "session", "stripes", "producer", "op"}
    if unknown:
        raise UsageError("usage", f"unknown request fields {sorted(unknown)[:5]}")
    if "op" in req:
        if req["op"] != "sessions" or len(req) != 1:
            raise UsageError("usage", 'the only operation is {"op": "sessions"}')
        return {"op": "sessions"}
    out: dict[str, Any] = {"max_new_tokens": _int_field(req, "max_new_tokens", 32, 0, limits.max_new_tokens)}
    if "stripes" in req:
        out["stripes"] = _int_field(req, "stripes", 1, 1, 16)
    if "producer" in req:
        if not isinstance(req["producer"], str) or not 0 < len(req["producer"]) <= 253:
            raise UsageError("usage", "producer must be a name of 1..253 characters")
        out["producer"] = req["producer"]
    for flag, default in (("save", False), ("chat", True), ("stop_at_eos", True)):
        value = req.get(flag, default)
        if type(value) is not bool:
            raise UsageError("usage", f"{flag} must be true or false")
        out[flag] = value
    if ("tokens" in req) == ("prompt" in req):
        raise UsageError("usage", "give exactly one of tokens and prompt")
    if "tokens" in req:
        tokens = req["tokens"]
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 2**31 for t in tokens):
            raise UsageError("usage", "tokens must be a JSON list of token ids (integers in 0..2^31-1)")
        if not 2 <= len(tokens) <= max_prompt_tokens:
            raise UsageError("usage", f"a prompt of {len(tokens)} tokens is outside 2..{max_prompt_tokens}")
        out["tokens"] = tokens
    else:
        prompt = req["prompt"]
        if not isinstance(prompt, str) or len(prompt) > limits.max_prompt_chars:
            raise UsageError("usage", f"prompt must be a string of at most {limits.max_prompt_chars} characters")
        out["prompt"] = prompt
    if "session" in req:
        if not isinstance(req["session"], str) or not 0 < len(req["session"]) <= 128:
            raise UsageError("usage", "session must be a name of 1..128 characters")
        out["session"] = req["session"]
    return out


#: the node's handler: a checked request and its cancel token in, the result dict out
Handler = Callable[[dict, CancelToken], dict]


class _Watcher:
    """One thread polling every in-flight client socket; a hang-up cancels its token.

    ``select`` runs *outside* the lock (epoll takes registrations from other threads while
    it waits): holding the lock across a 50 ms select, and taking it again at once, starved
    :meth:`watch` and :meth:`unwatch` -- a request waited for it behind the watcher for
    seconds on a many-core host (issue 14: 20 s p50 for one session). Events are acted on
    under the lock and only for a socket still registered with the same token, so once
    :meth:`unwatch` returned the watcher never reads that socket again (its descriptor may
    be reused). A hang-up is seen within about 50 ms.

    A *half-close* is not a hang-up: a client that shuts down its sending side after its
    request line (``nc -N``, ``socat``, a script closing stdin) still reads its reply. Its
    socket reads EOF forever, so it moves from the selector to a ``poll`` set that reports
    only ``POLLHUP`` -- which a Unix socket raises once the peer closed both directions --
    and is cancelled when that comes. Before, any EOF cancelled the request and the client
    got no reply at all."""

    POLL_S = 0.05

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._half: dict[int, tuple[socket.socket, CancelToken]] = {}
        self._hup = select.poll()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvpack-api-watch", daemon=True)
        self._thread.start()

    def watch(self, conn: socket.socket, token: CancelToken) -> None:
        with self._lock:
            self._sel.register(conn, selectors.EVENT_READ, token)

    def unwatch(self, conn: socket.socket) -> None:
        with self._lock:
            try:
                self._sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            self._forget_half(conn.fileno())

    def _forget_half(self, fd: int) -> None:
        if self._half.pop(fd, None) is not None:
            try:
                self._hup.unregister(fd)
            except (KeyError, ValueError):
                pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sel.get_map() and not self._half:
                self._stop.wait(self.POLL_S)
                continue
            try:
                events = self._sel.select(self.POLL_S) if self._sel.get_map() else []
                hangups = self._hup.poll(0 if events or self._sel.get_map() else int(self.POLL_S * 1000))
            except (OSError, ValueError):  # a socket closed under the select: poll again
                continue
            for key, _mask in events:
                with self._lock:
                    current = self._sel.get_map().get(key.fd)
                    if current is not None and current.data is key.data:
                        self._check(key.fileobj, key.data)
            for fd, _ev in hangups:
                with self._lock:
                    entry = self._half.get(fd)
                    if entry is not None:
                        entry[1].cancel("the client closed its connection")
                        self._forget_half(fd)

    def _check(self, conn, token: CancelToken) -> None:
        reset = False
        try:
            data = conn.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data, reset = b"", True
        if data:
            return  # bytes after the request line: not a hang-up
        # EOF or reset; the caller holds the lock
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        if not reset and not _hung_up(conn):
            self._half[conn.fileno()] = (conn, token)  # half-closed: it still reads its reply
            self._hup.register(conn, 0)
            return
        token.cancel("the client closed its connection")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        with self._lock:
            self._sel.close()


def _hung_up(conn: socket.socket) -> bool:
    """True once the peer closed both directions (``POLLHUP``), not only its sending side."""
    p = select.poll()
    p.register(conn, 0)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _fd, ev in p.poll(0))


class LocalApi:
    """The accept loop and one thread per request (at most ``max_clients``)."""

    def __init__(
        self, api_socket: ApiSocket, handler: Handler, limits: ApiLimits, max_prompt_tokens: int, on_reply: Callable[[dict], None] | None = None
    ) -> None:
        self.socket = api_socket
        self.handler = handler
        self.limits = limits
        self.max_prompt_tokens = max_prompt_tokens
        self.on_reply = on_reply
        self._clients = threading.BoundedSemaphore(limits.max_clients)
        self._watcher = _Watcher()
        self._stopping = threading.Event()
        self._tokens: set[CancelToken] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="kvpack-receiver-api", daemon=True)

    def start(self) -> "LocalApi":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            for token in self._tokens:
                token.cancel("the node is stopping")
        self.socket.close()
        self._thread.join(timeout=5)
        self._watcher.close()

    def _loop(self) -> None:
        sock = self.socket.sock
        assert sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            if not self._clients.acquire(blocking=False):
                self._reply(conn, {"ok": False, "error": {"reason": "busy", "detail": f"{self.limits.max_clients} requests in flight (limit)"}})
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kvpack-receiver-api-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        token = CancelToken()
        try:
            with conn:
                try:
                    line = read_request_line(conn, self.limits)
                    if line is None:
                        return
                    req = parse_request(line, self.limits, self.max_prompt_tokens)
                except KvpackError as exc:
                    self._reply(conn, {"ok": False, "error": {"reason": exc.category, "detail": exc.message}})
                    _drain_before_close(conn, self.limits)
                    return
                except Exception as exc:  # noqa: BLE001 - a bug here still answers its one line
                    log.exception("local API: reading a request failed")
                    self._reply(conn, {"ok": False, "error": {"reason": "internal", "detail": f"{type(exc).__name__}: {exc}"[:500]}})
                    return
                with self._lock:
                    self._tokens.add(token)
                self._watcher.watch(conn, token)
                try:
                    reply = {"ok": True, "result": self.handler(req, token)}
                except BaseException as exc:  # noqa: BLE001 - reported to the client
                    reason, detail = verdict_of(exc)
                    reply = {"ok": False, "error": {"reason": reason, "detail": detail}}
                finally:
                    self._watcher.unwatch(conn)
                if self.on_reply is not None:
                    self.on_reply(reply)
                if not token.cancelled:
                    self._reply(conn, reply)
        finally:
            with self._lock:
                self._tokens.discard(token)
            self._clients.release()

    @staticmethod
    def _reply(conn: socket.socket, reply: dict) -> None:
        try:
            conn.settimeout(10.0)
            conn.sendall(json.dumps(reply, default=str).encode() + b"\n")
        except OSError:
            pass  # the client left; its work was cancelled or is done


def request_local(socket_path: str, payload: dict, timeout: float = 900.0, max_reply_bytes: int = 64 << 20) -> dict:
    """Client side of the local API (``kvpack request``): one request, one reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        try:
            s.sendall(json.dumps(payload).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError) as exc:
            # The node refuses a request it will not read whole (too long, over a limit)
            # with one reply line, then closes: a client still sending gets EPIPE, and the
            # refusal is waiting in its receive queue. Read it rather than lose the reason.
            try:
                refused = _read_reply(s, max_reply_bytes)
            except OSError:
                raise exc from None
            if not refused.strip():
                raise exc
            return json.loads(bytes(refused))
        return json.loads(bytes(_read_reply(s, max_reply_bytes)))


def _read_reply(s: socket.socket, max_reply_bytes: int) -> bytearray:
    """Bytes up to and including the first newline (or ``max_reply_bytes``, or the end)."""
    buf = bytearray()
    chunk = bytearray(1 << 16)
    while True:
        n = s.recv_into(chunk)
        if n == 0:
            break
        start = len(buf)
        buf += chunk[:n]
        if buf.find(b"\n", start) >= 0 or len(buf) > max_reply_bytes:
            break
    return buf
