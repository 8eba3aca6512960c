"""Real subprocess daemons (``kvpack producer`` / ``kvpack receiver``) on loopback.

* SmolLM2: the receiver's greedy decode after a handoff is bit-identical (tokens and every
  logits row) to local uninterrupted decoding with the same computation order; a delta
  handoff's output equals a full handoff's output for the same prompt (equal SHA-256), with
  fewer bytes and fewer tokens prefilled by the producer; metrics served on loopback.
* A producer SIGKILLed mid-stream: refused, nothing installed, the live session unchanged,
  a receipt records it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import pytest

from kvpack.errors import KvpackError
from kvpack.node.common import greedy, load_engine, logits_bytes
from kvpack.node.receiver import ReceiverNode, request_local

from .helpers import Daemon, Enrolled, edit_config, http_get, producer_daemon, receipts


def _socket_path(tmp_path, name):
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp paths can be longer
    import tempfile

    d = tempfile.mkdtemp(prefix="kvn-")
    return os.path.join(d, name)


@pytest.mark.slow
def test_producer_killed_mid_stream_is_refused(tmp_path):
    engine = load_engine("arrays:8:4:64")
    enrolled = Enrolled(str(tmp_path / "cluster"), engine)
    producer = producer_daemon(enrolled, ["--engine", "arrays:8:4:64", "--no-store", "--pacing-bytes-per-s", "8000000"])
    rdir = str(tmp_path / "rreceipts")
    node = ReceiverNode(enrolled.receiver_config(), engine, receipts_dir=rdir, check_volume=False).start()
    try:
        node.generate(list(range(1, 300)), 4)  # paced, but small: a live session to protect
        before = (list(node.session.tokens), node.session.cache_digest())
        errors = []

        def run():
            try:
                node.generate(list(range(3, 2100)), 4)
            except KvpackError as exc:
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while not any(p.admitted and p.prompt[0] == 3 for p in node.router.open()):
            assert time.monotonic() < deadline, "transfer never admitted"
            time.sleep(0.05)
        time.sleep(2.0)  # a few paced 4 MiB segments in (33 MiB in all at 8 MB/s)
        producer.kill()
        t.join(timeout=120)
        assert not t.is_alive()
        assert errors and errors[0].category in ("aborted", "framing", "tls")
        assert (list(node.session.tokens), node.session.cache_digest()) == before
        last = [r for r in receipts(rdir) if r["verdict"] == "refused"][-1]
        assert last["phase"] == "admitted" and last["reason"] in ("aborted", "framing", "tls")
        assert 0 < last["payload_bytes"] < node.geometry.tile_bytes(2098)
        assert node.ledger.snapshot() == {f"{node.config.hmac_key_id}:1": 1}  # only the first transfer
    finally:
        node.stop()
        producer.stop()


DOC = ("The decode node verifies every tile of the key-value cache before it installs anything. " * 24).strip()


@pytest.mark.slow
def test_smollm2_daemons_bit_exact_and_delta_equals_full(tmp_path):
    from kvpack.generate import chat_tokens

    engine = load_engine("smollm2")
    enrolled = Enrolled(str(tmp_path / "cluster"), engine, receivers=("decode-a", "decode-b"))
    sock_a, sock_b = _socket_path(tmp_path, "a.sock"), _socket_path(tmp_path, "b.sock")
    daemons = [producer_daemon(enrolled, ["--store", str(tmp_path / "pstore")])]
    daemons += [
        Daemon(["receiver", "--config", enrolled.receiver_config_path("decode-a"), "--socket", sock_a, "--no-store", "--receipts", str(tmp_path / "ra")]),
        Daemon(["receiver", "--config", enrolled.receiver_config_path("decode-b"), "--socket", sock_b, "--no-store", "--receipts", str(tmp_path / "rb")]),
    ]
    try:
        p1 = chat_tokens(engine, DOC + " What does the decode node verify?")
        p2 = chat_tokens(engine, DOC + " When is the cache installed?")
        assert p1[:300] == p2[:300] and len(p2) > 300
        # local uninterrupted reference for p1: prefill P-1, the boundary token, greedy decode
        s = engine.new_session()
        s.prefill(p1[:-1])
        s.prefill(p1[-1:])
        ref_tokens, ref_rows = greedy(s, 12)
        ref_logits = hashlib.sha256(logits_bytes(ref_rows)).hexdigest()
        for d in daemons:
            d.wait_ready()

        def ask(sock, tokens):
            reply = request_local(sock, {"tokens": tokens, "max_new_tokens": 12, "stop_at_eos": False})
            assert reply["ok"], reply
            return reply["result"]

        a1 = ask(sock_a, p1)
        assert a1["tokens"] == ref_tokens and a1["logits_sha256"] == ref_logits  # bit-exact
        assert a1["plan"]["action"] == "full_transfer"
        full_b = ask(sock_b, p2)  # a full handoff of p2 to a node holding nothing
        delta_a = ask(sock_a, p2)  # a delta of p2 onto decode-a's resident prefix of p1
        tf, td = full_b["transfer"], delta_a["transfer"]
        assert tf["prefix_cut"] == 0 and td["prefix_cut"] == 256 and delta_a["plan"]["tier"] == "resident"
        # the seed's stage-6 witness: equal output SHA-256
        assert delta_a["tokens_sha256"] == full_b["tokens_sha256"] and delta_a["logits_sha256"] == full_b["logits_sha256"]
        assert td["payload_bytes"] < tf["payload_bytes"]
        assert td["producer_receipt"]["prefill_tokens"] == len(p2) - 1 - 256  # compute saved, not only wire
        for t in (tf, td):
            assert [f["type"] for f in t["control_frames"]] == ["request", "accepted", "committed"]
            assert max(f["bytes"] for f in t["control_frames"]) < 16 * len(p2) + 1024 < t["payload_bytes"] / 100
        metrics = http_get(daemons[1].ready["metrics_port"])
        assert 'kvpack_transfers_total{role="receiver",verdict="committed"} 2.0' in metrics
        pr = [r for r in receipts(os.path.join(os.path.dirname(enrolled.producer_config_path()), "receipts")) if r.get("verdict") == "committed"]
        assert len(pr) == 3 and pr[-1]["prefix_cut"] == 256
        print(json.dumps({"full": tf["payload_bytes"], "delta": td["payload_bytes"], "ttft_full": a1["ttft_s"]}))
    finally:
        for d in daemons:
            d.stop()


@pytest.mark.slow
def test_daemons_on_port_zero_report_their_ports_and_serve(tmp_path):
    """``--control-listen 127.0.0.1:0`` / ``--listen 127.0.0.1:0``: each daemon reports the
    port it got in its ready line, and ``--producer-control`` points the receiver at it."""
    spec = "arrays:4:2:32"
    engine = load_engine(spec)
    enrolled = Enrolled(str(tmp_path / "cluster"), engine)
    # the configs name an address no daemon here can bind: only the flags make them start
    edit_config(enrolled.producer_config_path(), lambda obj: obj.__setitem__("control_listen", "192.0.2.1:9"))
    edit_config(enrolled.receiver_config_path(), lambda obj: obj.__setitem__("listen", "192.0.2.1:9"))
    common = ["--engine", spec, "--no-store", "--no-metrics"]
    producer = Daemon(["producer", "--config", enrolled.producer_config_path(), *common, "--control-listen", "127.0.0.1:0"])
    receiver = None
    try:
        control_port = producer.wait_ready()["control_port"]
        assert control_port != 0
        sock = _socket_path(tmp_path, "r.sock")
        cfg = enrolled.receiver_config_path()
        args = ["receiver", "--config", cfg, *common, "--socket", sock, "--listen", "127.0.0.1:0"]
        receiver = Daemon([*args, "--producer-control", f"127.0.0.1:{control_port}"])
        assert receiver.wait_ready()["data_port"] != 0
        reply = request_local(sock, {"tokens": list(range(1, 300)), "max_new_tokens": 2}, timeout=120)
        assert reply["ok"] and reply["result"]["plan"]["action"] == "full_transfer"
        two = Daemon([*args, "--config", enrolled.receiver_config_path(producer="prefill-a"), "--producer-control", "127.0.0.1:1"])
        assert two.proc.wait(60) != 0 and "--producer-control takes exactly one --config" in two.stderr_text()
    finally:
        if receiver is not None:
            receiver.stop()
        producer.stop()
