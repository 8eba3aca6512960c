"""Shared fixtures for the security tests: a throw-away PKI and a loopback TLS server thread.

The PKI is built with the same functions enrollment uses (ECDSA P-256, EKU serverAuth+clientAuth),
once per session, because key generation dominates runtime otherwise.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from dataclasses import dataclass, field

import pytest

from kvpack.durable import atomic_write
from kvpack.security import enroll as pki
from kvpack.security.ledger import ReplayLedger
from kvpack.security.tls import DATA_ALPN, TlsEndpoint, accept, listen


@dataclass(frozen=True)
class Leaf:
    name: str
    cert: str
    key: str
    pin: str


@dataclass
class Pki:
    root: str
    ca: str
    other_ca: str
    leaves: dict[str, Leaf]

    def endpoint(self, leaf: str, pins: list[str], *, alpn: str = DATA_ALPN, ca: str | None = None, server_name: str | None = "localhost") -> TlsEndpoint:
        lf = self.leaves[leaf]
        return TlsEndpoint(lf.cert, lf.key, ca or self.ca, frozenset(pins), alpn, server_name, handshake_timeout=5.0)


def _write_leaf(root: str, name: str, ca_key, ca_cert, **kw) -> Leaf:
    key = pki.generate_key()
    cert = pki.issue_leaf(ca_key, ca_cert, pki.make_csr(key, name), [name, *pki.LOOPBACK_SANS], **kw)
    key_path, cert_path = os.path.join(root, f"{name}.key"), os.path.join(root, f"{name}.crt")
    atomic_write(key_path, pki.key_pem(key), mode=0o600)
    atomic_write(cert_path, pki.cert_pem(cert), mode=0o644)
    return Leaf(name, cert_path, key_path, pki.cert_sha256(cert))


@pytest.fixture(scope="session")
def tls_pki(tmp_path_factory) -> Pki:
    root = str(tmp_path_factory.mktemp("pki"))
    ca_key, ca_cert = pki.make_ca("test CA")
    other_key, other_cert = pki.make_ca("other CA")
    ca_path, other_path = os.path.join(root, "ca.crt"), os.path.join(root, "other-ca.crt")
    atomic_write(ca_path, pki.cert_pem(ca_cert), mode=0o644)
    atomic_write(other_path, pki.cert_pem(other_cert), mode=0o644)
    now = dt.datetime.now(dt.timezone.utc)
    leaves = {
        "server": _write_leaf(root, "server", ca_key, ca_cert),
        "client": _write_leaf(root, "client", ca_key, ca_cert),
        # Same CA, valid, but nobody pins it.
        "intruder": _write_leaf(root, "intruder", ca_key, ca_cert),
        "rogue-server": _write_leaf(root, "rogue-server", ca_key, ca_cert),
        "expired": _write_leaf(root, "expired", ca_key, ca_cert, not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1)),
        "foreign": _write_leaf(root, "foreign", other_key, other_cert),
    }
    return Pki(root, ca_path, other_path, leaves)


@dataclass
class ServerRun:
    """One accepted connection, handled in a thread: the outcome is recorded for assertions."""

    listener: object
    port: int
    thread: threading.Thread | None = None
    error: BaseException | None = None
    read_error: BaseException | None = None
    received: bytes = b""
    peer_pin: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


@pytest.fixture
def tls_server():
    """Factory: start a one-shot TLS server on 127.0.0.1 (ephemeral port); joined and closed after."""
    runs: list[ServerRun] = []

    def start(endpoint: TlsEndpoint, *, ledger: ReplayLedger | None = None, context=None) -> ServerRun:
        listener = listen("127.0.0.1", 0)
        run = ServerRun(listener, listener.getsockname()[1])

        def serve() -> None:
            try:
                channel = accept(listener, endpoint, context=context, timeout=5.0)
            except BaseException as exc:  # recorded for the test to inspect
                run.error = exc
                run.done.set()
                return
            with channel:
                channel.settimeout(5.0)
                run.peer_pin = channel.peer.leaf_sha256
                try:
                    # Protocol of this test server: 8-byte generation, then an echo of n bytes.
                    header = channel.recv_exact(16)
                    generation = int.from_bytes(header[:8], "little")
                    size = int.from_bytes(header[8:], "little")
                    run.received = channel.recv_exact(size)
                    if ledger is not None:
                        ledger.reserve("test-key", 1, generation)
                    channel.sendall(b"ack:" + run.received[:16])
                except BaseException as exc:
                    run.read_error = exc
            run.done.set()

        run.thread = threading.Thread(target=serve, daemon=True)
        run.thread.start()
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.thread is not None:
            run.thread.join(timeout=10)
        run.listener.close()
