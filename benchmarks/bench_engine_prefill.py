"""SmolLM2 prefill / decode / export timing through the transformers adapter (one JSON line).

Measures what the store's TTFT benchmark compares against: the cost of recomputing a
prefill on this machine. Repeats each length and reports every run plus the minimum, since
the first run pays one-time kernel setup and shared CI machines are noisy.

    python3 benchmarks/bench_engine_prefill.py [--tokens 1024 ...] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--decode", type=int, default=16)
    args = parser.parse_args()

    from kvpack.engine.models import load_smollm2
    from kvpack.engine.transformers_adapter import TransformersEngine

    t0 = time.perf_counter()
    engine = TransformersEngine(load_smollm2(), threads=args.threads)
    load_s = time.perf_counter() - t0
    rng = random.Random(0)
    result = {"model": "SmolLM2-135M-Instruct", "threads": engine.threads, "load_s": round(load_s, 3), "runs": {}}
    for n in args.tokens:
        tokens = [rng.randrange(engine.layout.vocab_size) for _ in range(n)]
        runs = []
        for _ in range(args.repeats):
            s = engine.new_session()
            t = time.perf_counter()
            s.prefill(tokens)
            prefill_s = time.perf_counter() - t
            t = time.perf_counter()
            s.decode_greedy(args.decode)
            decode_ms = (time.perf_counter() - t) / args.decode * 1000
            t = time.perf_counter()
            nbytes = sum(len(s.export_rows(layer, role, 0, s.position)) for layer, role in s.layout.states())
            export_s = time.perf_counter() - t
            runs.append({"prefill_s": round(prefill_s, 3), "decode_ms_per_token": round(decode_ms, 1), "export_bytes": nbytes, "export_s": round(export_s, 4)})
        result["runs"][str(n)] = {"min_prefill_s": min(r["prefill_s"] for r in runs), "all": runs}
    result["loadavg"] = os.getloadavg()
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
