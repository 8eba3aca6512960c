"""More attacker and operator cases for the node tier (issue 14), beyond the ones the issue
lists, on loopback against real nodes (mutual TLS, the arrays engine):

* a request cancelled while a busy producer has not answered ``accepted`` yet frees its
  decode slot within 1 s, and the producer then takes no job for it (no generation, no data
  connection, no ``unsolicited`` refusal at the receiver);
* the transport's counts return to zero after connections that close right after accept,
  reset mid-handshake, or trickle a ClientHello byte by byte, on IPv4 and IPv6, with and
  without TLS fronts;
* a damaged generation ledger is one typed ``ledger`` line before the model loads (it was an
  ``internal`` error, "a bug", exit 70) and leaves no lock behind;
* a local API request nested past the recursion limit gets its one-line ``usage`` refusal
  (its thread died with a traceback and the client got no reply);
* a request waiting for a busy named (received) session stops waiting within 1 s once its
  client hangs up (it waited for the other request to finish), and the session is untouched;
* trickling peers on the observability (metrics / status) port cost one of 64 slots until a
  whole-connection deadline (they held a thread each, without limit, for as long as they
  kept trickling);
* a local API client that half-closes after its request line (``nc -N``) gets its reply (any
  EOF cancelled the request, with no reply), and a full close still cancels;
* a flood of junk connections from anyone no longer replaces a request's own refusal
  category (``identity`` from its producer's connection) with theirs (``tls``);
* a node holding silent authenticated connections stops at once (it joined each worker for
  5 s in turn: 6 silent peers made the decode node take 30 s to stop);
* ``--handshake-timeout`` past the listener's 600 s bound is a ``usage`` line, not an
  ``internal`` error (exit 70);
* probes that found nothing, kept as regression tests: one stripe of four reset mid-stream,
  again and again, leaks no slot, route, connection or prefill slot (with and without fronts).
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import struct
import tempfile
import threading
import time
from typing import Optional

import pytest

from kvpack.node.common import load_engine
from kvpack.node.local_api import request_local
from kvpack.node.producer import ProducerNode
from kvpack.node.receiver import ReceiverNode
from kvpack.node.transport import Limits
from kvpack.security.tls import client_context

from .helpers import Enrolled, receipts

ENGINE = "arrays:4:2:8"


def _prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * k) % 60 + 1 for k in range(n)]


def _wait(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


class Pair:
    """One producer and one decode node, in process, on loopback."""

    def __init__(
        self,
        root: str,
        *,
        prefill_slots: int = 4,
        pacing=None,
        decode_slots: int = 2,
        limits=None,
        tls_fronts=0,
        listen_host=None,
        api_limits=None,
        producer_engine: str = ENGINE,
        stripe_connect_s: float = 10.0,
        store=None,
    ) -> None:
        import dataclasses

        self.root = root
        self.engine = load_engine(ENGINE)
        self.enrolled = Enrolled(os.path.join(root, "cluster"), self.engine)
        self.pdir, self.rdir = os.path.join(root, "p"), os.path.join(root, "r")
        self.producer = ProducerNode(
            # another engine than the receiver's: a config from before recorded identities (else it refuses to start)
            self.enrolled.producer_config() if producer_engine == ENGINE else self.enrolled.producer_config_without_identities(),
            load_engine(producer_engine),
            receipts_dir=self.pdir,
            prefill_slots=prefill_slots,
            pacing_bytes_per_s=pacing,
            metrics_port=None,
            stripe_connect_s=stripe_connect_s,
        ).start()
        self.enrolled.producer_listening("prefill-a", self.producer.control_port)
        self.socket = os.path.join(tempfile.mkdtemp(prefix="kvm-"), "r.sock")
        cfg = self.enrolled.receiver_config()
        if listen_host is not None:
            cfg = dataclasses.replace(cfg, listen_host=listen_host, advertised_receiver_host=listen_host)
        self.receiver = ReceiverNode(
            cfg,
            self.engine,
            receipts_dir=self.rdir,
            check_volume=False,
            socket_path=self.socket,
            decode_slots=decode_slots,
            metrics_port=None,
            limits=limits,
            tls_fronts=tls_fronts,
            api_limits=api_limits,
            store=store,
        ).start()

    def stop(self) -> None:
        self.receiver.stop()
        self.producer.stop()


@pytest.fixture
def pair(tmp_path):
    made: list[Pair] = []

    def make(**kw) -> Pair:
        p = Pair(str(tmp_path / f"n{len(made)}"), **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()


def test_a_request_cancelled_before_a_busy_producer_accepts_frees_its_slot_at_once(pair):
    # one prefill slot, held by a slow (paced) job: the next request waits for "accepted"
    # while the producer waits up to its slot_wait_s (10 s) for a slot
    p = pair(prefill_slots=1, pacing=100_000, decode_slots=2)
    first: dict = {}
    t_first = threading.Thread(target=lambda: first.update(request_local(p.socket, {"tokens": _prompt(1, 1500), "max_new_tokens": 2}, timeout=120)))
    t_first.start()
    try:
        assert _wait(lambda: p.producer._slots._value == 0, 10)  # the first job holds the prefill slot
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(p.socket)
        s.sendall(json.dumps({"tokens": _prompt(2, 300), "max_new_tokens": 2}).encode() + b"\n")
        assert _wait(lambda: p.receiver.slots.busy() == 2, 10)
        time.sleep(0.5)  # the second request now waits for the producer's answer
        assert p.producer._slots._value == 0 and t_first.is_alive()
        s.close()
        t_closed = time.monotonic()
        assert _wait(lambda: p.receiver.slots.busy() == 1, 5)
        assert time.monotonic() - t_closed < 1.0
    finally:
        t_first.join(timeout=120)
    assert first.get("ok"), first
    # the producer saw the receiver leave while it waited: no job, no generation, no data
    # connection -- so the receiver refused nothing as unsolicited
    assert _wait(lambda: any(r.get("detail", "").startswith("the receiver went away while waiting") for r in receipts(p.pdir)), 10)
    assert p.producer.ledger.next == 2  # only the first job's generation was taken
    assert not [r for r in receipts(p.rdir) if r["verdict"] == "refused"]
    assert request_local(p.socket, {"tokens": _prompt(3, 300), "max_new_tokens": 2}, timeout=60)["ok"]


def _client_hello(enrolled) -> bytes:
    ep = enrolled.producer_config().data_endpoint("decode-a")
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context(ep).wrap_bio(inc, out, server_hostname=ep.server_name)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return out.read()


@pytest.mark.parametrize("host,fronts", [("127.0.0.1", 0), ("127.0.0.1", 2), ("::1", 0)])
def test_connections_that_vanish_or_trickle_a_client_hello_leave_no_count_behind(pair, host, fronts):
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6")
    p = pair(limits=Limits(handshake_s=1.0), tls_fronts=fronts, listen_host=host)
    port = p.receiver.data_port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    hello = _client_hello(p.enrolled)
    rst = struct.pack("ii", 1, 0)

    def conn() -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.connect((host, port))
        return s

    for _ in range(30):
        conn().close()  # gone right after accept
    for cut in (1, 100, len(hello)):
        for _ in range(10):  # reset mid-handshake: part of a ClientHello, then RST
            s = conn()
            s.sendall(hello[:cut])
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, rst)
            s.close()

    def trickle() -> None:
        s = conn()
        try:
            for b in hello[:40]:  # one byte every 50 ms: past the 1 s handshake deadline
                s.send(bytes([b]))
                time.sleep(0.05)
        except OSError:
            pass
        finally:
            s.close()

    threads = [threading.Thread(target=trickle) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    listener = p.receiver.listener

    def settled() -> bool:
        snap = listener.snapshot()
        return snap["connections"] == 0 and snap["handshakes"] == 0 and snap["authenticated"] == 0

    assert _wait(settled, 10), listener.snapshot()
    snap = listener.snapshot()
    assert snap["accepted_total"] == 30 + 30 + 4 and snap["refused_total"] == snap["accepted_total"], snap
    assert snap["refusals"].get("handshake_timeout", 0) == 4, snap["refusals"]
    # and nothing of it reached a request: the node serves at once
    assert request_local(p.socket, {"tokens": _prompt(4, 300), "max_new_tokens": 2}, timeout=60)["ok"]


@pytest.mark.parametrize(
    "content",
    [b"garbage", b"\xff\xfe\x00", b'{"next_gen', b'{"next_generation": 0}', b"[]", b"[" * 4000],
    ids=["garbage", "not-utf8", "truncated", "zero", "list", "nested"],
)
def test_a_damaged_generation_ledger_is_one_ledger_line_before_the_model_loads(tmp_path, monkeypatch, capsys, content):
    """In process: the engine loader must never be reached, and the refusal leaves no lock."""
    from kvpack import cli
    from kvpack.node import common
    from kvpack.node.producer import GenerationLedger

    enrolled = Enrolled(str(tmp_path / "cluster"), load_engine(ENGINE))
    path = enrolled.producer_config().generation_ledger
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(content)
    os.chmod(path, 0o600)

    def never(*_a, **_k):
        raise AssertionError("the engine was loaded before the generation ledger was checked")

    monkeypatch.setattr(common, "load_engine", never)
    code = cli.main(["producer", "--config", enrolled.producer_config_path(), "--engine", ENGINE, "--no-store", "--no-metrics"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("kvpack: ledger: generation ledger "), (code, err)
    # repaired, it opens at once: the refused start left no lock behind
    with open(path, "wb") as fh:
        fh.write(b'{"next_generation": 7}\n')
    ledger = GenerationLedger(path)
    try:
        assert ledger.next == 7
    finally:
        ledger.close()


def test_a_request_nested_past_the_recursion_limit_gets_its_one_line_refusal(pair):
    p = pair(decode_slots=1)

    def ask(data: bytes) -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(p.socket)
            s.sendall(data)
            out = b""
            while not out.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
            return out

    for line in (b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", b'{"tokens": [1, 2], "x": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001 + b"\n"):
        reply = json.loads(ask(line))
        assert reply["ok"] is False and reply["error"] == {"reason": "usage", "detail": "a local API request is one JSON object: JSON nested too deeply"}, reply
    assert json.loads(ask(json.dumps({"tokens": _prompt(5, 300), "max_new_tokens": 1}).encode() + b"\n"))["ok"]


def test_a_request_cancelled_while_waiting_for_a_busy_named_session_leaves_it_untouched(pair):
    """A named session (where an unsolicited transfer landed) serves one request at a time. A
    second request waiting for it whose client hangs up must stop waiting at once and must
    not extend the session with its prompt when the first one is done."""
    from kvpack.node.local_api import ApiLimits

    p = pair(decode_slots=1, api_limits=ApiLimits(max_new_tokens=200_000))
    node = p.receiver
    held = _prompt(6, 300)
    session = p.engine.new_session()
    session.prefill(held[:-1])
    node.sessions.put("landed-1", session)
    first: dict = {}
    long_run = {"session": "landed-1", "tokens": held, "max_new_tokens": 200_000, "stop_at_eos": False}
    s1 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s1.connect(p.socket)
    s1.sendall(json.dumps(long_run).encode() + b"\n")
    assert _wait(lambda: session.position > len(held), 10)  # the first request decodes
    s2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s2.connect(p.socket)
    s2.sendall(json.dumps({"session": "landed-1", "tokens": held + [7, 8, 9], "max_new_tokens": 1}).encode() + b"\n")
    assert _wait(lambda: len(node.api._tokens) == 2, 10)  # the second request is being served:
    time.sleep(0.3)  # it waits for the session (its lock, in 0.1 s steps)
    s2.close()  # the second client leaves while it waits for the session
    t_closed = time.monotonic()
    assert _wait(lambda: len(node.api._tokens) == 1, 5), "the cancelled request kept waiting for the session"
    assert time.monotonic() - t_closed < 1.0
    s1.close()  # now cancel the first one too: its decode stops between two steps
    assert _wait(lambda: not node.api._tokens, 5)
    tokens = list(session.tokens)
    assert tokens[: len(held)] == held and len(tokens) - len(held) < 200_000  # part of the first run
    first.update(request_local(p.socket, {"session": "landed-1", "tokens": tokens + [5], "max_new_tokens": 1}, timeout=30))
    assert first.get("ok"), first  # the session is exactly the first request's: it continues


def test_named_session_decodes_take_decode_slots_and_the_cap_holds(pair):
    """A decode from a named (received) session holds a decode slot like any other decode:
    with one slot, a second named session's request while the first decodes is refused
    ``timeout`` ("all 1 decode slots ...") and its session is untouched; so is a prompt
    request. Before, named-session decodes took no slot: any number ran at once, past the
    documented cap, and the status page showed the node idle."""
    from kvpack.errors import NetworkError
    from kvpack.node.local_api import ApiLimits

    p = pair(decode_slots=1, api_limits=ApiLimits(max_new_tokens=200_000))
    node = p.receiver
    node.slot_wait_s = 0.5
    held = _prompt(6, 300)
    sessions = {}
    for name in ("landed-1", "landed-2"):
        sessions[name] = p.engine.new_session()
        sessions[name].prefill(held[:-1])
        node.sessions.put(name, sessions[name])
    s1 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s1.connect(p.socket)
    s1.sendall(json.dumps({"session": "landed-1", "tokens": held, "max_new_tokens": 200_000, "stop_at_eos": False}).encode() + b"\n")
    try:
        assert _wait(lambda: sessions["landed-1"].position > len(held), 10)  # the first decodes
        assert node.slots.busy() == 1  # ... holding the node's one decode slot
        before = list(sessions["landed-2"].tokens)
        with pytest.raises(NetworkError) as info:
            node.continue_session("landed-2", held, 1)
        assert info.value.category == "timeout" and "all 1 decode slots" in info.value.message, info.value
        assert list(sessions["landed-2"].tokens) == before  # nothing computed in the refused one
        reply = request_local(p.socket, {"session": "landed-2", "tokens": held, "max_new_tokens": 1}, timeout=30)
        assert not reply.get("ok") and reply["error"]["reason"] == "timeout", reply  # the local API: the same refusal
        with pytest.raises(NetworkError):
            node.generate(_prompt(7, 300), 1)  # a prompt request waits for the same slot
    finally:
        s1.close()  # the first client leaves: its decode stops, the slot comes back
    assert _wait(lambda: node.slots.busy() == 0, 5)
    out = node.continue_session("landed-2", held, 1)
    assert len(out["tokens"]) == 1
    assert node.slots.busy() == 0


def test_a_full_store_disk_degrades_only_the_save_not_the_request(pair, tmp_path):
    """``save`` on a decode node whose pack store disk is full: the completion is served and
    the reply says the save failed. Before, the store's ENOSPC failed the whole request
    after its transfer and decode (a landed unsolicited transfer and the producer's saves
    already degraded only the save)."""
    import errno

    from kvpack.store import PackStore
    from kvpack.testing.faults import FaultyOps

    path = str(tmp_path / "store")
    PackStore.init(path)
    full = PackStore.open(path, ops=FaultyOps(fail_ops={"write"}, errno_=errno.ENOSPC))
    p = pair(decode_slots=1, store=full)
    tokens = _prompt(3, 300)  # not a multiple of 256: the prompt's cut is saveable
    res = p.receiver.generate(tokens, 4, save=True)
    assert len(res["tokens"]) == 4, res
    assert res["saved"]["error"].startswith("write: ") and "No space left" in res["saved"]["error"], res["saved"]
    reply = request_local(p.socket, {"tokens": _prompt(4, 300), "max_new_tokens": 2, "save": True}, timeout=60)
    assert reply.get("ok") and "No space left" in reply["result"]["saved"]["error"], reply
    assert p.receiver.slots.busy() == 0
    store = PackStore.open(path)  # nothing half-written
    assert store.verify(read_data=True)["ok"] and store.find_deepest(tokens, p.engine.layout, p.engine.identity.ids()) is None
    plain = p.receiver.generate(tokens, 4)  # what the failed save served is what a plain request serves
    assert plain["tokens"] == res["tokens"] and plain["logits_sha256"] == res["logits_sha256"]


def test_trickling_peers_on_the_observability_port_cost_a_bounded_slot_until_a_whole_deadline(tmp_path, monkeypatch):
    """The metrics / status listener used one thread per connection with a per-read timeout
    only: a peer sending a byte every few seconds held a thread and a descriptor for as long
    as it liked, and any number of peers did. Now: at most ``max_connections`` at once (more
    are closed at once), each connection whole within ``connection_s``."""
    from kvpack.node.metrics import _ObservabilityServer

    from .helpers import http_get

    monkeypatch.setattr(_ObservabilityServer, "connection_s", 2.0)  # the default 10 s, shortened
    engine = load_engine(ENGINE)
    enrolled = Enrolled(str(tmp_path / "cluster"), engine)
    node = ReceiverNode(enrolled.receiver_config(), engine, receipts_dir=str(tmp_path / "r"), check_volume=False, metrics_port=0).start()
    try:
        port = node.metrics.port
        closed: list[float] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def trickle(s: socket.socket) -> None:
            s.settimeout(0.25)
            try:
                while not stop.is_set():
                    s.send(b"G")  # a request line that never ends
                    try:
                        if s.recv(1) == b"":
                            break
                    except socket.timeout:
                        continue
            except OSError:
                pass
            finally:
                closed.append(time.monotonic() - t0)
                s.close()

        # connected one by one (80 at once could overflow the listen backlog: a dropped SYN
        # is retried a second later, and the test would time the kernel, not the server)
        socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(80)]
        threads = [threading.Thread(target=trickle, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        try:
            assert _wait(lambda: len(closed) >= 80 - _ObservabilityServer.max_connections, 3)  # over the cap: closed at once
            assert _wait(lambda: len(closed) == 80, 2.0 + 5.0), len(closed)  # the rest at their deadline
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=5)
        assert _wait(lambda: node.metrics._server.active() == 0, 5)  # each handler thread ended
        assert node.metrics._server.refused >= 80 - _ObservabilityServer.max_connections
        assert " 200 " in http_get(port, "/healthz").splitlines()[0]
    finally:
        node.stop()


class _Proxy:
    """A loopback relay to ``target`` (the decode node's data port) that misbehaves on demand:

    * ``reset=(victim, after)``: resets (RST both ways) its ``victim``-th connection once more
      than ``after`` client bytes went through it (``reset`` is True then);
    * ``hold=victim``: accepts its ``victim``-th connection and holds it silent (a stalled
      stripe: its TLS handshake never completes); ``accepted_while_held`` counts the
      connections accepted after it;
    * ``frozen``: once that event is set it stops reading and forwarding in both directions
      and holds its sockets open -- a decode node whose process froze (SIGSTOP) or whose
      network black-holes, as the producer sees it: no byte, no close, no reset;
      ``freeze_after``: it sets ``frozen`` itself once that many client bytes went through.
    """

    def __init__(
        self,
        target: int,
        *,
        reset: Optional[tuple[int, int]] = None,
        hold: Optional[int] = None,
        frozen: Optional[threading.Event] = None,
        freeze_after: Optional[int] = None,
    ) -> None:
        self.target = target
        self.victim, self.after = reset if reset is not None else (-1, 0)
        self.hold, self.frozen, self.freeze_after = hold, frozen, freeze_after
        self.sock = socket.socket()
        if frozen is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # a frozen peer's window fills fast
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.reset = False
        self.up = 0
        self.held: list[socket.socket] = []
        self.accepted_while_held = 0
        self.closing = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            index, self.accepted = self.accepted, self.accepted + 1
            if self.held:
                self.accepted_while_held += 1
            if index == self.hold:
                self.held.append(client)
                continue
            server = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, server]
            t = threading.Thread(target=self._relay, args=(client, server, index), daemon=True)
            t.start()
            self._threads.append(t)

    def _relay(self, client: socket.socket, server: socket.socket, index: int) -> None:
        import select

        up = 0
        try:
            while not self.closing.is_set():
                if self.frozen is not None and self.frozen.is_set():
                    time.sleep(0.05)
                    continue
                ready, _, _ = select.select([client, server], [], [], 0.05)
                for s in ready:
                    data = s.recv(1 << 14)
                    if not data:
                        return
                    if s is server:
                        client.sendall(data)
                        continue
                    up += len(data)
                    if index == self.victim and up > self.after:
                        for x in (client, server):
                            x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        self.reset = True
                        return
                    server.sendall(data)
                    self.up += len(data)
                    if self.freeze_after is not None and self.frozen is not None and self.up >= self.freeze_after:
                        self.frozen.set()
        except OSError:
            return
        finally:
            client.close()  # after SO_LINGER 0: a reset
            server.close()

    def close(self) -> None:
        self.closing.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for s in [*self.held, *self._socks]:
            s.close()
        for t in self._threads:
            t.join(timeout=2)


@pytest.mark.parametrize("fronts", [0, 2])
def test_a_stripe_connection_reset_mid_transfer_again_and_again_leaks_nothing(pair, fronts):
    """One stripe of four reset mid-stream (before its TLS handshake ended, and after 200 KB),
    three times over: every attempt refused with nothing installed, and nothing is left held
    -- decode slot, route, listener connection, producer prefill slot -- so a striped request
    then commits (also through TLS fronts)."""
    from kvpack.errors import KvpackError

    p = pair(decode_slots=1, tls_fronts=fronts)
    node = p.receiver
    node.generate(_prompt(1, 300), 2)
    before = [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots]
    for attempt, (victim, after) in enumerate([(1, 100), (2, 200_000), (3, 200_000)]):
        proxy = _Proxy(node.data_port, reset=(victim, after))
        node._advertised_port = proxy.port
        try:
            with pytest.raises(KvpackError):
                node.generate(_prompt(2 + attempt, 2000), 2, stripes=4)
        finally:
            proxy.close()
        assert proxy.reset
        assert [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots] == before  # nothing installed
        snap = node.listener.snapshot()
        assert node.slots.busy() == 0 and not node.router.open()
        assert _wait(lambda: node.listener.snapshot()["connections"] == 0, 5), snap
        assert _wait(lambda: p.producer._slots._value == p.producer.prefill_slots, 5)
    assert not [r for r in receipts(p.rdir) if r["verdict"] == "committed" and r.get("stripe", [0, 1])[1] == 4]
    node._advertised_port = None
    res = node.generate(_prompt(9, 2000), 2, stripes=4)
    assert res["transfer"]["stripes"] == 4


def test_stripes_connect_concurrently_and_one_stalled_stripe_aborts_all(pair):
    """A striped job connects its stripes at once under one deadline. The first stripe
    connection is held silent (its handshake never completes): the other three connect meanwhile (they
    connected one after another before, so none did while stripe 0 stalled, and the job
    waited a full handshake timeout per stripe), the job fails at the connect deadline, the
    three open stripes are aborted: nothing installed, no stripe committed, nothing held;
    the next striped request commits."""
    from kvpack.errors import KvpackError

    p = pair(decode_slots=1, stripe_connect_s=2.0)
    node = p.receiver
    node.generate(_prompt(1, 300), 2)
    before = [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots]
    proxy = _Proxy(node.data_port, hold=0)
    node._advertised_port = proxy.port
    try:
        with pytest.raises(KvpackError) as info:
            node.generate(_prompt(2, 2000), 2, stripes=4)
        assert proxy.held and proxy.accepted_while_held == 3, (proxy.accepted, proxy.accepted_while_held)
    finally:
        proxy.close()
    assert info.value.category == "aborted", info.value
    # the producer's job: failed at the connect deadline, stripe named (its receipt may land
    # just after the receiver's request returned)
    assert _wait(lambda: receipts(p.pdir)[-1]["verdict"] == "failed", 5)
    failed = receipts(p.pdir)[-1]
    # the held connection is the first the relay accepted: whichever stripe connected first
    assert failed["verdict"] == "failed" and failed["reason"] == "tls" and re.match(r"stripe [0-3] of 4: ", failed["detail"]), failed
    assert [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots] == before  # nothing installed
    assert node.slots.busy() == 0 and not node.router.open()
    assert _wait(lambda: node.listener.snapshot()["connections"] == 0, 5)
    assert _wait(lambda: p.producer._slots._value == p.producer.prefill_slots, 5)
    assert not [r for r in receipts(p.rdir) if r["verdict"] == "committed" and r.get("stripe", [0, 1])[1] == 4]
    aborted = [r for r in receipts(p.rdir) if r["verdict"] != "committed" and r.get("stripe", [0, 1])[1] == 4]
    assert len(aborted) == 3, [(r.get("stripe"), r["reason"]) for r in aborted]  # the three that connected, each refused
    # each says why: the producer's abort, or a sibling's refusal -- never a cancellation
    # nobody asked for (a stripe stopped by a sibling's refusal used to read "the request
    # this transfer serves was cancelled"); the request's error neither
    for r in aborted:
        assert r["detail"].startswith(("producer abort", "another stripe of this transfer was refused")), r["detail"]
    assert "cancelled" not in info.value.message, info.value
    node._advertised_port = None
    res = node.generate(_prompt(9, 2000), 2, stripes=4)
    assert res["transfer"]["stripes"] == 4


def test_a_client_leaving_while_stripes_connect_ends_the_job_at_once(pair):
    """The client hangs up while the producer is still connecting a job's stripes (one of
    them stalled by a relay, under the default 10 s connect deadline): the decode node cancels
    and closes the control connection, and the producer, which watches it while it waits for
    its stripes, aborts the job and frees its prefill slot within seconds, not at the connect
    deadline; nothing is installed."""
    p = pair(decode_slots=1, prefill_slots=1)
    node = p.receiver
    before = [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots]
    proxy = _Proxy(node.data_port, hold=0)
    node._advertised_port = proxy.port
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(p.socket)
        s.sendall(json.dumps({"tokens": _prompt(4, 2000), "max_new_tokens": 2, "stripes": 4}).encode() + b"\n")
        assert _wait(lambda: bool(proxy.held), 10)  # the producer is connecting its stripes
        assert p.producer._slots._value == 0
        s.close()  # the client leaves
        t_closed = time.monotonic()
        assert _wait(lambda: p.producer._slots._value == p.producer.prefill_slots, 8), "the job waited for its stripes"
        assert time.monotonic() - t_closed < 5.0  # well before the 10 s connect deadline
        assert _wait(lambda: node.slots.busy() == 0, 5)
    finally:
        proxy.close()
    assert [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots] == before
    node._advertised_port = None
    assert node.generate(_prompt(9, 2000), 2, stripes=4)["transfer"]["stripes"] == 4


def test_a_frozen_receiver_holds_a_producer_job_only_until_the_requests_deadline(pair):
    """The decode node freezes mid-transfer (its data and control connections go silent, no
    close). The producer's job ends at the request's deadline (C.14 deadline_unix_ms, here
    4 s): aborted, its prefill slot free, its stripe threads gone. Before, the producer
    ignored the deadline: the job sat in a blocked write, or in the 60 s ack wait, as long
    as the peer stayed frozen, holding a prefill slot each time."""
    import dataclasses

    from kvpack.errors import KvpackError

    p = pair(decode_slots=1, prefill_slots=1)
    node = p.receiver
    link = node.links[0]
    frozen = threading.Event()
    ctl_proxy = _Proxy(p.producer.control_port, frozen=frozen)
    data_proxy = _Proxy(node.data_port, frozen=frozen, freeze_after=64 << 10)
    direct_port = link.control.port
    link.control.port = ctl_proxy.port
    node._advertised_port = data_proxy.port
    link.config = dataclasses.replace(link.config, timeout_ms=4000)  # the request's deadline: t0 + 4 s
    before = [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots]
    try:
        with pytest.raises(KvpackError):  # the decode node gives up on its own side too
            node.generate(_prompt(5, 6000), 2, stripes=2)
        assert frozen.is_set()
        # the producer cannot hear from the frozen node: it must end the job on its own
        assert _wait(lambda: p.producer._slots._value == p.producer.prefill_slots, 20), "the job still holds its prefill slot"
        assert _wait(lambda: receipts(p.pdir) and receipts(p.pdir)[-1].get("verdict") == "failed", 5)
        last = receipts(p.pdir)[-1]
        assert last["reason"] == "aborted" and "deadline passed" in last["detail"], last
        assert _wait(lambda: not [t for t in threading.enumerate() if t.name.startswith("kvpack-producer-stripe-")], 10)
    finally:
        ctl_proxy.close()
        data_proxy.close()
    assert [(list(s.session.tokens), s.session.cache_digest()) for s in node.slots.slots] == before  # nothing installed
    link.control.port, node._advertised_port = direct_port, None
    link.config = dataclasses.replace(link.config, timeout_ms=900_000)
    assert len(node.generate(_prompt(9, 600), 2)["tokens"]) == 2  # served again


def test_a_half_closing_client_gets_its_reply_and_a_full_close_still_cancels(pair):
    """``nc -N`` / ``socat`` shut down their sending side after the request line and then
    read the reply. Every EOF used to count as a hang-up: such a request was cancelled and
    its client got no reply at all."""
    p = pair(decode_slots=1, pacing=100_000)

    def half_closed(payload: bytes) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(p.socket)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        return s

    def reply_of(s: socket.socket) -> dict:
        s.settimeout(60)
        out = b""
        while not out.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            out += chunk
        s.close()
        return json.loads(out)

    line = json.dumps({"tokens": _prompt(7, 300), "max_new_tokens": 2}).encode()
    assert reply_of(half_closed(line + b"\n"))["ok"]
    assert reply_of(half_closed(json.dumps({"tokens": _prompt(7, 300), "max_new_tokens": 3}).encode()))["ok"]  # EOF ends the line
    # half-closed, then gone altogether while a slow (paced) transfer runs: cancelled, slot free
    s = half_closed(json.dumps({"tokens": _prompt(8, 1500), "max_new_tokens": 2}).encode() + b"\n")
    assert _wait(lambda: p.receiver.slots.busy() == 1, 10)
    time.sleep(1.0)
    assert p.receiver.slots.busy() == 1  # still served: the half-close did not cancel it
    s.close()
    t_closed = time.monotonic()
    assert _wait(lambda: p.receiver.slots.busy() == 0, 5)
    assert time.monotonic() - t_closed < 1.0


def test_junk_connections_from_anyone_do_not_replace_a_requests_own_refusal_category(pair):
    """A request reports the category of the refusal that explains it. Refusals before
    authentication (anyone's) were appended to every waiting request and the last one won,
    so a flood of junk connections turned the producer's own ``identity`` refusal into
    ``tls`` -- and once 64 were recorded, a real one was dropped altogether."""
    from kvpack.errors import KvpackError

    # a producer with another engine: its begin is refused ``identity`` before admission
    p = pair(decode_slots=1, producer_engine="arrays:4:2:16")
    node = p.receiver

    def category() -> str:
        with pytest.raises(KvpackError) as info:
            node.generate(_prompt(3, 300), 2)
        return info.value.category

    assert category() == "identity"
    stop = threading.Event()

    def junk() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", node.data_port), timeout=2) as s:
                    s.sendall(b"GET / HTTP/1.0\r\n\r\n")  # not TLS: refused before authentication
                    s.recv(16)
            except OSError:
                pass

    threads = [threading.Thread(target=junk) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        assert _wait(lambda: node.listener.snapshot()["refused_total"] > 20, 10)
        assert [category() for _ in range(3)] == ["identity"] * 3
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)


def test_silent_authenticated_peers_do_not_stretch_a_nodes_stop(tmp_path):
    """Each worker waits for its silent peer's first frame (up to 30 s); stop() joined every
    worker for 5 s in turn, so N silent authenticated peers made a stop take N x 5 s (a
    SIGTERM'd daemon outlived a service manager's stop timeout). Now stop() shuts down the
    served sockets and joins all workers under one deadline."""
    from kvpack.security.tls import connect

    p = Pair(str(tmp_path), decode_slots=1)
    try:
        data_ep = p.enrolled.producer_config().data_endpoint("decode-a")
        ctl_ep = p.enrolled.receiver_config().control_endpoint()
        data = [connect(data_ep, "127.0.0.1", p.receiver.data_port, timeout=10) for _ in range(6)]
        ctl = [connect(ctl_ep, "127.0.0.1", p.producer.control_port, timeout=10) for _ in range(6)]
        assert _wait(lambda: p.receiver.listener.snapshot()["authenticated"] == 6, 5)
        assert _wait(lambda: p.producer.listener.snapshot()["authenticated"] == 6, 5)
        for node in (p.receiver, p.producer):
            t0 = time.monotonic()
            node.stop()
            assert time.monotonic() - t0 < 5.0, f"{type(node).__name__} took {time.monotonic() - t0:.1f} s to stop"
        for chan in data + ctl:  # every peer sees its connection end
            chan.settimeout(5)
            try:
                assert chan.recv(1) == b""
            except Exception:  # noqa: BLE001 - a reset or a TLS close is an end too
                pass
            chan.close()
    finally:
        p.stop()


@pytest.mark.parametrize("role", ["producer", "receiver"])
def test_a_handshake_timeout_past_the_limit_is_a_usage_line_not_an_internal_error(tmp_path, monkeypatch, capsys, role):
    """``--handshake-timeout 1000`` passed the flag's duration check (7 days) and then failed
    Limits' (0, 600] check: 'kvpack: internal: ValueError ... (a bug)', exit 70."""
    from kvpack import cli
    from kvpack.node import common

    enrolled = Enrolled(str(tmp_path / "cluster"), load_engine(ENGINE))

    def never(*_a, **_k):
        raise AssertionError("the engine was loaded")

    monkeypatch.setattr(common, "load_engine", never)
    config = enrolled.producer_config_path() if role == "producer" else enrolled.receiver_config_path()
    code = cli.main([role, "--config", config, "--engine", ENGINE, "--no-store", "--no-metrics", "--handshake-timeout", "1000"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("kvpack: usage: ") and "at most 600 s" in err[0], (code, err)
