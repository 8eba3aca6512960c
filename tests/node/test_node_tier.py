"""The production node tier (issue 14) on real loopback sockets and mutual TLS, arrays engine:

* 8 concurrent sessions on one decode node each decode bit-identically to their local runs;
* striped handoffs (2 and 4 stripes) decode bit-identically; a stripe refused mid-stream
  aborts every stripe with nothing installed; a strict upstream producer gets one stream;
* several enrolled producers served by one decode node, one process, one port;
* with 32 idle and 8 trickling connections held on the data and the control port, 20
  legitimate requests all succeed;
* a request whose client goes away frees its decode slot within 1 s (during the transfer
  and during decoding), and the producer's job is cancelled;
* the local API socket of a live node is never taken over or removed by a second node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import tempfile
import threading
import time

import pytest

from kvpack.errors import KvpackError, ProtocolError, SecurityError
from kvpack.node.common import greedy, load_engine, logits_bytes
from kvpack.node.local_api import ApiLimits, request_local
from kvpack.node.producer import ProducerNode
from kvpack.node.receiver import ReceiverNode
from kvpack.node.transport import Limits

from .helpers import Enrolled, Proxy, receipts

ENGINE = "arrays:4:2:8"


def reference(engine, tokens, n=6):
    s = engine.new_session()
    s.prefill(tokens[:-1], chunk_size=256)
    s.prefill(tokens[-1:])
    out, rows = greedy(s, n)
    return out, hashlib.sha256(logits_bytes(rows)).hexdigest()


def _sock_path(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix="kvt-"), name)


class Tier:
    """One decode node (``slots`` decode slots, local API) and its producers."""

    def __init__(self, root, *, producers=("prefill-a",), slots=8, strict=(), pacing=None, api_limits=None, stripes=1, tls_fronts=0):
        self.root = str(root)
        self.engine = load_engine(ENGINE)
        self.enrolled = Enrolled(os.path.join(self.root, "cluster"), self.engine, producers=producers)
        self.pnodes = {}
        for name in producers:
            self.pnodes[name] = ProducerNode(
                self.enrolled.producer_config(name),
                load_engine(ENGINE),
                receipts_dir=os.path.join(self.root, f"p-{name}"),
                accept_prefix_cut_extension=name not in strict,
                pacing_bytes_per_s=pacing,
                max_stripes=8,
                metrics_port=None,
            ).start()
            self.enrolled.producer_listening(name, self.pnodes[name].control_port)
        self.rcfgs = [self.enrolled.receiver_config("decode-a", name) for name in producers]
        self.rdir = os.path.join(self.root, "r")
        self.socket = _sock_path("r.sock")
        self.receiver = ReceiverNode(
            self.rcfgs,
            self.engine,
            receipts_dir=self.rdir,
            check_volume=False,
            socket_path=self.socket,
            decode_slots=slots,
            stripes=stripes,
            metrics_port=None,
            api_limits=api_limits,
            tls_fronts=tls_fronts,
        ).start()

    def stop(self):
        self.receiver.stop()
        for p in self.pnodes.values():
            p.stop()

    def sessions(self):
        return [(list(s.session.tokens), s.session.cache_digest() if s.session.position else None) for s in self.receiver.slots.slots]


@pytest.fixture
def tier(tmp_path):
    made = []

    def make(**kw):
        t = Tier(tmp_path / f"t{len(made)}", **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.stop()


def _prompt(i: int, n: int = 600) -> list[int]:
    return [(7 * i + 13 * k) % 60 + 1 for k in range(n)]


@pytest.mark.parametrize("fronts", [0, 2])
def test_eight_concurrent_sessions_decode_bit_identically(tier, fronts):
    t = tier(slots=8, tls_fronts=fronts)
    prompts = [_prompt(i, 300 + 97 * i) for i in range(8)]
    results: dict = {}
    errors: list = []

    def run(i):
        try:
            results[i] = request_local(t.socket, {"tokens": prompts[i], "max_new_tokens": 6})
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors
    for i in range(8):
        res = results[i]["result"]
        assert (res["tokens"], res["logits_sha256"]) == reference(t.engine, prompts[i]), i
        assert res["plan"]["action"] == "full_transfer"
    # every request had a slot of its own at some point: all 8 sessions hold a prompt
    assert len({tuple(s[0][:5]) for s in t.sessions()}) == 8
    assert not fronts or t.receiver.listener.snapshot()["tls_fronts"]["relayed_total"] == 8


@pytest.mark.parametrize("stripes,fronts", [(2, 0), (4, 0), (4, 2)])
def test_striped_handoff_is_bit_identical_and_commits_once(tier, stripes, fronts):
    t = tier(slots=1, tls_fronts=fronts)
    assert (t.receiver.listener.snapshot()["tls_fronts"] or {}).get("live") == (fronts or None)
    prompt = _prompt(3, 1900)
    res = t.receiver.generate(prompt, 6, stripes=stripes)
    assert (res["tokens"], res["logits_sha256"]) == reference(t.engine, prompt)
    tr = res["transfer"]
    assert tr["stripes"] == stripes and len(set(tr["transfer_ids"])) == stripes
    assert tr["payload_bytes"] == t.receiver.geometry.tile_bytes(len(prompt) - 1)
    committed = [r for r in receipts(t.rdir) if r["verdict"] == "committed"]
    assert sorted(r["stripe"][0] for r in committed) == list(range(stripes))
    # each stripe its own sealed, reserved generation
    key = f"{t.rcfgs[0].hmac_key_id}:1"
    assert t.receiver.ledger.snapshot()[key] == max(tr["generations"])
    # the delta that follows is striped too, over the producer's resident prefix
    follow = prompt[:1024] + [9, 8, 7, 6]
    res2 = t.receiver.generate(follow, 6, stripes=stripes)
    assert (res2["tokens"], res2["logits_sha256"]) == reference(t.engine, follow)
    if fronts:  # every stripe of both transfers was decrypted by a front process
        assert t.receiver.listener.snapshot()["tls_fronts"]["relayed_total"] == stripes + res2["transfer"]["stripes"]


@pytest.mark.parametrize("fronts", [0, 2])
def test_a_stripe_refused_mid_stream_aborts_all_with_nothing_installed(tier, fronts):
    t = tier(slots=1, tls_fronts=fronts)
    t.receiver.generate(_prompt(1, 300), 4)  # a live session to keep intact
    before = t.sessions()
    proxy = Proxy(t.receiver.data_port, flip_at=300_000)  # inside the first stripe's tiles
    t.receiver._advertised_port = proxy.port
    try:
        with pytest.raises(KvpackError) as info:
            t.receiver.generate(_prompt(2, 2000), 4, stripes=4)
    finally:
        proxy.close()
    assert proxy.flipped
    assert info.value.category in ("digest", "sink", "aborted", "tls")
    if fronts:
        assert t.receiver.listener.snapshot()["tls_fronts"]["relayed_total"] >= 4
    assert t.sessions() == before  # nothing installed
    refused = [r for r in receipts(t.rdir) if r["verdict"] == "refused"]
    assert any(r["reason"] in ("digest", "tls") for r in refused)
    assert not [r for r in receipts(t.rdir) if r["verdict"] == "committed" and r.get("stripe", [0, 1])[1] == 4]


def test_strict_upstream_producer_gets_one_stream(tier):
    t = tier(slots=1, strict=("prefill-a",))
    prompt = _prompt(4, 900)
    res = t.receiver.generate(prompt, 6, stripes=4)
    assert (res["tokens"], res["logits_sha256"]) == reference(t.engine, prompt)
    assert res["transfer"]["stripes"] == 1 and "extension_fallback" in res
    pres = [r for r in receipts(os.path.join(t.root, "p-prefill-a")) if r.get("verdict") == "refused"]
    assert pres and pres[0]["reason"] == "json"  # the extension key refused before "accepted"


def test_one_decode_node_serves_several_producers_on_one_port(tier):
    t = tier(slots=2, producers=("prefill-a", "prefill-b"))
    assert [lk.name for lk in t.receiver.links] == ["prefill-a", "prefill-b"]
    for name in ("prefill-a", "prefill-b"):
        prompt = _prompt(len(name) + (name == "prefill-b") * 5, 700)
        res = t.receiver.generate(prompt, 6, producer=name)
        assert (res["tokens"], res["logits_sha256"]) == reference(t.engine, prompt)
        assert res["transfer"]["producer"] == name
    # each producer's generations went to its own replay ledger
    for link in t.receiver.links:
        assert link.ledger.snapshot() == {f"{link.config.hmac_key_id}:1": 1}


def test_configs_of_one_node_must_agree(tier, tmp_path):
    t = tier(slots=1, producers=("prefill-a", "prefill-b"))
    a, b = t.rcfgs
    with pytest.raises(SecurityError) as info:
        ReceiverNode([a, dataclasses.replace(b, listen_port=a.listen_port + 1)], t.engine, receipts_dir=str(tmp_path / "x"))
    assert info.value.category == "config"
    with pytest.raises(SecurityError):
        ReceiverNode([a, dataclasses.replace(b, replay_ledger=a.replay_ledger)], t.engine, receipts_dir=str(tmp_path / "y"))


def _hold(port: int, idle: int, trickling: int, stop: threading.Event) -> list:
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]

    def trickle():
        s = socket.create_connection(("127.0.0.1", port))
        held.append(s)
        try:
            while not stop.is_set():
                s.sendall(b"\x16")
                time.sleep(0.5)
        except OSError:
            return

    for _ in range(trickling):
        threading.Thread(target=trickle, daemon=True).start()
    return held


@pytest.mark.parametrize("fronts", [0, 2])
def test_idle_and_trickling_connections_on_each_port_do_not_stop_requests(tier, fronts):
    t = tier(slots=4, tls_fronts=fronts)
    # the handshake deadline is what frees a held slot; the nodes keep the default 5 s
    stop = threading.Event()
    held = []
    try:
        for port in (t.receiver.data_port, t.pnodes["prefill-a"].control_port):
            held += _hold(port, 32, 8, stop)
        time.sleep(0.5)
        assert t.receiver.listener.snapshot()["handshakes"] >= 32
        ok = 0
        for i in range(20):
            reply = request_local(t.socket, {"tokens": _prompt(50 + i, 300), "max_new_tokens": 2})
            ok += bool(reply.get("ok"))
        assert ok == 20
    finally:
        stop.set()
        for s in held:
            s.close()


def _wait(cond, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _send_and_hang_up(path: str, payload: dict, wait: float) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(json.dumps(payload).encode() + b"\n")
    time.sleep(wait)
    s.close()


def test_cancelled_request_frees_its_slot_within_a_second_during_the_transfer(tier):
    # a slow producer (paced: the payload takes several seconds, far longer than the 2 s
    # before the hang-up even on a loaded machine) so the transfer is in flight when the
    # client leaves
    t = tier(slots=1, pacing=100_000)
    before = t.sessions()
    th = threading.Thread(target=_send_and_hang_up, args=(t.socket, {"tokens": _prompt(9, 1500), "max_new_tokens": 4}, 2.0))
    th.start()
    assert _wait(lambda: t.receiver.slots.busy() == 1, 10)
    th.join()
    t_closed = time.monotonic()
    assert _wait(lambda: t.receiver.slots.busy() == 0, 5)
    assert time.monotonic() - t_closed < 1.0
    assert t.sessions() == before  # the transfer was aborted: nothing installed
    # the producer saw the receiver go away and cancelled its job
    pdir = os.path.join(t.root, "p-prefill-a")
    assert _wait(lambda: any(r.get("verdict") == "failed" for r in receipts(pdir)), 10)
    # and the node serves the next request at once
    reply = request_local(t.socket, {"tokens": _prompt(10, 300), "max_new_tokens": 2})
    assert reply["ok"]


def test_cancelled_request_frees_its_slot_within_a_second_during_decoding(tier):
    t = tier(slots=1, api_limits=ApiLimits(max_new_tokens=60_000))
    payload = {"tokens": _prompt(11, 300), "max_new_tokens": 60_000, "stop_at_eos": False}
    th = threading.Thread(target=_send_and_hang_up, args=(t.socket, payload, 1.5))
    th.start()
    th.join()
    t_closed = time.monotonic()
    assert _wait(lambda: t.receiver.slots.busy() == 0, 5)
    assert time.monotonic() - t_closed < 1.0
    assert t.receiver.session.position < 300 + 60_000  # stopped early


def test_request_caps_are_refused_clearly(tier):
    t = tier(slots=1, api_limits=ApiLimits(max_new_tokens=64, max_request_bytes=1 << 16))
    reply = request_local(t.socket, {"tokens": [1, 2, 3], "max_new_tokens": 65})
    assert reply["ok"] is False and reply["error"]["reason"] == "usage" and "64" in reply["error"]["detail"]
    big = {"tokens": list(range(1, 20_000)), "max_new_tokens": 1}
    reply = request_local(t.socket, big)
    assert reply["ok"] is False and reply["error"]["reason"] == "usage" and "longer than" in reply["error"]["detail"]
    reply = request_local(t.socket, {"tokens": [1, 2, 3], "max_new_tokens": 1, "bogus": 1})
    assert reply["ok"] is False and reply["error"]["reason"] == "usage"


def test_api_socket_of_a_live_node_is_never_taken_over(tier, tmp_path):
    t = tier(slots=1)
    with pytest.raises(SecurityError) as info:
        ReceiverNode(t.rcfgs[0], t.engine, receipts_dir=str(tmp_path / "second"), socket_path=t.socket, check_volume=False, metrics_port=None).bind()
    assert info.value.category == "locked"
    # the live node's socket is still there and still serves
    assert request_local(t.socket, {"tokens": _prompt(12, 300), "max_new_tokens": 1})["ok"]


def test_a_stale_api_socket_is_replaced(tmp_path):
    path = _sock_path("stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()  # the file stays, nothing listens: a crashed node's leftover
    from kvpack.node.local_api import ApiSocket

    api = ApiSocket(path)
    try:
        assert os.path.exists(path) and api.sock is not None
    finally:
        api.close()
    assert not os.path.exists(path)


@pytest.mark.parametrize("kind", ["file", "directory", "symlink", "fifo"])
def test_something_else_at_the_api_socket_path_is_refused_never_deleted(kind):
    """Only a stale *socket* is replaced. A mistyped ``--socket`` naming the operator's file
    (a config, notes) used to be deleted: nothing listened on it, so it counted as stale,
    was unlinked and a socket bound in its place; a directory was an untyped traceback."""
    from kvpack.errors import UsageError
    from kvpack.node.local_api import ApiSocket

    path = _sock_path("thing")
    target = path + ".target"
    with open(target, "w") as fh:
        fh.write("precious\n")
    if kind == "file":
        os.replace(target, path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "symlink":
        os.symlink(target, path)
    else:
        os.mkfifo(path)
    before = os.lstat(path)
    with pytest.raises(UsageError) as info:
        ApiSocket(path)
    assert info.value.category == "file" and "not a socket" in info.value.message, info.value
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)  # untouched
    if kind in ("file", "symlink"):
        with open(path) as fh:
            assert fh.read() == "precious\n"
    (os.rmdir if kind == "directory" else os.unlink)(path)
    api = ApiSocket(path)  # the refusal left no lock behind
    api.close()


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Limits(max_connections=0)
    with pytest.raises(ProtocolError):
        raise ProtocolError("aborted", "x")
