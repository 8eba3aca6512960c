"""Node daemons end to end on real loopback sockets and mutual TLS, with the NumPy engine
adapter (the model does not matter for these properties): full and delta handoff, and every
refusal of issue 6 -- tampered wire, replayed transfer (across a receiver restart), stale
generation, identity mismatch, wrong client certificate -- each refused with a receipt,
nothing installed, the live session unchanged. Also: the control channel carries only small
control messages, and metrics are served on loopback."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest

from kvpack.durable import atomic_write
from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.errors import KvpackError, ProtocolError, SecurityError
from kvpack.node.common import greedy, load_engine, logits_bytes
from kvpack.node.producer import ProducerNode
from kvpack.node.receiver import ReceiverNode
from kvpack.security.tls import connect
from kvpack.store import PackStore

from .helpers import Enrolled, Proxy, http_get, receipts

ENGINE = "arrays:4:2:8"


def reference(engine, tokens, n=8):
    """Local uninterrupted decoding with the handoff's computation order."""
    s = engine.new_session()
    s.prefill(tokens[:-1], chunk_size=256)
    s.prefill(tokens[-1:])
    out, rows = greedy(s, n)
    import hashlib

    return out, hashlib.sha256(logits_bytes(rows)).hexdigest()


class Nodes:
    def __init__(self, tmp, *, producer_engine=None, advertised_port=None, control_proxy=False, wire_tap=None, strict_producer=False, tls_fronts=0):
        self.tmp = str(tmp)
        self.tls_fronts = tls_fronts
        self.strict_producer = strict_producer
        self.engine = load_engine(ENGINE)
        self.enrolled = Enrolled(os.path.join(self.tmp, "cluster"), self.engine, producers=("prefill-a", "prefill-b"))
        # a producer of another engine: its config must predate recorded identities, or it refuses to start
        self.pcfg = self.enrolled.producer_config() if producer_engine is None else self.enrolled.producer_config_without_identities()
        self.rdir = os.path.join(self.tmp, "rreceipts")
        self.pdir = os.path.join(self.tmp, "preceipts")
        self.producer_engine = producer_engine or load_engine(ENGINE)
        self.wire_tap = wire_tap
        self.producer = self._producer()
        # the receiver's config names the port the producer bound, or a counting proxy in front of it
        self.control_proxy = Proxy(self.producer.control_port) if control_proxy else None
        self.enrolled.producer_listening("prefill-a", self.producer.control_port if self.control_proxy is None else self.control_proxy.port)
        self.rcfg = self.enrolled.receiver_config()
        self.receiver = self._receiver(advertised_port)

    def _producer(self):
        return ProducerNode(
            self.pcfg,
            self.producer_engine,
            receipts_dir=self.pdir,
            wire_tap=self.wire_tap,
            accept_prefix_cut_extension=not self.strict_producer,
            store=PackStore.open(p) if os.path.exists(os.path.join(p := os.path.join(self.tmp, "pstore"), "store.json")) else PackStore.init(p),
        ).start()

    def _receiver(self, advertised_port=None):
        # the volume probe is not under test here (and flaky on a loaded shared disk)
        return ReceiverNode(
            self.rcfg, self.engine, receipts_dir=self.rdir, advertised_port=advertised_port, check_volume=False, tls_fronts=self.tls_fronts
        ).start()

    def restart_producer(self, before_start=None):
        # the receiver's config names the port this producer bound: the new one binds it again
        port = self.producer.control_port
        self.producer.stop()
        if before_start is not None:
            before_start()
        self.pcfg = dataclasses.replace(self.pcfg, control_listen_port=port)
        self.producer = self._producer()

    def restart_receiver(self):
        self.receiver.stop()
        self.receiver = self._receiver()

    def stop(self):
        self.receiver.stop()
        self.producer.stop()
        if self.control_proxy is not None:
            self.control_proxy.close()

    def snapshot(self):
        s = self.receiver.session
        # (the NumPy adapter cannot digest an empty session; an empty one has nothing to compare)
        return list(s.tokens), s.cache_digest() if s.position else None

    def refused(self):
        return [r for r in receipts(self.rdir) if r["verdict"] == "refused"]


