"""Mutual TLS 1.3 channels with exact ALPN and pinned leaves (INTEROP.md C.1, C.14; errata H1, L8).

This module answers the first threat-model question, *who* is on the other end of a socket:

* TLS 1.3 only, on both sides, so there is nothing older to downgrade to;
* client certificates required; both sides verify the peer chain against the enrolled CA only
  (no system trust store), and clients also check the server name against the peer's SAN;
* the SHA-256 of the peer's leaf certificate (DER, lowercase hex) must be in a configured,
  non-empty pin set: a certificate that merely chains to the CA is refused exactly like one
  that does not, because the CA could later sign a different one;
* ALPN must be exactly the expected protocol (:data:`DATA_ALPN` for Handoff V2,
  :data:`CONTROL_ALPN` for the control plane). OpenSSL completes a handshake even when the
  protocols do not overlap (it simply selects none), so both sides check after the handshake.

**When is a connection set up?** In TLS 1.3 the client finishes its handshake *before* the server
has looked at the client certificate, so a client without an acceptable certificate only learns
of its rejection at its first read. Likewise the server's handshake completes before the client
ran its pin/ALPN checks. The channel API therefore never reports success on the handshake alone:

* :func:`connect` (client) returns only after the server has spoken once: either a TLS 1.3
  NewSessionTicket, which an OpenSSL or rustls server sends only after it verified our chain, or
  its alert, which becomes a typed :class:`SecurityError` (``certificate`` for "certificate
  required/expired/unknown CA");
* a server's kvpack-level refusals (pin, ALPN) cannot travel as alerts through Python's ``ssl``;
  the server closes instead. Every read method therefore turns "the peer closed before it ever
  sent a byte" into ``SecurityError('tls', ...)`` rather than an ordinary EOF, and
  :attr:`TlsChannel.peer_has_spoken` says whether the peer has confirmed the connection with
  application data. Treat a connection as established only when that is True, i.e. when the
  protocol's first answer (ACK, "accepted", the first frame) has been read.

Socket options follow the Rust side: TCP_NODELAY and 8 MiB send/receive buffers (set before
connect/listen so TCP window scaling is negotiated for them).

API (blocking sockets; the daemons run one thread per connection): :func:`listen`,
:func:`accept`, :func:`connect`, :func:`wrap_accepted`, :class:`TlsChannel`. There is no
asyncio variant: an earlier one was used only by its own tests.

What it must never do: report a connection as established on the handshake alone, trust the
system CA store, or load a key by path without the secret-file checks.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Self

from ..errors import SecurityError
from ..vocab import is_hex64, sha256_hex
from .secret_files import load_private_key_pem

DATA_ALPN = "muser-kvpack-v2"
CONTROL_ALPN = "muser-prefill-control-v1"
SOCKET_BUFFER_BYTES = 8 << 20
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
#: Tickets our servers send after verifying the client chain; clients wait for the first one.
SERVER_TICKETS = 2


# -- configuration -----------------------------------------------------------------------------------


def validate_pins(pins: Iterable[str], *, what: str = "peer leaf pin set") -> frozenset[str]:
    """C.1: the pin set must be non-empty and every pin 64 lowercase hex digits (not normalised)."""
    if isinstance(pins, str):
        raise SecurityError("config", f"{what} must be a list of pins, not one string")
    out = frozenset(pins)
    if not out:
        raise SecurityError("config", f"{what} is empty: at least one leaf SHA-256 pin is required")
    for pin in out:
        if not is_hex64(pin):
            raise SecurityError("config", f"{what} entry {pin!r} is not 64 lowercase hex digits (SHA-256 of a DER leaf)")
    return out


@dataclass(frozen=True)
class TlsEndpoint:
    """Everything one node needs to speak mTLS on one plane.

    ``server_name`` is used when this endpoint *connects*: SNI and the SAN the peer's leaf must
    carry. ``peer_pins`` are the SHA-256 pins of the leaves this endpoint accepts.
    """

    certificate_chain: str
    private_key: str
    peer_ca: str
    peer_pins: frozenset[str]
    alpn: str
    server_name: str | None = None
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_pins", validate_pins(self.peer_pins))
        if self.alpn not in (DATA_ALPN, CONTROL_ALPN):
            raise SecurityError("config", f"ALPN {self.alpn!r} is not a kvpack protocol ({DATA_ALPN!r} or {CONTROL_ALPN!r})")

    def with_server_name(self, server_name: str) -> "TlsEndpoint":
        return TlsEndpoint(
            self.certificate_chain,
            self.private_key,
            self.peer_ca,
            self.peer_pins,
            self.alpn,
            server_name,
            self.handshake_timeout,
        )


def leaf_sha256(der: bytes) -> str:
    """The pin of a certificate: SHA-256 of its DER bytes, lowercase hex."""
    return sha256_hex(der)


# -- contexts ------------------------------------------------------------------------------------------


def _base_context(protocol: int, endpoint: TlsEndpoint) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        # Only the enrolled CA is a trust anchor: never the system store.
        ctx.load_verify_locations(cafile=endpoint.peer_ca)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError("certificate", f"cannot load peer CA {endpoint.peer_ca!r}: {exc}") from None
    load_identity(ctx, endpoint.certificate_chain, endpoint.private_key)
    ctx.set_alpn_protocols([endpoint.alpn])
    return ctx


def load_identity(ctx: ssl.SSLContext, certificate_chain: str, private_key: str) -> None:
    """Load our chain and key (both paths) into ``ctx``; the key bytes come through the
    secret-file contract. Public: the node API's HTTPS context loads its identity this way.

    ``ssl`` only loads keys by path, which would reopen the file after our checks. So the
    checked bytes are handed over through an anonymous memory file (Linux memfd) and OpenSSL
    reads exactly what was validated. Without memfd we fall back to the validated path.
    """
    key_bytes = load_private_key_pem(private_key)
    try:
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        load_pem_private_key(key_bytes, password=None)
    except (ValueError, TypeError) as exc:
        raise SecurityError("secret_file", f"TLS private key {private_key!r} is not an unencrypted PEM key: {exc}") from None
    memfd = getattr(os, "memfd_create", None)
    fd = -1
    try:
        if memfd is not None and os.path.isdir("/proc/self/fd"):
            fd = memfd("kvpack-tls-key", getattr(os, "MFD_CLOEXEC", 0))
            os.write(fd, key_bytes)
            key_path = f"/proc/self/fd/{fd}"
        else:  # pragma: no cover - non-Linux
            key_path = private_key
        ctx.load_cert_chain(certfile=certificate_chain, keyfile=key_path)
    except (OSError, ssl.SSLError) as exc:
        raise SecurityError(
            "certificate",
            f"cannot load certificate chain {certificate_chain!r} with its key: {exc}",
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)


def server_context(endpoint: TlsEndpoint) -> ssl.SSLContext:
    """A TLS 1.3-only server context that requires and verifies client certificates."""
    ctx = _base_context(ssl.PROTOCOL_TLS_SERVER, endpoint)
    # The ticket is the client's proof that we verified its chain (see module docstring).
    ctx.num_tickets = SERVER_TICKETS
    return ctx


def client_context(endpoint: TlsEndpoint) -> ssl.SSLContext:
    """A TLS 1.3-only client context presenting our leaf and checking the server's name."""
    ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT, endpoint)
    ctx.check_hostname = True
    return ctx


