"""mTLS on real loopback sockets: every refusal is typed, and the server's trusted state (a replay
ledger the handler would reserve into) is unchanged by refused connections."""

from __future__ import annotations

import socket
import ssl

import pytest

from kvpack.errors import SecurityError
from kvpack.security.ledger import ReplayLedger
from kvpack.security.tls import (
    CONTROL_ALPN,
    DATA_ALPN,
    client_context,
    connect,
    leaf_sha256,
    validate_pins,
)


@pytest.fixture
def ledger(tmp_path):
    with ReplayLedger.open(tmp_path / "state" / "ledger.json") as led:
        yield led


def ledger_bytes(led: ReplayLedger) -> bytes:
    with open(led.path, "rb") as fh:
        return fh.read()


def message(generation: int, body: bytes) -> bytes:
    return generation.to_bytes(8, "little") + len(body).to_bytes(8, "little") + body


def raw_client(pki, *, cert: str | None = "client", alpn: tuple[str, ...] | list[str] | None = (DATA_ALPN,), tls12: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki.ca)
    if tls12:
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    else:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if cert:
        ctx.load_cert_chain(pki.leaves[cert].cert, pki.leaves[cert].key)
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return ctx


def raw_attempt(ctx: ssl.SSLContext, port: int) -> BaseException | None:
    """Handshake with a plain ssl client, then try one round trip; return what went wrong."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                tls.sendall(message(1, b"x"))
                return None if tls.recv(64) else EOFError("closed")
        except (ssl.SSLError, OSError) as exc:
            return exc


def assert_refused(run, category: str, led: ReplayLedger, before: bytes) -> SecurityError:
    assert run.done.wait(10)
    assert isinstance(run.error, SecurityError), run.error
    assert run.error.category == category, run.error
    assert run.received == b""
    assert ledger_bytes(led) == before and led.watermark("test-key", 1) is None
    return run.error


# -- success ---------------------------------------------------------------------------------------


def test_correct_handshake_moves_data_and_reserves(tls_pki, tls_server, ledger):
    server_ep = tls_pki.endpoint("server", [tls_pki.leaves["client"].pin])
    client_ep = tls_pki.endpoint("client", [tls_pki.leaves["server"].pin])
    run = tls_server(server_ep, ledger=ledger)
    payload = bytes(range(256)) * 4096  # 1 MiB
    with connect(client_ep, "127.0.0.1", run.port) as ch:
        assert ch.peer.leaf_sha256 == tls_pki.leaves["server"].pin
        assert ch.peer.alpn == DATA_ALPN and ch.peer.version == "TLSv1.3"
        assert not ch.peer_has_spoken  # the handshake alone never counts as "established"
        ch.sendall(message(7, payload))
        assert ch.recv_exact(20) == b"ack:" + payload[:16]
        assert ch.peer_has_spoken
        nodelay = ch.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert nodelay
    assert run.done.wait(10) and run.error is None and run.read_error is None
    assert run.received == payload and run.peer_pin == tls_pki.leaves["client"].pin
    assert ledger.watermark("test-key", 1) == 7


# -- refusals --------------------------------------------------------------------------------------


def test_wrong_alpn_refused_on_both_sides(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    client_ep = tls_pki.endpoint("client", [tls_pki.leaves["server"].pin], alpn=CONTROL_ALPN)
    with pytest.raises(SecurityError) as info:
        connect(client_ep, "127.0.0.1", run.port)
    assert info.value.category == "alpn"
    err = assert_refused(run, "alpn", ledger, before)
    assert DATA_ALPN in err.message


def test_client_offering_other_alpn_refused(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    raw_attempt(raw_client(tls_pki, alpn=["http/1.1"]), run.port)
    assert_refused(run, "alpn", ledger, before)


def test_no_alpn_refused_by_server(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    raw_attempt(raw_client(tls_pki, alpn=None), run.port)
    err = assert_refused(run, "alpn", ledger, before)
    assert "no ALPN" in err.message


def test_no_alpn_refused_by_client(tls_pki, tls_server, ledger):
    # A server that negotiates no ALPN at all (plain ssl context without ALPN).
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(tls_pki.leaves["server"].cert, tls_pki.leaves["server"].key)
    ctx.load_verify_locations(tls_pki.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), context=ctx, ledger=ledger)
    with pytest.raises(SecurityError) as info:
        connect(tls_pki.endpoint("client", [tls_pki.leaves["server"].pin]), "127.0.0.1", run.port)
    assert info.value.category == "alpn" and "no ALPN" in info.value.message
    assert run.done.wait(10)
    # The server side's own check refuses too: it could not see our protocol either.
    assert isinstance(run.error, SecurityError) and run.error.category == "alpn"


def test_client_without_certificate_learns_at_connect(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    client_ep = tls_pki.endpoint("client", [tls_pki.leaves["server"].pin])
    # The TLS 1.3 handshake itself succeeds for the client; connect() must still refuse.
    no_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    no_cert.minimum_version = ssl.TLSVersion.TLSv1_3
    no_cert.load_verify_locations(tls_pki.ca)
    no_cert.set_alpn_protocols([DATA_ALPN])
    with pytest.raises(SecurityError) as info:
        connect(client_ep, "127.0.0.1", run.port, context=no_cert)
    assert info.value.category == "certificate" and "rejected our certificate" in info.value.message
    err = assert_refused(run, "certificate", ledger, before)
    assert "no client certificate" in err.message


def test_same_ca_but_unpinned_client_refused(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    intruder = tls_pki.endpoint("intruder", [tls_pki.leaves["server"].pin])
    # Its chain is valid, so TLS accepts it; the server's pin refusal arrives as a close, seen
    # either while connect() waits for confirmation or at the first read: never as success.
    with pytest.raises(SecurityError) as info:
        with connect(intruder, "127.0.0.1", run.port) as ch:
            ch.sendall(message(1, b"replay me"))
            ch.recv_exact(13)
    assert info.value.category == "tls" and "before sending anything" in info.value.message
    err = assert_refused(run, "pin", ledger, before)
    assert tls_pki.leaves["intruder"].pin in err.message


def test_expired_client_certificate_refused(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["expired"].pin]), ledger=ledger)
    with pytest.raises(SecurityError) as info:
        connect(tls_pki.endpoint("expired", [tls_pki.leaves["server"].pin]), "127.0.0.1", run.port)
    assert info.value.category == "certificate"
    err = assert_refused(run, "certificate", ledger, before)
    assert "expired" in err.message


def test_client_from_foreign_ca_refused(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["foreign"].pin]), ledger=ledger)
    with pytest.raises(SecurityError) as info:
        connect(tls_pki.endpoint("foreign", [tls_pki.leaves["server"].pin]), "127.0.0.1", run.port)
    assert info.value.category == "certificate"
    assert_refused(run, "certificate", ledger, before)


def test_tls12_only_client_refused(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    failure = raw_attempt(raw_client(tls_pki, tls12=True), run.port)
    assert isinstance(failure, ssl.SSLError)
    err = assert_refused(run, "tls", ledger, before)
    assert "TLSv1.3" in err.message


def test_server_with_unpinned_leaf_refused(tls_pki, tls_server, ledger):
    before = ledger_bytes(ledger)
    run = tls_server(tls_pki.endpoint("rogue-server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    with pytest.raises(SecurityError) as info:
        connect(tls_pki.endpoint("client", [tls_pki.leaves["server"].pin]), "127.0.0.1", run.port)
    assert info.value.category == "pin"
    assert tls_pki.leaves["rogue-server"].pin in info.value.message
    assert run.done.wait(10)
    # The rogue server's handshake completed, but the client never spoke: its read is refused.
    assert run.error is None and isinstance(run.read_error, SecurityError)
    assert run.read_error.category == "tls"
    assert ledger_bytes(ledger) == before


def test_server_name_must_match_san(tls_pki, tls_server, ledger):
    run = tls_server(tls_pki.endpoint("server", [tls_pki.leaves["client"].pin]), ledger=ledger)
    with pytest.raises(SecurityError) as info:
        connect(tls_pki.endpoint("client", [tls_pki.leaves["server"].pin]), "127.0.0.1", run.port, server_name="muser-prefilld")
    assert info.value.category == "certificate" and "mismatch" in info.value.message.lower()
    assert run.done.wait(10)


@pytest.mark.parametrize("pins", [[], ["A" * 64], ["ab" * 31], "ab" * 32])
def test_pin_set_rules(pins):
    with pytest.raises(SecurityError) as info:
        validate_pins(pins)
    assert info.value.category == "config"


def test_leaf_sha256_is_der_digest(tls_pki):
    ctx = client_context(tls_pki.endpoint("client", [tls_pki.leaves["server"].pin]))
    with open(tls_pki.leaves["server"].cert) as fh:
        der = ssl.PEM_cert_to_DER_cert(fh.read())
    assert leaf_sha256(der) == tls_pki.leaves["server"].pin
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_3 == ctx.maximum_version
