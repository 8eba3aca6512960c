"""Unsolicited receive (C.15 without ``producer_control``, errata M8/M9), in process, with a
producer written from PART C alone (tests/node/partc_producer.py) and a real two-class
transformers model (a small seeded Cohere2, f32):

* deferred and declared transfers land in named sessions the local API decodes from,
  bit-identical to uninterrupted local decoding; each is saved to the store as a prefix cut;
* a flipped payload byte, a wrong HMAC key, a replayed generation and an unpinned
  certificate are each refused with their category, nothing installed, the ledger unchanged;
* a connection that sends no begin, or a malformed one, is dropped silently and the node
  keeps serving; a Muse-shaped transfer at this layout is refused as ``layout``;
* a pin refusal reaches the outstanding request with the receiver's category.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import tempfile
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.models import build_cohere2  # noqa: E402
from kvpack.engine.transformers_adapter import TransformersEngine  # noqa: E402
from kvpack.errors import KvpackError  # noqa: E402
from kvpack.node.common import greedy, logits_bytes  # noqa: E402
from kvpack.node.receiver import ReceiverNode, request_local  # noqa: E402
from kvpack.security.config import load_receiver_config  # noqa: E402
from kvpack.store import PackStore  # noqa: E402

from . import partc_producer as pc  # noqa: E402
from .helpers import Enrolled, receipts  # noqa: E402

WINDOW = 300
SMALL = pc.Geometry(nope_layers=(3, 7), swa_layers=(0, 1, 2, 4, 5, 6), window=WINDOW, tile=512, group=2, plane_elements=32, element_type="f32_le")


@pytest.fixture(scope="module")
def engine():
    loaded = build_cohere2(seed=4, num_hidden_layers=8, sliding_window=WINDOW + 1, max_position_embeddings=4096)
    return TransformersEngine(loaded, threads=1, prefill_chunk_tokens=256)


def unsolicited_config(enrolled: Enrolled, receiver: str = "decode-a", wait_ms: int = 2000) -> str:
    """The enrolled receiver config without producer_control (unsolicited mode)."""
    path = enrolled.receiver_config_path(receiver)
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    cfg.pop("producer_control", None)
    cfg["wait_for_producer_ms"] = wait_ms
    out = os.path.join(os.path.dirname(path), "receiver.unsolicited.json")
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=2)
    return out


def producer_tls(enrolled: Enrolled, producer: str = "prefill-a", receiver: str = "decode-a") -> pc.TlsIdentity:
    pdir = os.path.dirname(enrolled.producer_config_path(producer))
    pcfg = enrolled.producer_config("prefill-a")  # the pin of the receiver, as the real producer has it
    r = [x for x in pcfg.receivers if x.name == receiver][0]
    return pc.TlsIdentity(
        os.path.join(pdir, "tls/node.crt"), os.path.join(pdir, "tls/node.key"), os.path.join(pdir, "tls/ca.crt"), r.server_name, sorted(r.leaf_sha256)[0]
    )


class World:
    def __init__(self, engine, tmp):
        self.engine = engine
        self.tmp = tmp
        self.enrolled = Enrolled(os.path.join(tmp, "cluster"), engine, producers=("prefill-a", "prefill-b"))
        self.cfg = load_receiver_config(unsolicited_config(self.enrolled))
        self.sock = os.path.join(tempfile.mkdtemp(prefix="kvu-"), "r.sock")
        self.store = PackStore.init(os.path.join(tmp, "store"))
        self.rdir = os.path.join(tmp, "receipts")
        self.node = ReceiverNode(
            self.cfg, engine, receipts_dir=self.rdir, store=self.store, metrics_port=None, check_volume=False, socket_path=self.sock
        ).start()
        pcfg = self.enrolled.producer_config()
        r = pcfg.receivers[0]
        self.key = pc.load_key(r.hmac_key_file)
        self.key_id, self.epoch = r.hmac_key_id, r.hmac_epoch
        self.tls = producer_tls(self.enrolled)
        self.identity, self.target = self.cfg.identity, self.cfg.target_cache_identity_sha256

    def source(self, prompt):
        s = self.engine.new_session()
        s.prefill(prompt[:-1])
        return s

    def send(self, src, generation, **kw):
        rows = kw.pop("rows", None) or (lambda layer, role, a, b: bytes(src.export_rows(layer, role, a, b)))
        kw.setdefault("geometry", SMALL)
        kw.setdefault("tls", self.tls)
        tls = kw.pop("tls")
        return pc.send_transfer(
            "127.0.0.1",
            self.node.data_port,
            tls,
            key=kw.pop("key", self.key),
            key_id=self.key_id,
            epoch=self.epoch,
            identity=self.identity,
            target=self.target,
            prompt=list(src.tokens),
            rows=rows,
            generation=generation,
            **kw,
        )

    def state(self):
        return (json.dumps(self.node.sessions.names()), json.dumps(self.node.ledger.snapshot(), sort_keys=True))

    def landed(self, transfer_id: str):
        """The outcome of ``transfer_id`` (admitted transfers that were then refused queue
        their outcomes too, and earlier tests leave theirs unread)."""
        deadline = time.monotonic() + 30
        while True:
            out = self.node.landed.get(timeout=max(0.1, deadline - time.monotonic()))
            if out.info.get("transfer_id") == transfer_id:
                return out

    def last_refusal(self):
        return [r for r in receipts(self.rdir) if r["verdict"] == "refused"][-1]


@pytest.fixture(scope="module")
def world(engine, tmp_path_factory):
    w = World(engine, str(tmp_path_factory.mktemp("unsolicited")))
    yield w
    w.node.stop()


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def reference(engine, tokens, n=8):
    s = engine.new_session()
    s.prefill(tokens[:-1])
    s.prefill(tokens[-1:])
    out, rows = greedy(s, n)
    return out, hashlib.sha256(logits_bytes(rows)).hexdigest()


@pytest.mark.parametrize("deferred, length, generation", [(True, 700, 1), (False, 260, 2)], ids=["deferred", "declared"])
def test_transfers_land_in_named_sessions_and_decode_bit_exact(world, deferred, length, generation):
    tokens = prompt(length, seed=length)
    res = world.send(world.source(tokens), generation, deferred=deferred)
    assert res["ack"] is not None, res
    name = res["transfer_id"]
    out = world.landed(name)
    assert out.error is None and out.info["session"] == name and out.info["mode"] == "unsolicited"
    assert out.info["payload_bytes"] == res["payload_bytes"] == world.node.geometry.payload_bytes(length - 1)
    assert out.info["saved"]["prefix_only"] is True and out.info["saved"]["cut"] == length - 1
    assert {"name": name, "position": length - 1} in world.node.sessions.names()
    reply = request_local(world.sock, {"session": name, "tokens": tokens, "max_new_tokens": 8})
    assert reply["ok"], reply
    assert (reply["result"]["tokens"], reply["result"]["logits_sha256"]) == reference(world.engine, tokens)
    # the session continues: a prompt that does not start with its tokens is refused
    bad = request_local(world.sock, {"session": name, "tokens": [5] + tokens, "max_new_tokens": 1})
    assert not bad["ok"] and bad["error"]["reason"] == "identity"


def _other_cert_tls(world):
    return producer_tls(world.enrolled, producer="prefill-b")


@pytest.mark.parametrize(
    "case, reason",
    [
        ("flipped payload byte", "digest"),
        ("wrong hmac key", "authentication"),
        ("replayed generation", "replay"),
        ("unpinned certificate", "pin"),
    ],
)
def test_refusals_install_nothing_and_leave_the_ledger(world, case, reason):
    tokens = prompt(400, seed=77)
    src = world.source(tokens)
    if not world.node.ledger.snapshot():  # a committed generation for the replay case to replay
        sent = world.send(src, 5)
        assert sent["ack"] is not None
        world.landed(sent["transfer_id"])
    before = world.state()
    highest = max(world.node.ledger.snapshot().values())
    kw: dict = {}
    generation = highest + 1
    if case == "flipped payload byte":
        kw["flip_payload_byte"] = (2, 100)
    elif case == "wrong hmac key":
        kw["key"] = bytes(32)
    elif case == "replayed generation":
        generation = highest
    else:
        kw["tls"] = _other_cert_tls(world)
    pins_before = world.node.refusal_log.snapshot()["totals"].get("pin", 0)
    res = world.send(src, generation, **kw)
    assert res["ack"] is None
    deadline = time.monotonic() + 10
    if reason == "pin":
        # refused in the TLS handshake: no receipt (a stranger must not write files), counted
        # in the aggregated refusal log and the metrics by its category
        while world.node.refusal_log.snapshot()["totals"].get("pin", 0) == pins_before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert world.node.refusal_log.snapshot()["totals"].get("pin", 0) == pins_before + 1
    else:
        while world.last_refusal()["reason"] != reason and time.monotonic() < deadline:
            time.sleep(0.05)
        last = world.last_refusal()
        assert last["reason"] == reason, last
        # a begin that was parsed names its transfer and generation
        assert last["transfer_id"] == res["transfer_id"] and last["generation"] == generation
    assert world.state() == before  # no session, no ledger change


def test_no_begin_and_malformed_begin_are_dropped_and_the_node_keeps_serving(world):
    before = world.state()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(world.tls.ca)
    ctx.load_cert_chain(world.tls.cert, world.tls.key)
    ctx.set_alpn_protocols([pc.ALPN])

    def open_chan():
        raw = socket.create_connection(("127.0.0.1", world.node.data_port), timeout=10)
        return ctx.wrap_socket(raw, server_hostname=world.tls.server_name)

    silent = open_chan()  # sends nothing: dropped at the accept deadline (2 s)
    bad = open_chan()
    bad.sendall(pc.frame({"kind": "begin", "manifest": {"protocol": "kvpack-live-handoff-v2", "surprise": 1}}))
    assert bad.recv(1) == b""  # closed without a word (errata M8)
    silent.settimeout(10)
    t0 = time.monotonic()
    assert silent.recv(1) == b""
    assert 1.0 < time.monotonic() - t0 < 8.0
    reasons = [r["reason"] for r in receipts(world.rdir)[-2:]]
    assert sorted(reasons) == ["aborted", "json"] and all(r["phase"] == "begin" for r in receipts(world.rdir)[-2:])
    assert world.state() == before
    tokens = prompt(300, seed=9)
    highest = max(world.node.ledger.snapshot().values(), default=0)
    sent = world.send(world.source(tokens), highest + 1)
    assert sent["ack"] is not None
    world.landed(sent["transfer_id"])


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "declared"])
def test_a_muse_shaped_transfer_at_another_layout_is_a_layout_refusal(world, deferred):
    before = world.state()
    tokens = prompt(100, seed=5)
    src = world.source(tokens)
    zeros = lambda layer, role, a, b: bytes((b - a) * 256 * 2)  # noqa: E731 - Muse f16 planes
    highest = max(world.node.ledger.snapshot().values(), default=0)
    res = world.send(src, highest + 1, geometry=pc.MUSE, rows=zeros, deferred=deferred)
    assert res["ack"] is None
    time.sleep(0.3)
    last = world.last_refusal()
    assert last["reason"] == "layout" and last["phase"] == ("admitted" if deferred else "begin"), last
    assert 'reason="layout"' in world.node.metrics.text()
    assert world.state() == before


def test_a_pin_refusal_reaches_the_request_with_the_receivers_category(engine, tmp_path):
    enrolled = Enrolled(str(tmp_path / "cluster"), engine, producers=("prefill-a", "prefill-b"))
    node = ReceiverNode(enrolled.receiver_config(), engine, receipts_dir=str(tmp_path / "r"), metrics_port=None, check_volume=False).start()
    try:
        pending = node.expect("muser-1-1", prompt(50, 1), wait_s=2.0)
        tls = producer_tls(enrolled, producer="prefill-b")
        pcfg = enrolled.producer_config()
        r = pcfg.receivers[0]
        src = engine.new_session()
        src.prefill(prompt(50, 1)[:-1])
        res = pc.send_transfer(
            "127.0.0.1",
            node.data_port,
            tls,
            key=pc.load_key(r.hmac_key_file),
            key_id=r.hmac_key_id,
            epoch=r.hmac_epoch,
            identity=enrolled.receiver_config().identity,
            target=enrolled.receiver_config().target_cache_identity_sha256,
            prompt=list(src.tokens),
            rows=lambda layer, role, a, b: bytes(src.export_rows(layer, role, a, b)),
            generation=1,
            transfer_id="muser-1-1-1",
            geometry=SMALL,
        )
        assert res["ack"] is None
        with pytest.raises(KvpackError) as err:
            node.wait(pending)
        assert err.value.category == "pin" and "accept deadline" in err.value.message
    finally:
        node.stop()


def test_a_landing_session_is_named_but_locked_until_it_landed():
    # the producer has its ACK before the landing (resident copy, store save) finishes: a
    # request for the session must wait for it instead of decoding under the save
    from kvpack.node.receiver import NamedSessions

    sessions = NamedSessions(2)
    held = sessions.put("t-1", object(), held=True)
    _, lock = sessions.get("t-1")
    assert lock is held and not lock.acquire(blocking=False)
    held.release()
    assert lock.acquire(blocking=False)
    sessions.put("t-2", object())
    sessions.put("t-3", object())
    with pytest.raises(KvpackError):  # beyond the limit the least recently used goes
        sessions.get("t-1")


def test_the_ledger_volume_gate_is_the_operators(engine, tmp_path):
    # kvpack receiver --ledger-max-tail-ms: a gate no volume can pass refuses at bind (before
    # any engine), releasing what it took; a generous one binds the same config
    from kvpack.errors import SecurityError

    enrolled = Enrolled(str(tmp_path / "cluster"), engine, producers=("prefill-a",))
    strict = ReceiverNode(enrolled.receiver_config(), None, receipts_dir=str(tmp_path / "r"), metrics_port=None, ledger_max_tail_ms=1e-6)
    with pytest.raises(SecurityError) as err:
        strict.bind()
    assert err.value.category == "volume" and "limit 1e-06 ms" in err.value.message
    generous = ReceiverNode(enrolled.receiver_config(), None, receipts_dir=str(tmp_path / "r"), metrics_port=None, ledger_max_tail_ms=60_000)
    try:
        assert generous.bind().probe is not None
    finally:
        generous.stop()


def test_a_begin_beyond_the_unsolicited_slots_is_refused_busy_with_its_names(world):
    # two admitted transfers that stall hold both unsolicited slots (each holds a whole
    # detached install); a third begin waits wait_for_producer_ms for a slot, then is refused
    # 'aborted' (busy) naming its transfer id and generation; nothing lands, the ledger is
    # unchanged; once the stalled peers go, the slots serve again
    before = world.state()
    tokens = prompt(300, seed=21)
    highest = max(world.node.ledger.snapshot().values(), default=0)

    def begin(generation: int):
        tid = hashlib.sha256(f"busy-{generation}-{time.time_ns()}".encode()).hexdigest()
        m = pc.begin_manifest(tid, generation, world.identity, world.target, tokens[:-1], world.key_id, world.epoch, None)
        chan = pc.connect("127.0.0.1", world.node.data_port, world.tls)
        chan.sendall(pc.frame({"kind": "begin", "manifest": m}))
        return chan, tid

    stalled = [begin(highest + 1), begin(highest + 2)]
    try:
        time.sleep(0.5)  # both admitted and waiting for segments
        third, tid = begin(highest + 3)
        third.settimeout(15)
        assert third.recv(1) == b""  # dropped without a word after the slot wait (2 s)
        third.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not [r for r in receipts(world.rdir) if r.get("transfer_id") == tid]:
            time.sleep(0.05)
        (refused,) = [r for r in receipts(world.rdir) if r.get("transfer_id") == tid]
        assert refused["reason"] == "aborted" and "busy" in refused["detail"] and refused["generation"] == highest + 3
    finally:
        for chan, _ in stalled:
            chan.close()
    assert world.state() == before
    sent = world.send(world.source(tokens), highest + 4)
    assert sent["ack"] is not None
    world.landed(sent["transfer_id"])