@pytest.fixture
def nodes(tmp_path):
    made = []

    def make(**kw):
        n = Nodes(tmp_path / f"n{len(made)}", **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.stop()


PROMPT = list(range(1, 700))
FOLLOW = PROMPT[:600] + [11, 12, 13, 14, 15]


def test_full_then_delta_handoff_bit_exact_with_receipts_and_metrics(nodes):
    n = nodes()
    r1 = n.receiver.generate(PROMPT, 8)
    assert (r1["tokens"], r1["logits_sha256"]) == reference(n.engine, PROMPT)
    t1 = r1["transfer"]
    assert r1["plan"]["action"] == "full_transfer" and t1["prefix_cut"] == 0
    assert t1["payload_bytes"] == n.receiver.geometry.tile_bytes(len(PROMPT) - 1)
    assert t1["producer_receipt"]["prefill_tokens"] == len(PROMPT) - 1
    r2 = n.receiver.generate(FOLLOW, 8)
    t2 = r2["transfer"]
    assert r2["plan"] == {**r2["plan"], "action": "arm_delta", "tier": "resident", "prefix_cut": 512}
    assert t2["prefix_cut"] == 512 and t2["payload_bytes"] == n.receiver.geometry.tile_bytes(len(FOLLOW) - 1 - 512)
    # the producer installed the prefix it computed before and prefilled only the suffix
    assert t2["producer_receipt"]["prefill_tokens"] == len(FOLLOW) - 1 - 512
    assert (r2["tokens"], r2["logits_sha256"]) == reference(n.engine, FOLLOW)
    committed = [r for r in receipts(n.rdir) if r["verdict"] == "committed"]
    assert len(committed) == 2 and committed[1]["prefix_cut"] == 512
    assert set(committed[0]["durations_s"]) >= {"wire", "verify", "prepare", "reserve", "commit"}
    # the arrays install hands out its rows: every segment was read straight into them
    assert all(r["segments_in_place"] == r["segments"] > 0 for r in committed)
    # phases are stamped in order: the seal's arrival precedes its checks, reserve and commit
    assert all(v >= 0 for r in committed for v in r["durations_s"].values()), [r["durations_s"] for r in committed]
    assert committed[0]["digests"]["begin_sha256"] and committed[0]["payload_bytes"] == t1["payload_bytes"]
    pres = [r for r in receipts(n.pdir) if r.get("verdict") == "committed"]
    assert [r["prefilled_tokens"] for r in pres] == [len(PROMPT) - 1, len(FOLLOW) - 1 - 512]
    text = http_get(n.receiver.metrics.port)
    assert 'kvpack_transfers_total{role="receiver",verdict="committed"} 2.0' in text
    assert 'kvpack_ledger_reservations_total{result="ok",role="receiver"} 2.0' in text
    assert "kvpack_phase_seconds_bucket" in text
    assert 'kvpack_prefilled_tokens_total{role="producer"}' in http_get(n.producer.metrics.port)


def test_delta_request_refused_by_a_strict_producer_falls_back_to_full(nodes):
    """An upstream-style producer (request V1 denies unknown fields) refuses the delta
    extension before accepting; the receiver then serves the prompt with a full transfer."""
    n = nodes(strict_producer=True)
    n.receiver.generate(PROMPT, 8)
    r2 = n.receiver.generate(FOLLOW, 8)
    assert "delta_fallback" in r2 and "producer answered failed" in r2["delta_fallback"]
    assert r2["plan"]["action"] == "full_transfer" and r2["transfer"]["prefix_cut"] == 0
    assert r2["transfer"]["payload_bytes"] == n.receiver.geometry.tile_bytes(len(FOLLOW) - 1)
    assert (r2["tokens"], r2["logits_sha256"]) == reference(n.engine, FOLLOW)
    refusals = [r for r in receipts(n.pdir) if r.get("verdict") == "refused"]
    assert refusals and refusals[-1]["phase"] == "request"


def test_control_channel_carries_no_cache_bytes(nodes, tmp_path):
    # The producer really listens on a port of its own; the configured control address is a
    # counting proxy in front of it.
    n = nodes(control_proxy=True)
    proxy = n.control_proxy
    res = n.receiver.generate(PROMPT, 4)
    t = res["transfer"]
    assert proxy.connections == 1
    frames = t["control_frames"]
    assert [f["type"] for f in frames] == ["request", "accepted", "committed"]
    request_json = len(json.dumps(PROMPT))
    assert frames[0]["bytes"] < request_json + 512
    assert all(f["bytes"] < 1024 for f in frames[1:])
    # every byte of the control connection, TLS handshake and records included, is a tiny
    # fraction of the cache, which crossed the data connection
    assert proxy.up + proxy.down < request_json + 16_384
    assert t["payload_bytes"] > 20 * (proxy.up + proxy.down)
    pr = [r for r in receipts(n.pdir) if r.get("verdict") == "committed"][0]
    assert [f["type"] for f in pr["control_frames"]] == ["request", "accepted", "committed"]


def test_segment_corrupted_on_the_wire_is_refused(nodes):
    n = nodes()
    n.receiver.generate(PROMPT[:300], 4)  # a live session to keep intact
    before = n.snapshot()
    ledger = n.receiver.ledger.snapshot()
    proxy = Proxy(n.receiver.data_port, flip_at=150_000)  # inside a tile, mid-stream
    n.receiver._advertised_port = proxy.port
    try:
        with pytest.raises(KvpackError) as info:
            n.receiver.generate(list(range(2, 1000)), 4)
    finally:
        proxy.close()
    assert proxy.flipped
    assert info.value.category in ("tls", "digest", "aborted")
    assert n.snapshot() == before  # nothing installed
    assert n.receiver.ledger.snapshot() == ledger  # nothing reserved
    ref = n.refused()
    assert ref and ref[-1]["phase"] == "admitted" and ref[-1]["reason"] in ("tls", "digest")
    assert ref[-1]["payload_bytes"] < 999 * n.receiver.geometry.tile_bytes(1)


def test_replayed_transfer_is_refused_even_after_a_receiver_restart(nodes):
    captured = bytearray()
    n = nodes(wire_tap=captured.extend)
    res = n.receiver.generate(PROMPT, 4)
    rid = res["transfer"]["request_id"]
    captured = bytes(captured)
    assert captured.startswith(b"KVPKV2\0\0") and len(captured) > res["transfer"]["payload_bytes"]
    before = n.snapshot()
    ep = n.pcfg.data_endpoint("decode-a")

    def replay(request_id):
        pending = n.receiver.expect(request_id, PROMPT, wait_s=3.0)
        ch = connect(ep, "127.0.0.1", n.receiver.data_port)
        try:
            ch.sendall(captured)
            ch.settimeout(10)
            assert ch.recv(4096) == b""  # dropped, never acked
        except (OSError, KvpackError):
            pass
        finally:
            ch.close()
        with pytest.raises(ProtocolError) as info:
            n.receiver.wait(pending)
        return info.value

    # 1. during a later request: the begin names another request (C.8 step 1)
    err = replay("muser-1-99")
    assert err.category == "identity"
    assert n.snapshot() == before
    # 2. after a restart, even under the very same request id: the durable ledger refuses
    n.restart_receiver()
    live_before = n.snapshot()
    err = replay(rid)
    assert err.category == "replay"
    assert n.snapshot() == live_before
    reasons = [r["reason"] for r in n.refused()]
    assert reasons[-2:] == ["identity", "replay"]


def test_stale_generation_is_refused(nodes):
    n = nodes()
    n.receiver.generate(PROMPT, 4)
    n.receiver.generate(PROMPT[:400] + [3, 4], 4)
    before = n.snapshot()
    # roll the producer's generation ledger back (an operator restoring an old copy)
    n.restart_producer(before_start=lambda: atomic_write(n.pcfg.generation_ledger, b'{"next_generation": 2}\n', mode=0o600))
    with pytest.raises(ProtocolError) as info:
        n.receiver.generate(list(range(5, 600)), 4)
    assert info.value.category == "replay"
    assert n.snapshot() == before
    last = n.refused()[-1]
    assert last["reason"] == "replay" and last["phase"] == "begin" and "generation 2" in last["detail"], last


def test_identity_mismatch_is_refused(nodes):
    other = ArrayEngine(array_layout(layers=4, kv_heads=2, head_dim=8, dtype="f32"), name="another-model")
    n = nodes(producer_engine=other)
    before = n.snapshot()
    with pytest.raises(ProtocolError) as info:
        n.receiver.generate(PROMPT, 4)
    assert info.value.category == "identity"
    assert n.snapshot() == before
    last = n.refused()[-1]
    assert last["reason"] == "identity" and last["phase"] == "begin" and last["segments"] == 0
    assert n.receiver.ledger.snapshot() == {}


def test_a_producer_with_another_engine_than_its_receivers_admit_refuses_to_start(tmp_path):
    """The producer checks its loaded engine against the identity each receiver of its config
    was enrolled to admit, before it serves. Before, it started, took generations and
    prefilled every request, and every begin was refused ``identity`` at the receiver."""
    from kvpack.node.producer import GenerationLedger

    engine = load_engine(ENGINE)
    enrolled = Enrolled(str(tmp_path / "cluster"), engine)
    cfg = enrolled.producer_config()
    assert all(r.identity is not None and r.target_cache_identity_sha256 for r in cfg.receivers)
    for other in (
        ArrayEngine(array_layout(layers=4, kv_heads=2, head_dim=8, dtype="f32"), name="another-model"),  # another model
        load_engine("arrays:4:2:16"),  # another geometry: another target cache identity too
    ):
        node = ProducerNode(cfg, other, receipts_dir=str(tmp_path / "p"), metrics_port=None)
        with pytest.raises(SecurityError) as info:
            node.start()
        assert info.value.category == "config" and "receiver 'decode-a' admits" in info.value.message, info.value
        assert node.listener is None  # never served
        node.stop()
    ledger = GenerationLedger(cfg.generation_ledger)  # the lock released; no generation taken
    assert ledger.next == 1
    ledger.close()
    ok = ProducerNode(cfg, engine, receipts_dir=str(tmp_path / "p"), metrics_port=None).start()  # the right engine starts
    ok.stop()


def test_a_producer_config_without_identities_starts_and_says_it_is_not_checked(tmp_path, caplog):
    """A producer.json from before enrollment recorded identities still starts (with any
    engine: the receiver's own check remains), and says once that it did not check."""
    import logging

    enrolled = Enrolled(str(tmp_path / "cluster"), load_engine(ENGINE))
    cfg = enrolled.producer_config_without_identities()
    other = load_engine("arrays:4:2:16")
    with caplog.at_level(logging.WARNING, logger="kvpack.node.producer"):
        node = ProducerNode(cfg, other, receipts_dir=str(tmp_path / "p"), metrics_port=None).start()
    node.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvpack.node.producer"]
    assert len(lines) == 1 and "decode-a have no recorded identity" in lines[0], lines


def test_wrong_client_certificate_is_refused(nodes, tmp_path):
    n = nodes()
    n.receiver.generate(PROMPT[:300], 4)
    before = n.snapshot()
    # a producer of the same CA that this receiver never paired with (not pinned)
    other_ep = n.enrolled.producer_config("prefill-b").data_endpoint("decode-a")
    pending = n.receiver.expect("muser-5-5", PROMPT, wait_s=2.0)
    receipts_before = len(receipts(n.rdir))
    with pytest.raises(SecurityError):
        ch = connect(other_ep, "127.0.0.1", n.receiver.data_port)
        ch.recv(1)
    # a producer of a foreign cluster (another CA)
    foreign = Enrolled(str(tmp_path / "foreign"), n.engine)
    with pytest.raises(SecurityError):
        ch = connect(foreign.producer_config().data_endpoint("decode-a"), "127.0.0.1", n.receiver.data_port)
        ch.recv(1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not {"pin", "certificate"} <= set(n.receiver.listener.snapshot()["refusals"]):
        time.sleep(0.05)
    # refused before authentication: counted and logged in aggregate, never a receipt each
    assert {"pin", "certificate"} <= set(n.receiver.listener.snapshot()["refusals"])
    assert len(receipts(n.rdir)) == receipts_before
    # ... and the waiting request reports the receiver's own category, not a timeout
    with pytest.raises(SecurityError) as info:
        n.receiver.wait(pending)
    assert info.value.category in ("pin", "certificate")
    assert n.snapshot() == before


def test_a_request_right_after_a_commit_waits_for_the_prefix_being_remembered(nodes, monkeypatch):
    """The producer remembers a job's prefix after its answer went out; a request that
    arrives meanwhile waits for it (bounded) instead of recomputing the whole prefix."""
    real = ProducerNode._remember

    def slow_remember(self, receipt, job):
        time.sleep(1.5)  # a large prefix being copied into the resident tier
        real(self, receipt, job)

    monkeypatch.setattr(ProducerNode, "_remember", slow_remember)
    n = nodes()
    n.receiver.generate(PROMPT, 2)
    r2 = n.receiver.generate(FOLLOW, 2)
    assert r2["transfer"]["producer_receipt"]["prefill_tokens"] == len(FOLLOW) - 1 - 512
    # the arrays install hands out its rows: no payload buffer was ever needed
    assert n.receiver.payload_buffers.idle_bytes == 0


def test_staged_segments_scatter_bit_exact_and_reuse_their_buffers(nodes):
    """The path of installs that cannot hand out rows (staging buffer, scatter on the
    install pool), forced on the arrays engine."""
    n = nodes()
    n.receiver.receive_in_place = False
    r1 = n.receiver.generate(PROMPT, 8)
    assert (r1["tokens"], r1["logits_sha256"]) == reference(n.engine, PROMPT)
    r2 = n.receiver.generate(FOLLOW, 8)
    assert (r2["tokens"], r2["logits_sha256"]) == reference(n.engine, FOLLOW)
    committed = [r for r in receipts(n.rdir) if r["verdict"] == "committed"]
    assert [r["segments_in_place"] for r in committed] == [0, 0] and all(r["segments"] > 0 for r in committed)
    # committed transfers hand their payload buffers to the next ones (kept within a budget)
    assert 0 < n.receiver.payload_buffers.idle_bytes <= n.receiver.payload_buffers.max_bytes