# -- verification ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerInfo:
    leaf_sha256: str
    alpn: str
    version: str
    cipher: str


def verify_peer(tls: ssl.SSLSocket | ssl.SSLObject, pins: Iterable[str], alpn: str) -> PeerInfo:
    """The post-handshake checks both sides run: TLS 1.3, exact ALPN, a pinned leaf."""
    pinset = pins if isinstance(pins, frozenset) else validate_pins(pins)
    version = tls.version()
    if version != "TLSv1.3":
        raise SecurityError("tls", f"negotiated {version}, only TLSv1.3 is allowed")
    selected = tls.selected_alpn_protocol()
    if selected is None:
        raise SecurityError("alpn", f"peer negotiated no ALPN protocol; {alpn!r} is required")
    if selected != alpn:
        raise SecurityError("alpn", f"peer negotiated ALPN {selected!r}; {alpn!r} is required")
    der = tls.getpeercert(binary_form=True)
    if not der:
        raise SecurityError("certificate", "peer presented no certificate")
    pin = leaf_sha256(der)
    if pin not in pinset:
        raise SecurityError("pin", f"peer leaf sha256 {pin} is not in the pin set ({len(pinset)} pinned leaves)")
    cipher = tls.cipher()
    return PeerInfo(pin, selected, version, cipher[0] if cipher else "")


