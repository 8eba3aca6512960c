"""The decode node's receive loop fills whole ``wanted()`` views before advancing: a peer
that stalls in the middle of one is still cut off by the existing deadlines (the accept
deadline before admission, ``timeout_ms`` after), with a refusal receipt, nothing
installed and nothing reserved -- also when TLS fronts relay the connection (deadlines stay
in the daemon)."""

from __future__ import annotations

import dataclasses
import select
import time

import pytest

from kvpack.errors import ProtocolError
from kvpack.security.tls import connect

from .helpers import Proxy, receipts
from .test_nodes_arrays import PROMPT, nodes  # noqa: F401 - the fixture


class StallingProxy(Proxy):
    """Relays producer -> receiver bytes up to ``stall_at``, then swallows the rest (the
    connections stay open: the receiver sees a silent peer, not an EOF)."""

    def __init__(self, target_port: int, *, stall_at: int) -> None:
        self.stall_at = stall_at
        super().__init__(target_port)

    def _relay(self, client, server) -> None:
        socks = [client, server]
        try:
            while not self._stop:
                r, _, _ = select.select(socks, [], [], 0.2)
                for s in r:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is client:
                        data = data[: max(0, self.stall_at - self.up)]
                        self.up += len(data)
                        if data:
                            server.sendall(data)
                    else:
                        self.down += len(data)
                        client.sendall(data)
        except OSError:
            return
        finally:
            client.close()
            server.close()


@pytest.mark.parametrize("fronts", [0, 2])
def test_peer_stalling_mid_segment_is_cut_off_by_timeout_ms(nodes, fronts):  # noqa: F811
    n = nodes(tls_fronts=fronts)
    n.rcfg = dataclasses.replace(n.rcfg, timeout_ms=1500, wait_for_producer_ms=1500)
    n.restart_receiver()
    n.receiver.generate(PROMPT[:300], 4)  # a live session to keep intact
    before = n.snapshot()
    ledger = n.receiver.ledger.snapshot()
    proxy = StallingProxy(n.receiver.data_port, stall_at=150_000)  # inside a tile, after admission
    n.receiver._advertised_port = proxy.port
    t0 = time.monotonic()
    try:
        with pytest.raises(ProtocolError) as info:
            n.receiver.generate(list(range(2, 1000)), 4)
    finally:
        proxy.close()
    took = time.monotonic() - t0
    assert proxy.up == 150_000
    assert info.value.category == "aborted"
    assert 1.4 < took < 30
    assert n.snapshot() == before and n.receiver.ledger.snapshot() == ledger
    last = n.refused()[-1]
    assert last["phase"] == "admitted" and last["reason"] == "aborted" and "timed out" in last["detail"], last
    assert 0 < last["payload_bytes"] < 150_000
    assert not fronts or n.receiver.listener.snapshot()["tls_fronts"]["relayed_total"] == 2  # both transfers relayed


@pytest.mark.parametrize("fronts", [0, 2])
def test_peer_stalling_before_admission_is_cut_off_by_the_accept_deadline(nodes, fronts):  # noqa: F811
    n = nodes(tls_fronts=fronts)
    ep = n.pcfg.data_endpoint("decode-a")
    # the accept deadline runs from expect(): time from there (a handshake slowed by a
    # loaded machine must not make the refusal look early)
    t0 = time.monotonic()
    pending = n.receiver.expect("muser-1-7", PROMPT, wait_s=1.0)
    ch = connect(ep, "127.0.0.1", n.receiver.data_port)
    try:
        ch.sendall(b"KVPKV2\0\0\x10\0")  # half a preamble, then silence
        with pytest.raises(ProtocolError) as info:
            n.receiver.wait(pending)
    finally:
        ch.close()
    took = time.monotonic() - t0
    assert 0.9 < took < 10
    assert "accept deadline" in info.value.message
    deadline = time.monotonic() + 5
    while not n.refused() and time.monotonic() < deadline:
        time.sleep(0.05)
    last = receipts(n.rdir)[-1]
    assert last["verdict"] == "refused" and last["phase"] == "begin"
    assert last["reason"] == "aborted" and "timed out" in last["detail"], last
    assert not fronts or n.receiver.listener.snapshot()["tls_fronts"]["relayed_total"] == 1


@pytest.mark.parametrize("fronts", [0, 2])
def test_peer_trickling_before_admission_is_cut_off_at_the_accept_deadline(nodes, fronts):  # noqa: F811
    """A peer that sends one byte every 0.3 s never trips a per-read timeout; the accept
    deadline (1 s here) must still bound the whole wait before admission."""
    import threading

    n = nodes(tls_fronts=fronts)
    ep = n.pcfg.data_endpoint("decode-a")
    pending = n.receiver.expect("muser-1-7", PROMPT, wait_s=1.0)
    ch = connect(ep, "127.0.0.1", n.receiver.data_port)
    before = len(n.refused())
    stop = threading.Event()

    def trickle():
        for byte in b"KVPKV2\0\0\x10\0\0\0\0\0\0\0" * 2:  # 32 bytes: ~9.6 s at this pace
            if stop.is_set():
                return
            try:
                ch.sendall(bytes([byte]))
            except OSError:
                return  # the receiver dropped the connection
            time.sleep(0.3)

    t0 = time.monotonic()
    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        with pytest.raises(ProtocolError):
            n.receiver.wait(pending)
        deadline = time.monotonic() + 8
        while len(n.refused()) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        stop.set()
        ch.close()
        th.join(timeout=5)
    assert len(n.refused()) > before, "the trickling connection was never refused"
    last = n.refused()[-1]
    assert last["phase"] == "begin" and last["reason"] == "aborted", last
    assert not fronts or n.receiver.listener.snapshot()["tls_fronts"]["relayed_total"] == 1
    assert took < 3.0, f"the trickling peer held the connection {took:.1f} s past a 1 s accept deadline"
