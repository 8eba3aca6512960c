"""Benchmark: disaggregated prefill between two vLLM instances through kvpack (a sealed
Handoff V2 transfer over mutual TLS) against one vLLM instance computing the whole prompt.

For each prompt length (default ~1,000 and ~1,900 tokens), SmolLM2 under vLLM (CPU, fp32,
block size 128): the producer instance (``kv_producer``, vLLM's engine-core process) prefills
with ``max_tokens=1``; the consumer instance (``kv_consumer``, in-process engine) then
serves the prompt with the producer's ``kv_transfer_params``: its time to first token is the
control request, the transfer (every layer's K/V rows of the prompt minus its last token,
verified: segment digests, seal HMAC, replay-ledger reservation) and the last token's
forward. The peer, measured in the same run on the same core: a single vLLM instance with no
connector computing the whole prompt (``recompute``). Medians of ``--repeat`` distinct
prompts. One JSON line per length.

    python3 benchmarks/bench_vllm_pd.py [--lengths 1000,1900] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

BINDING = "producer on core 0, consumer and the recompute peer on core 1; VLLM_CPU_OMP_THREADS_BIND and OMP_NUM_THREADS=1 set explicitly"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def enroll(python: str, model: str, work: str) -> object:
    """Identity file from the engine arguments, then a cluster with one producer and one
    consumer on loopback (``kvpack enroll``'s library)."""
    from kvpack.security.enroll import Cluster

    ident = os.path.join(work, "identity.json")
    cmd = [python, "-m", "kvpack.integrations.vllm", "identity", "--model", model, "--dtype", "float32", "--max-model-len", "4096", "-o", ident]
    subprocess.run(cmd, check=True, timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(ident) as fh:
        cl = Cluster.init(os.path.join(work, "cluster"), identity=json.load(fh))
    cl.enroll_node("decode-a", "receiver", listen=f"127.0.0.1:{_free_port()}")
    cl.enroll_node("prefill-a", "producer", control_listen=f"127.0.0.1:{_free_port()}")
    return cl


def measure_recompute(base: dict, prompts: dict, work: str, times: dict, firsts: dict) -> None:
    """The peer: one vLLM instance, no connector, computing every prompt."""
    from kvpack.testing.vllm_harness import Engine

    lengths = sorted(prompts)
    peer = Engine({**base, "connector": None}, os.path.join(work, "recompute.log"), core=1).start()
    try:
        peer.generate([prompts[lengths[0]][0][:300][::-1]], max_tokens=1)  # warm-up
        for n, ps in prompts.items():
            for i, p in enumerate(ps):
                (r,) = peer.generate([p], max_tokens=1)
                times[n]["recompute"].append(r["wall_s"])
                firsts[n].add((i, r["tokens"][0]))
    finally:
        peer.stop()


def measure_pd(python: str, base: dict, prompts: dict, work: str, times: dict, firsts: dict) -> dict:
    """Producer and consumer instances enrolled on loopback; every prompt handed off once."""
    from kvpack.testing.vllm_harness import Engine

    lengths = sorted(prompts)
    cl = enroll(python, base["model"], work)
    producer = Engine(
        {
            **base,
            "connector": "kvpack",
            "kv_role": "kv_producer",
            "single_process": False,
            "extra": {"kvpack.node_config": cl.producer_config_path("prefill-a")},
        },
        os.path.join(work, "producer.log"),
        core=0,
    ).start()
    consumer = Engine(
        {**base, "connector": "kvpack", "kv_role": "kv_consumer", "extra": {"kvpack.node_config": cl.receiver_config_path("decode-a", "prefill-a")}},
        os.path.join(work, "consumer.log"),
        core=1,
    ).start()
    try:
        handoff(producer, consumer, prompts[lengths[0]][0][:300][::-1])  # warm-up of both paths
        for n, ps in prompts.items():
            for i, p in enumerate(ps):
                pre, out = handoff(producer, consumer, p)
                times[n]["producer_prefill"].append(pre)
                times[n]["consumer_ttft"].append(out["wall_s"])
                firsts[n].add((i, out["tokens"][0]))
        m = consumer.metrics()
        return {"transfers_received": m.get("kvpack_transfers_received"), "refusals": m.get("kvpack_refusals", 0)}
    finally:
        producer.stop()
        consumer.stop()


def summary_line(n: int, times: dict, firsts: set, repeat: int, counts: dict) -> dict:
    med = {k: round(statistics.median(v), 4) for k, v in times.items()}
    e2e = med["producer_prefill"] + med["consumer_ttft"]
    return {
        "bench": "vllm_pd",
        "prompt_tokens": n,
        "repeat": repeat,
        "engine": "vLLM 0.32.0 CPU, fp32, block 128; producer multi-process, consumer and peer single-process; max_tokens=1",
        "binding": BINDING,
        "ttft_s": med,
        "end_to_end_s": round(e2e, 4),
        "ratios": {
            "consumer_ttft_over_recompute": round(med["consumer_ttft"] / med["recompute"], 4),
            "end_to_end_over_recompute": round(e2e / med["recompute"], 4),
        },
        "first_tokens_equal_recompute": len(firsts) == len({i for i, _ in firsts}),
        **counts,
        "verified": "every segment's SHA-256, the seal's HMAC, identity and prompt, replay-ledger reservation before any block is written",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "load_avg_1m": round(os.getloadavg()[0], 2)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1000,1900")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", help="cluster and logs (default: a temporary directory)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from kvpack.engine.models import load_smollm2
    from kvpack.testing.vllm_harness import vllm_python

    python = vllm_python()
    if python is None:
        print(json.dumps({"bench": "vllm_pd", "skipped": "vLLM is not installed (scripts/install.sh; or KVPACK_VLLM_PYTHON)"}))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_vllm import prompts_for

    model = load_smollm2().source["cache_dir"]
    work = args.workdir or tempfile.mkdtemp(prefix="kvpack-bench-vllm-pd-")
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {n: prompts_for(AutoTokenizer.from_pretrained(model), n, args.repeat) for n in lengths}
    base = {"model": model, "dtype": "float32", "max_model_len": 4096, "kv_cache_bytes": 512 << 20, "block_size": 128}
    times: dict = {n: {"recompute": [], "producer_prefill": [], "consumer_ttft": []} for n in lengths}
    firsts: dict = {n: set() for n in lengths}  # (prompt index, first token)

    measure_recompute(base, prompts, work, times, firsts)
    counts = measure_pd(python, base, prompts, work, times, firsts)
    for n in lengths:
        print(json.dumps(summary_line(n, times[n], firsts[n], args.repeat, counts)), flush=True)


def handoff(producer, consumer, prompt: list[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    (pre,) = producer.generate([prompt], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    prefill_s = time.perf_counter() - t0
    (out,) = consumer.generate([prompt], max_tokens=1, kv_transfer_params=pre["kv_transfer_params"])
    return prefill_s, out


if __name__ == "__main__":
    main()