_CERT_REASONS = (
    "CERTIFICATE_REQUIRED",
    "BAD_CERTIFICATE",
    "UNKNOWN_CA",
    "CERTIFICATE_EXPIRED",
    "CERTIFICATE_UNKNOWN",
    "CERTIFICATE_REVOKED",
    "UNSUPPORTED_CERTIFICATE",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE",
    "CERTIFICATE_VERIFY_FAILED",
    "DECRYPT_ERROR",
)
_VERSION_REASONS = (
    "UNSUPPORTED_PROTOCOL",
    "PROTOCOL_VERSION",
    "NO_PROTOCOLS_AVAILABLE",
    "WRONG_VERSION_NUMBER",
    "TLSV1_ALERT_PROTOCOL_VERSION",
)


def map_tls_error(exc: BaseException, *, stage: str, peer: str = "") -> SecurityError:
    """Translate an ``ssl``/socket exception into a typed refusal."""
    where = f"{stage}{' with ' + peer if peer else ''}"
    if isinstance(exc, SecurityError):
        return exc
    if isinstance(exc, ssl.SSLCertVerificationError):
        return SecurityError("certificate", f"{where}: peer certificate refused: {exc.verify_message or exc.reason}")
    if isinstance(exc, ssl.SSLError):
        reason = (exc.reason or str(exc)).upper()
        if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
            return SecurityError("certificate", f"{where}: peer presented no client certificate")
        if any(r in reason for r in _CERT_REASONS):
            # An alert about certificates received from the peer: it refused *ours*.
            return SecurityError("certificate", f"{where}: peer rejected our certificate ({exc.reason})")
        if any(r in reason for r in _VERSION_REASONS):
            return SecurityError("tls", f"{where}: no common protocol version, TLSv1.3 only ({exc.reason})")
        if "APPLICATION_PROTOCOL" in reason:
            return SecurityError("alpn", f"{where}: ALPN refused by peer ({exc.reason})")
        return SecurityError("tls", f"{where}: TLS failure ({exc.reason or exc})")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return SecurityError("tls", f"{where}: timed out")
    if isinstance(exc, (ConnectionError, EOFError)):
        return SecurityError("tls", f"{where}: peer closed the connection ({type(exc).__name__})")
    if isinstance(exc, OSError):
        return SecurityError("tls", f"{where}: {exc.strerror or exc}")
    return SecurityError("tls", f"{where}: {exc}")


def _closed_before_speaking(peer: str) -> SecurityError:
    return SecurityError(
        "tls",
        f"peer {peer} closed the connection before sending anything: it refused this connection (our leaf pin, ALPN or certificate) or aborted",
    )


# -- sockets ------------------------------------------------------------------------------------------


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY and large buffers (C.1). Buffer sizes are capped by the kernel; not fatal."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass


