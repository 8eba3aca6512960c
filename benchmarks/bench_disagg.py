"""Disaggregated prefill vs local prefill, and delta vs full handoff, with SmolLM2.

For each prompt length in ``--tokens`` (default 1024 and 4096), on one enrolled loopback
cluster (producer and receiver in this process, real sockets, mutual TLS 1.3):

* ``local_ttft_s``: prefill of the prompt minus its boundary token, then the boundary token,
  on one session (the first token's logits exist at that point);
* ``disagg_ttft_s``: ``ReceiverNode.generate`` of the same prompt on a receiver holding
  nothing: control request, producer prefill with tiles streamed per 256-token chunk,
  verify, reserve, commit, boundary token. Both nodes share this machine's cores, so this
  measures the protocol's added latency, not the benefit of a separate prefill machine;
* a follow-up prompt that shares all but the last ``--suffix`` tokens: the receiver's
  resident tier arms a delta at the deepest 256-aligned cut, the producer reuses the prefix
  it computed and prefills only the suffix. ``delta_bytes`` / ``full_bytes`` (the follow-up
  sent full would cost ``full_equiv_bytes``), ``delta_ttft_s`` and the producer's
  ``prefilled_tokens`` for both.

Each size is warmed up first (one local prefill of the same length), because the first
forward of each new attention shape pays a one-time setup cost (docs/engine.md). Prints
ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

from kvpack.node.common import load_engine
from kvpack.node.producer import ProducerNode
from kvpack.node.receiver import ReceiverNode
from kvpack.node.wire import identity_file_json
from kvpack.security.config import load_producer_config, load_receiver_config
from kvpack.security.enroll import Cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_of(n: int, seed: int) -> list[int]:
    # deterministic ordinary-vocabulary token ids (the model does not care what they spell)
    return [1000 + (i * 7919 + seed * 104729) % 30000 for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024,4096")
    ap.add_argument("--suffix", type=int, default=128, help="follow-up tokens that differ from the first prompt")
    args = ap.parse_args(argv)
    engine = load_engine("smollm2")
    tmp = tempfile.mkdtemp(prefix="kvpack-bench-disagg-")
    c = Cluster.init(os.path.join(tmp, "cluster"), identity=identity_file_json(engine))
    c.enroll_node("decode-a", "receiver", listen=f"127.0.0.1:{free_port()}")
    c.enroll_node("prefill-a", "producer", control_listen=f"127.0.0.1:{free_port()}")
    rcfg = load_receiver_config(c.receiver_config_path("decode-a", "prefill-a"))
    pcfg = load_producer_config(c.producer_config_path("prefill-a"))
    out: dict = {"bench": "disagg", "model": "SmolLM2-135M-Instruct", "cpus": os.cpu_count(), "sizes": {}}
    for n in [int(x) for x in args.tokens.split(",") if x]:
        producer = ProducerNode(pcfg, engine, receipts_dir=os.path.join(tmp, f"p{n}"), metrics_port=None).start()
        receiver = ReceiverNode(rcfg, engine, receipts_dir=os.path.join(tmp, f"r{n}"), metrics_port=None).start()
        try:
            first = prompt_of(n, n)
            follow = first[: n - args.suffix] + prompt_of(args.suffix, n + 1)
            warm = engine.new_session()
            warm.prefill(prompt_of(n, 7)[:-1])  # one-time kernel setup for these shapes
            s = engine.new_session()
            t0 = time.perf_counter()
            s.prefill(first[:-1])
            s.prefill(first[-1:])
            local_ttft = time.perf_counter() - t0
            r1 = receiver.generate(first, 1)
            r2 = receiver.generate(follow, 1)
            t1, t2 = r1["transfer"], r2["transfer"]
            full_equiv = receiver.geometry.tile_bytes(n - 1)
            pr1, pr2 = t1["producer_receipt"], t2["producer_receipt"]
            out["sizes"][str(n)] = {
                "local_ttft_s": round(local_ttft, 3),
                "disagg_ttft_s": round(r1["ttft_s"], 3),
                "disagg_over_local": round(r1["ttft_s"] / local_ttft, 3),
                "control_s": round(t1["control_s"], 4),
                "verify_reserve_commit_s": round(sum(t1["durations_s"].get(k, 0) for k in ("verify", "prepare", "reserve", "commit")), 4),
                "full_bytes": t1["payload_bytes"],
                "prefilled_tokens_full": pr1["prefill_tokens"] if pr1 else None,
                "delta_prefix_cut": t2["prefix_cut"],
                "delta_bytes": t2["payload_bytes"],
                "full_equiv_bytes": full_equiv,
                "delta_share": round(t2["payload_bytes"] / full_equiv, 4),
                "delta_ttft_s": round(r2["ttft_s"], 3),
                "prefilled_tokens_delta": pr2["prefill_tokens"] if pr2 else None,
                "payload_GBps_full": round(t1["payload_bytes"] / (pr1["payload_wire_ns"] / 1e9) / 1e9, 3) if pr1 else None,
            }
        finally:
            receiver.stop()
            producer.stop()
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
