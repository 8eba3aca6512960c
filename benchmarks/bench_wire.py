"""Sealed Handoff V2 over mutual TLS on loopback vs a raw TLS 1.3 stream, and the decode
node's non-wire overhead.

Part 1 (rate), for each size in ``--sizes-mib`` (default 64, 256, 1024), in one run and
with the same enrolled certificates, contexts and socket options:

* ``raw``: a TLS 1.3 mTLS stream (data ALPN, pinned leaves) of the payload bytes, read with
  ``recv_into`` into a 64 MiB ring and copied once (what a sink must do anyway);
* ``sealed``: the same bytes as a deferred-mode Handoff V2 transfer (256-row tiles of the
  SmolLM2 geometry, 11.8 MB each): the sender hashes and frames every tile, the receiver
  state machine checks every frame, SHA-256 per segment and running, the schedule witness,
  seal + HMAC, and copies each payload into the same ring.

``ratio`` = sealed payload rate / raw rate (goal >= 0.9).

Part 2 (receiver overhead): a real :class:`~kvpack.node.receiver.ReceiverNode` with the
SmolLM2 engine receives a 189 MB (4,101-token) sealed transfer into a detached engine
install; its receipt splits verify (seal digests + HMAC + completeness), prepare, reserve
(durable ledger write) and commit (atomic swap into the live session). Goal: the four sum
to <= 0.1 s. ``--engine arrays:30:3:64`` gives the same geometry without loading the model.

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kvpack.handoff.control import MAX_PROMPT_TOKENS  # noqa: F401 - import check only
from kvpack.handoff.manifest import PROTOCOL, BeginManifestV2, ComponentV2, HmacRef
from kvpack.handoff.receiver import Receiver, ReceiverConfig
from kvpack.handoff.schedule import schedule_span
from kvpack.handoff.sender import Sender
from kvpack.node.common import load_engine
from kvpack.node.wire import span_layout, wire_identity
from kvpack.security.config import load_producer_config, load_receiver_config
from kvpack.security.enroll import Cluster
from kvpack.node.wire import identity_file_json
from kvpack.security.tls import accept, client_context, connect, listen, server_context

#: The hashing pool this benchmark passes to the handoff core (which starts no threads itself).
HASH_POOL = ThreadPoolExecutor(4, thread_name_prefix="bench-hash")

RING = 64 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cluster(root: str, engine):
    c = Cluster.init(root, identity=identity_file_json(engine))
    c.enroll_node("decode-a", "receiver", listen=f"127.0.0.1:{free_port()}")
    c.enroll_node("prefill-a", "producer", control_listen=f"127.0.0.1:{free_port()}")
    return load_receiver_config(c.receiver_config_path("decode-a", "prefill-a")), load_producer_config(c.producer_config_path("prefill-a"))


class RingSink:
    """Copies each verified payload into a bounded ring (a stand-in for install planes)."""

    def __init__(self) -> None:
        self.ring = bytearray(RING)
        self.pos = 0

    def begin(self, manifest, cut) -> None:
        pass

    def write_segment(self, d, payload) -> None:
        n = payload.nbytes
        if self.pos + n > RING:
            self.pos = 0
        self.ring[self.pos : self.pos + n] = payload
        self.pos += n

    def prepare(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


class NoLedger:
    def admit(self, *a) -> None:
        pass

    def reserve(self, *a) -> None:
        pass


def manifest_for(engine, position: int, key_id: str, epoch: int, gen: int, prefix="bench") -> BeginManifestV2:
    exact, target = wire_identity(engine)
    now = time.time_ns() // 1_000_000
    return BeginManifestV2(
        PROTOCOL,
        f"{prefix}-{gen}",
        gen,
        now,
        now + 900_000,
        exact,
        tuple(range(position)),
        None,
        HmacRef(key_id, epoch),
        (ComponentV2("target", "target_kv", True, target),),
        (),
        True,
    )


def tile_source(layout, position: int):
    segs = schedule_span(layout, position, 0)
    big = os.urandom(max(s.byte_len for s in segs))
    return segs, memoryview(big)


def run_rate(engine, rcfg, pcfg, total: int) -> dict:
    layout = span_layout(engine.layout)
    per_token = layout.elements_per_token(layout.classes[0].layers) * 4
    position = max(1, total // per_token)
    segs, big = tile_source(layout, position)
    nbytes = sum(s.byte_len for s in segs)
    rep = rcfg.data_endpoint()
    pep = pcfg.data_endpoint("decode-a")
    sctx, cctx = server_context(rep), client_context(pep)
    key = rcfg.load_hmac_key()

    def serve(mode: str, out: dict) -> None:
        lst = listen("127.0.0.1", 0)
        out["port"] = lst.getsockname()[1]
        out["ready"].set()
        ch = accept(lst, rep, context=sctx)
        lst.close()
        t0 = time.perf_counter()
        if mode == "raw":
            ring = bytearray(RING)
            view = memoryview(bytearray(1 << 20))
            got = pos = 0
            while got < nbytes:
                n = ch.recv_into(view)
                if n == 0:
                    break
                if pos + n > RING:
                    pos = 0
                ring[pos : pos + n] = view[:n]
                pos += n
                got += n
            ch.sendall(b"k")
        else:
            rx = Receiver(
                ReceiverConfig(key, rcfg.hmac_key_id, rcfg.minimum_hmac_epoch, layout=layout),
                RingSink(),
                NoLedger(),
                now_unix_ms=time.time_ns() // 1_000_000,
                hash_executor=HASH_POOL,
            )
            while True:
                buf = rx.wanted()
                if not len(buf):
                    break
                n = ch.recv_into(buf)
                if n == 0:
                    rx.eof()
                for e in rx.advance(n):
                    if hasattr(e, "ack"):
                        ch.sendall(e.ack)
        out["seconds"] = time.perf_counter() - t0
        ch.close()

    results = {}
    for mode in ("raw", "sealed", "raw", "sealed"):  # interleaved twice; best of two each
        out = {"ready": threading.Event()}
        t = threading.Thread(target=serve, args=(mode, out))
        t.start()
        out["ready"].wait()
        ch = connect(pep.with_server_name("decode-a"), "127.0.0.1", out["port"], context=cctx)
        t0 = time.perf_counter()
        if mode == "raw":
            for s in segs:
                ch.sendall(big[: s.byte_len])
            ch.recv_exact(1)
        else:
            send_sealed(ch, Sender(manifest_for(engine, position, rcfg.hmac_key_id, rcfg.minimum_hmac_epoch, 1), key, hash_executor=HASH_POOL), segs, big)
        elapsed = time.perf_counter() - t0
        t.join()
        ch.close()
        results[mode] = min(results.get(mode, 1e9), max(elapsed, out["seconds"]))
    raw_gbs = nbytes / results["raw"] / 1e9
    sealed_gbs = nbytes / results["sealed"] / 1e9
    return {
        "payload_bytes": nbytes,
        "segments": len(segs),
        "raw_GBps": round(raw_gbs, 3),
        "sealed_GBps": round(sealed_gbs, 3),
        "ratio": round(sealed_gbs / raw_gbs, 3),
    }


def send_sealed(ch, sender, segs, big) -> None:
    """Begin, every segment (views of one big buffer), seal, then wait for the one ack."""
    for b in sender.begin():
        ch.sendall(b)
    for s in segs:
        for b in sender.send_segment(big[: s.byte_len], s):
            ch.sendall(b)
    for b in sender.seal():
        ch.sendall(b)
    while sender.receive_data(ch.recv(4096)) is None:
        pass


def run_overhead(engine, rcfg, pcfg, tmp: str, tokens: int) -> dict:
    from kvpack.node.receiver import ReceiverNode

    layout = span_layout(engine.layout)
    position = tokens - 1
    node = ReceiverNode(rcfg, engine, receipts_dir=os.path.join(tmp, "receipts"), metrics_port=None).start()
    try:
        segs, big = tile_source(layout, position)
        key = rcfg.load_hmac_key()
        prompt = list(range(tokens))
        rid = "muser-1-1"
        m = manifest_for(engine, position, rcfg.hmac_key_id, rcfg.minimum_hmac_epoch, 1, prefix=rid)
        m = BeginManifestV2(
            m.protocol, m.transfer_id, m.generation, m.created_unix_ms, m.expires_unix_ms, m.identity, tuple(prompt[:-1]), None, m.hmac, m.components, (), True
        )
        box = {}
        waiter = threading.Thread(target=lambda: box.setdefault("out", node.receive(rid, prompt, wait_s=60)))
        waiter.start()
        time.sleep(0.2)
        ch = connect(pcfg.data_endpoint("decode-a"), "127.0.0.1", node.data_port)
        send_sealed(ch, Sender(m, key, hash_executor=HASH_POOL), segs, big)
        ch.close()
        waiter.join()
        d = box["out"]["durations_s"]
        parts = {k: d.get(k, 0.0) for k in ("verify", "prepare", "reserve", "commit")}
        return {
            "overhead_payload_bytes": box["out"]["payload_bytes"],
            "overhead_s": round(sum(parts.values()), 6),
            **{f"{k}_s": round(v, 6) for k, v in parts.items()},
            "wire_s": d.get("wire"),
        }
    finally:
        node.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="64,256,1024")
    ap.add_argument("--engine", default="smollm2", help="engine whose geometry and install are used (part 2)")
    ap.add_argument("--overhead-tokens", type=int, default=4101, help="4,101 SmolLM2 tokens = 189 MB")
    args = ap.parse_args(argv)
    engine = load_engine(args.engine)
    tmp = tempfile.mkdtemp(prefix="kvpack-bench-wire-")
    rcfg, pcfg = make_cluster(os.path.join(tmp, "cluster"), engine)
    rates = {}
    for mib in [int(x) for x in args.sizes_mib.split(",") if x]:
        rates[f"{mib}MiB"] = run_rate(engine, rcfg, pcfg, mib << 20)
    over = run_overhead(engine, rcfg, pcfg, tmp, args.overhead_tokens)
    print(
        json.dumps(
            {"bench": "wire", "engine": args.engine, "cpus": os.cpu_count(), "rates": rates, "min_ratio": min(r["ratio"] for r in rates.values()), **over},
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