def listen(host: str, port: int, *, backlog: int = 64) -> socket.socket:
    """A tuned, listening TCP socket (plain: TLS happens per connection in :func:`accept`)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tune_socket(sock)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        # name the address: "Address already in use (10.0.0.2:29590)" says which listener failed
        raise OSError(exc.errno, exc.strerror, f"listen {host}:{port}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _peer_name(sock: socket.socket) -> str:
    try:
        addr = sock.getpeername()
        return f"{addr[0]}:{addr[1]}"
    except OSError:
        return "?"


# -- blocking channel ------------------------------------------------------------------------------


class SocketChannel:
    """What every channel type offers on top of its ``recv_into`` and its socket ``sock``:
    derived reads and the socket's lifetime (a TLS channel, and a daemon's relayed channel
    whose TLS a front process terminates: kvpack.node.tls_front)."""

    peer_address: str
    sock: Any

    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0) -> int:
        raise NotImplementedError

    def read_error(self, exc: ssl.SSLError) -> Exception:
        """The typed error of a TLS read failure (for drivers reading ``sock`` directly)."""
        return map_tls_error(exc, stage="read", peer=self.peer_address)

    def recv(self, bufsize: int) -> bytes:
        buf = bytearray(bufsize)
        n = self.recv_into(buf)
        return bytes(buf[:n])

    def recv_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes; EOFError if the peer closes in the middle."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.recv_into(view[got:])
            if k == 0:
                raise EOFError(f"peer {self.peer_address} closed after {got} of {n} bytes")
            got += k
        return bytes(buf)

    # Lifetime ------------------------------------------------------------------------------------
    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def fileno(self) -> int:
        return int(self.sock.fileno())

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def interrupt(self) -> None:
        """Shut the connection down in both directions at the socket, so a thread blocked
        reading or writing it gets an error. The TLS object is not touched: OpenSSL objects
        are not thread-safe, so this is the one thing another thread may do to a channel
        that a thread is inside of (sending on it or closing it then may corrupt memory)."""
        try:
            dup = socket.socket(fileno=os.dup(self.fileno()))
        except (OSError, ValueError):
            return  # already closed
        try:
            dup.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            dup.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TlsChannel(SocketChannel):
    """A verified mTLS connection (blocking). Built only by :func:`connect` and :func:`accept`."""

    def __init__(self, sock: ssl.SSLSocket, peer: PeerInfo, *, side: str, pending: bytes = b"") -> None:
        self.sock = sock
        self.peer = peer
        self.side = side
        self.peer_address = _peer_name(sock)
        self._pending = bytearray(pending)
        self.peer_has_spoken = bool(pending)
        self.bytes_received = 0

    # Reads ---------------------------------------------------------------------------------------
    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0) -> int:
        """Read into ``buffer``; 0 means orderly EOF *after* the peer had spoken."""
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        if not view:
            return 0
        if self._pending:
            n = min(len(view), len(self._pending))
            view[:n] = self._pending[:n]
            del self._pending[:n]
            self.bytes_received += n
            return n
        try:
            n = self.sock.recv_into(view)
        except ssl.SSLError as exc:
            raise map_tls_error(exc, stage="read", peer=self.peer_address) from None
        except (ConnectionError, socket.timeout, TimeoutError) as exc:
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address) from None
            raise exc
        if n == 0:
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address)
            return 0
        self.peer_has_spoken = True
        self.bytes_received += n
        return n

    def has_pending(self) -> bool:
        """Bytes read ahead (during the handshake) that :meth:`recv_into` hands out first."""
        return bool(self._pending)

    # Writes --------------------------------------------------------------------------------------
    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self.sock.sendall(data)
        except ssl.SSLError as exc:
            raise map_tls_error(exc, stage="write", peer=self.peer_address) from None
        except ConnectionError:
            # A peer that refused us (pin/ALPN) closes; our write may hit its reset first.
            if not self.peer_has_spoken:
                raise _closed_before_speaking(self.peer_address) from None
            raise


def _await_server_confirmation(tls: ssl.SSLSocket, deadline: float, peer: str) -> bytes:
    """Client side: wait until the server spoke after verifying us (ticket, data or alert)."""
    received = bytearray()
    tls.setblocking(False)
    try:
        while True:
            try:
                chunk = tls.recv(1 << 16)
            except ssl.SSLWantReadError:
                chunk = None
            except ssl.SSLError as exc:
                raise map_tls_error(exc, stage="TLS confirmation", peer=peer) from None
            except ConnectionError:
                raise _closed_before_speaking(peer) from None
            if chunk == b"":
                if received:
                    return bytes(received)
                raise _closed_before_speaking(peer)
            if chunk:
                received += chunk
                return bytes(received)
            session = tls.session
            if session is not None and session.has_ticket:
                return bytes(received)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SecurityError(
                    "tls",
                    f"server {peer} did not confirm the connection (no TLS 1.3 session ticket, data or alert) before the handshake deadline",
                )
            select.select([tls], [], [], remaining)
    finally:
        tls.setblocking(True)


def connect(
    endpoint: TlsEndpoint,
    host: str,
    port: int,
    *,
    server_name: str | None = None,
    context: ssl.SSLContext | None = None,
    timeout: float | None = None,
) -> TlsChannel:
    """Open a verified client channel to ``host:port``.

    Returns only after: the TLS 1.3 handshake, our checks of the server (CA chain, SAN,
    ALPN, pin), and the server's confirmation that it accepted our certificate chain.
    """
    name = server_name or endpoint.server_name
    if not name:
        raise SecurityError("config", "a server_name (SNI and expected SAN) is required to connect")
    ctx = context or client_context(endpoint)
    limit = endpoint.handshake_timeout if timeout is None else timeout
    deadline = time.monotonic() + limit
    peer = f"{host}:{port}"
    last_error: OSError | None = None
    raw: socket.socket | None = None
    for family, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        raw = socket.socket(family, socket.SOCK_STREAM)
        tune_socket(raw)
        raw.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            raw.connect(addr)
            break
        except OSError as exc:
            raw.close()
            raw = None
            last_error = exc
    if raw is None:
        raise SecurityError("tls", f"cannot connect to {peer}: {last_error}")
    try:
        tls = ctx.wrap_socket(raw, server_hostname=name, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    try:
        tls.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            tls.do_handshake()
        except (OSError, ssl.SSLError) as exc:
            raise map_tls_error(exc, stage="handshake", peer=peer) from None
        info = verify_peer(tls, endpoint.peer_pins, endpoint.alpn)
        pending = _await_server_confirmation(tls, deadline, peer)
        tls.settimeout(None)
    except BaseException:
        tls.close()
        raise
    return TlsChannel(tls, info, side="client", pending=pending)


def accept(
    listener: socket.socket,
    endpoint: TlsEndpoint,
    *,
    context: ssl.SSLContext | None = None,
    timeout: float | None = None,
) -> TlsChannel:
    """Accept one connection from ``listener`` and return it verified, or raise its refusal.

    The refused connection is closed; call again for the next one.
    """
    raw, addr = listener.accept()
    return wrap_accepted(raw, endpoint, context=context, timeout=timeout)


def wrap_accepted(
    raw: socket.socket,
    endpoint: TlsEndpoint,
    *,
    context: ssl.SSLContext | None = None,
    timeout: float | None = None,
) -> TlsChannel:
    """Server-side handshake and verification on an accepted TCP socket (closed on refusal)."""
    peer = _peer_name(raw)
    try:
        ctx = context or server_context(endpoint)
        tune_socket(raw)
        raw.settimeout(endpoint.handshake_timeout if timeout is None else timeout)
        tls = ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
    except BaseException:
        raw.close()
        raise
    try:
        try:
            tls.do_handshake()
        except (OSError, ssl.SSLError) as exc:
            raise map_tls_error(exc, stage="handshake", peer=peer) from None
        info = verify_peer(tls, endpoint.peer_pins, endpoint.alpn)
        tls.settimeout(None)
    except BaseException:
        tls.close()
        raise
    return TlsChannel(tls, info, side="server")
