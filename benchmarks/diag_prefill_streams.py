"""Diagnostic (issue 20): does a 256-token prefill chunk's work run faster when two chunks
share the device on separate CUDA streams?

A 256-query chunk leaves most of the H200 idle: its flash attention has 2 query blocks x 32
heads = 64 blocks for 132 multiprocessors, and its 256-row projections run at ~0.4-0.55 of
their 4,096-row rate (diag_prefill_attention). Chunk ``j + 1`` of a prefill only needs chunk
``j``'s keys and values *of the same layer*, so two chunks staggered by one layer could run
concurrently, each kernel computing exactly what it computes alone (same shapes, same
operands: the bits cannot change). This script measures what that concurrency is worth
before the prefill is rebuilt around it, for the 8B shape (32 query heads, 8 key/value heads,
head size 128, hidden 4,096, MLP 14,336, f16):

* ``attention``: ``--layers`` lower-right chunk attentions (kvpack.engine.fast_prefill.attend)
  of 256 queries over a prefix, issued on one stream, then alternately on ``S`` streams;
* ``projections``: the seven projections of ``--layers`` layers at 256 rows, same way;
* ``layer``: norm + projections + attention + MLP of a layer (eager, the lean forward's
  functions), chunk ``j`` on stream ``j % S``.

Each line: median ms per unit of work over ``--iters`` timed repetitions for 1, 2 and 3
streams and the speedup against one stream.

    python3 benchmarks/diag_prefill_streams.py --prefixes 16384,65536,130816
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial


def _timed(torch, fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _on_streams(torch, streams, jobs):
    """Issue ``jobs`` (callables) round robin over ``streams``; every stream first waits
    for the current one, and the current one waits for all at the end."""
    current = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(current)
    for i, job in enumerate(jobs):
        with torch.cuda.stream(streams[i % len(streams)]):
            job()
    for s in streams:
        current.wait_stream(s)


def _measure_prefix(torch, F, attend, lower_right_bias, prefix, first, w, xs, rand, pool, counts, args, shape) -> None:
    n, heads, kv_heads, d, scale = shape
    kv = prefix + n
    keys = [rand(1, kv_heads, kv, d) for _ in range(2)]
    values = [rand(1, kv_heads, kv, d) for _ in range(2)]
    qs = [rand(1, heads, n, d) for _ in range(4)]
    bias = lower_right_bias(n, kv)

    def attention_job(i):
        return lambda: attend(qs[i % 4], keys[i % 2], values[i % 2], scale, bias)

    def layer_job(i):
        def job():
            x = xs[i % 8]
            q = F.linear(x, w["q"]).view(1, n, heads, d).transpose(1, 2)
            F.linear(x, w["k"]), F.linear(x, w["v"])
            out = attend(q, keys[i % 2], values[i % 2], scale, bias).reshape(1, n, -1)
            h = x + F.linear(out, w["o"])
            F.linear(F.silu(F.linear(h, w["gate"])) * F.linear(h, w["up"]), w["down"])

        return job

    def projections_job(i):
        def job():
            x = xs[i % 8]
            F.linear(x, w["q"]), F.linear(x, w["k"]), F.linear(x, w["v"]), F.linear(x, w["o"])
            F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])

        return job

    kinds = {"attention": attention_job, "layer": layer_job}
    if first:
        kinds["projections"] = projections_job
    for kind, make in kinds.items():
        line = {"diag": "prefill_streams", "kind": kind, "prefix": prefix, "rows": n, "units": args.layers}
        base = None
        with torch.inference_mode():
            for count in counts:
                jobs = [make(i) for i in range(args.layers * 2)]
                streams = pool[:count]
                ms = _timed(torch, partial(_on_streams, torch, streams, jobs), args.iters) / 2
                line[f"ms_streams_{count}"] = round(ms, 3)
                if base is None:
                    base = ms
                line[f"speedup_streams_{count}"] = round(base / ms, 3)
        print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", default="16384,65536,130816")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--streams", default="1,2,3,4")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"diag": "prefill_streams", "skipped": "no CUDA"}))
        return 0
    import torch.nn.functional as F

    from kvpack.engine.fast_prefill import attend, lower_right_bias

    dev, dt = torch.device("cuda"), torch.float16
    hidden, heads, kv_heads, d, inter = 4096, 32, 8, 128, 14336
    n = args.rows
    counts = [int(s) for s in args.streams.split(",")]
    pool = [torch.cuda.Stream() for _ in range(max(counts))]
    gen = torch.Generator(device=dev).manual_seed(7)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(dt)

    w = {
        "q": rand(heads * d, hidden),
        "k": rand(kv_heads * d, hidden),
        "v": rand(kv_heads * d, hidden),
        "o": rand(hidden, heads * d),
        "gate": rand(inter, hidden),
        "up": rand(inter, hidden),
        "down": rand(hidden, inter),
    }
    # per job its own input (chunks differ): eight distinct chunk inputs reused round robin
    xs = [rand(1, n, hidden) for _ in range(8)]

    scale = d**-0.5
    first = True
    for prefix in [int(p) for p in args.prefixes.split(",")]:
        _measure_prefix(torch, F, attend, lower_right_bias, prefix, first, w, xs, rand, pool, counts, args, (n, heads, kv_heads, d, scale))
        first = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
