"""muse-tiny (the seed's Muse cache layout on a real f16 model) through the real daemons.

* ``kvpack producer`` -> ``kvpack receiver``: a full handoff at a position above the
  2,048-row window, then a delta on the resident prefix; decoded tokens and every logits
  row are bit-identical to a local uninterrupted run; the payload equals the upstream Muse
  span-schedule arithmetic, and the TCP bytes are that payload plus framing and TLS only;
* a producer written from PART C alone lands Muse-shaped transfers at an unsolicited
  ``kvpack receiver`` in deferred and declared mode (decoded through ``kvpack request
  --session``); the same producer with one flipped payload byte, a wrong HMAC key, a
  replayed generation and an unpinned certificate is refused each time, with no session
  installed and the ledger file unchanged;
* ``kvpack receive --once --json`` prints the receipt of the one transfer it admitted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpack.engine.registry import load_engine  # noqa: E402
from kvpack.handoff.schedule import muse_schedule_span  # noqa: E402
from kvpack.node.common import greedy, logits_bytes  # noqa: E402
from kvpack.node.receiver import request_local  # noqa: E402

from . import partc_producer as pc  # noqa: E402
from .helpers import Daemon, Enrolled, Proxy, producer_daemon, receipts  # noqa: E402
from .test_unsolicited import producer_tls, unsolicited_config  # noqa: E402

ENGINE = ["--engine", "muse-tiny", "--threads", "1"]
pytestmark = pytest.mark.slow
#: the suite shares a loaded 2-core host: the ledger-volume gate (100 ms worst reservation)
#: is a deployment check, not what these tests are about
LEDGER_GATE = ["--ledger-max-tail-ms", "5000"]


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def reference(engine, prompt, n=8):
    s = engine.new_session()
    s.prefill(prompt[:-1])
    s.prefill(prompt[-1:])
    out, rows = greedy(s, n)
    return out, hashlib.sha256(logits_bytes(rows)).hexdigest()


def schedule_bytes(position: int, cut: int = 0) -> int:
    return sum(s.byte_len for s in muse_schedule_span(position, cut))


def short_socket(name: str) -> str:
    return os.path.join(tempfile.mkdtemp(prefix="kvm-"), name)  # AF_UNIX paths are short


@pytest.fixture(scope="module")
def muse():
    return load_engine("muse-tiny")


@pytest.fixture(scope="module")
def cluster(muse, tmp_path_factory):
    root = tmp_path_factory.mktemp("muse")
    return Enrolled(str(root / "cluster"), muse, receivers=("decode-a", "decode-b", "decode-c"), producers=("prefill-a", "prefill-b")), root


def test_daemons_full_above_the_window_then_delta_bit_exact(muse, cluster):
    enrolled, root = cluster
    sock = short_socket("a.sock")
    # the producer's data connection goes through the proxy; its target is the data port the
    # receiver reports once it is up
    proxy = Proxy(0)
    producer = producer_daemon(enrolled, [*ENGINE, "--no-store"])
    receiver = Daemon(
        [
            "receiver",
            "--config",
            enrolled.receiver_config_path("decode-a"),
            *ENGINE,
            "--socket",
            sock,
            "--no-store",
            "--advertise-port",
            str(proxy.port),
            *LEDGER_GATE,
        ]
    )
    try:
        p1 = tokens(2561, seed=1)  # position 2560: above the window, 256-aligned
        p2 = p1[:2560] + tokens(600, seed=2)  # a delta on p1's prefix; suffix < window
        ref1, ref2 = reference(muse, p1), reference(muse, p2)
        proxy.target_port = receiver.wait_ready()["data_port"]

        def ask(prompt):
            reply = request_local(sock, {"tokens": prompt, "max_new_tokens": 8}, timeout=600)
            assert reply["ok"], reply
            return reply["result"]

        up0 = proxy.up
        a1 = ask(p1)
        assert a1["plan"]["action"] == "full_transfer" and (a1["tokens"], a1["logits_sha256"]) == ref1
        t1 = a1["transfer"]
        assert t1["payload_bytes"] == schedule_bytes(2560) == t1["producer_receipt"]["payload_bytes"]
        wire1 = proxy.up - up0
        assert t1["payload_bytes"] < wire1 < t1["payload_bytes"] * 1.01 + 65536  # frames + TLS records only
        a2 = ask(p2)
        t2 = a2["transfer"]
        assert a2["plan"]["action"] == "arm_delta" and t2["prefix_cut"] == 2560
        assert (a2["tokens"], a2["logits_sha256"]) == ref2
        assert t2["payload_bytes"] == schedule_bytes(len(p2) - 1, 2560) < schedule_bytes(len(p2) - 1)
        assert t2["producer_receipt"]["prefill_tokens"] == len(p2) - 1 - 2560  # the producer reused its prefix
        print(json.dumps({"full": t1["payload_bytes"], "delta": t2["payload_bytes"], "wire_full": wire1}))
    finally:
        receiver.stop()
        producer.stop()
        proxy.close()


class _Unsolicited:
    def __init__(self, enrolled: Enrolled, receiver: str) -> None:
        self.config = unsolicited_config(enrolled, receiver, wait_ms=5000)
        pcfg = enrolled.producer_config()
        r = [x for x in pcfg.receivers if x.name == receiver][0]
        self.key, self.key_id, self.epoch = pc.load_key(r.hmac_key_file), r.hmac_key_id, r.hmac_epoch
        with open(self.config, encoding="utf-8") as fh:
            cfg = json.load(fh)
        self.identity, self.target = cfg["identity"], cfg["target_cache_identity_sha256"]
        self.ledger = os.path.join(os.path.dirname(self.config), cfg["replay_ledger"])
        self.port = 0  # the data port the receiver reports in its ready line
        self.tls = producer_tls(enrolled, receiver=receiver)

    def send(self, src, generation, **kw):
        return pc.send_transfer(
            "127.0.0.1",
            self.port,
            kw.pop("tls", self.tls),
            key=kw.pop("key", self.key),
            key_id=self.key_id,
            epoch=self.epoch,
            identity=self.identity,
            target=self.target,
            prompt=list(src.tokens),
            rows=lambda layer, role, a, b: bytes(src.export_rows(layer, role, a, b)),
            generation=generation,
            **kw,
        )

    def ledger_bytes(self) -> bytes:
        with open(self.ledger, "rb") as fh:
            return fh.read()


def _refusals(metrics_url: str, reason: str) -> float:
    text = urllib.request.urlopen(metrics_url.rstrip("/") + "/metrics", timeout=10).read().decode()
    m = re.search(r'^kvpack_refusals_total\{[^}]*reason="' + reason + r'"[^}]*\} ([0-9.e+]+)$', text, re.M)
    return 0.0 if m is None else float(m.group(1))


def test_partc_producer_lands_at_an_unsolicited_receiver_and_is_refused_when_wrong(muse, cluster):
    enrolled, root = cluster
    u = _Unsolicited(enrolled, "decode-b")
    sock = short_socket("b.sock")
    rdir = str(root / "b-receipts")
    receiver = Daemon(["receiver", "--config", u.config, *ENGINE, "--socket", sock, "--store", str(root / "b-store"), "--receipts", rdir, *LEDGER_GATE])
    try:
        prompts = {True: tokens(700, seed=3), False: tokens(900, seed=4)}
        sources = {}
        for deferred, prompt in prompts.items():
            sources[deferred] = src = muse.new_session()
            src.prefill(prompt[:-1])
        u.port = receiver.wait_ready()["data_port"]
        landed = {}
        for generation, deferred in ((1, True), (2, False)):
            res = u.send(sources[deferred], generation, deferred=deferred)
            assert res["ack"] is not None, res
            landed[deferred] = res["transfer_id"]
        names = {s["name"]: s["position"] for s in request_local(sock, {"op": "sessions"})["result"]["sessions"]}
        assert names == {landed[True]: 699, landed[False]: 899}
        for deferred, prompt in prompts.items():  # decode through the CLI, from the named session
            tf = root / f"prompt-{deferred}.json"
            tf.write_text(json.dumps(prompt))
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "kvpack.cli",
                    "request",
                    "--socket",
                    sock,
                    "--session",
                    landed[deferred],
                    "--tokens-file",
                    str(tf),
                    "--max-new-tokens",
                    "8",
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert out.returncode == 0, out.stderr
            result = json.loads(out.stdout)["result"]
            assert (result["tokens"], result["logits_sha256"]) == reference(muse, prompt)
        committed = [r for r in receipts(rdir) if r["verdict"] == "committed"]
        assert len(committed) == 2 and all(r["mode"] == "unsolicited" and r["saved"]["prefix_only"] for r in committed)
        assert {r["payload_bytes"] for r in committed} == {schedule_bytes(699), schedule_bytes(899)}
        ledger_before = u.ledger_bytes()
        other = producer_tls(enrolled, producer="prefill-b", receiver="decode-b")
        cases = [
            ("digest", {"flip_payload_byte": (5, 12345)}, 3),
            ("authentication", {"key": bytes(range(32))}, 3),
            ("replay", {}, 2),
            ("pin", {"tls": other}, 3),
        ]
        metrics_url = receiver.wait_ready()["metrics_url"]
        for reason, kw, generation in cases:
            res = u.send(sources[True], generation, **kw)
            assert res["ack"] is None, reason
            deadline = time.monotonic() + 20
            if reason == "pin":
                # refused in the TLS handshake: no receipt (a stranger writes no files), the
                # refusal counted by its category in the metrics (and the refusal log)
                while time.monotonic() < deadline and _refusals(metrics_url, "pin") < 1:
                    time.sleep(0.1)
                assert _refusals(metrics_url, "pin") == 1
            else:
                while time.monotonic() < deadline and [r["reason"] for r in receipts(rdir) if r["verdict"] == "refused"][-1:] != [reason]:
                    time.sleep(0.1)
                last = [r for r in receipts(rdir) if r["verdict"] == "refused"][-1]
                assert last["reason"] == reason, last
            assert u.ledger_bytes() == ledger_before
            assert {s["name"] for s in request_local(sock, {"op": "sessions"})["result"]["sessions"]} == set(landed.values())
        assert len([r for r in receipts(rdir) if r["verdict"] == "refused"]) == 3
    finally:
        receiver.stop()


def test_receive_once_prints_the_receipt_of_one_transfer(muse, cluster):
    enrolled, root = cluster
    u = _Unsolicited(enrolled, "decode-c")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpack.cli", "receive", "--once", "--config", u.config, *ENGINE, "--no-store", "--json", "--timeout", "300", *LEDGER_GATE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        ready = None
        while ready is None:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()[-2000:]
            r, _, _ = select.select([proc.stderr], [], [], 0.5)
            if r:
                line = proc.stderr.readline()
                if line.startswith('{"ready"'):
                    ready = json.loads(line)
        u.port = ready["data_port"]
        assert u.port != 0
        src = muse.new_session()
        src.prefill(tokens(600, seed=5)[:-1])
        res = u.send(src, 1)
        assert res["ack"] is not None
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        receipt = json.loads(out)
        assert receipt["verdict"] == "committed" and receipt["transfer_id"] == res["transfer_id"] == receipt["session"]
        assert receipt["payload_bytes"] == schedule_bytes(599) and receipt["mode"] == "unsolicited"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
