"""Plot TTFT vs prompt length (restore from the store vs recompute) from bench_gpu.py JSON lines.

python3 benchmarks/plot_gpu_ttft.py docs/bench/h200_bench_gpu.jsonl docs/gpu_ttft.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in open(src) if l.strip()]
    env = next(r for r in rows if r["bench"] == "gpu_env")
    ttft = sorted((r for r in rows if r["bench"] == "gpu_ttft"), key=lambda r: r["tokens"])
    n = [r["tokens"] for r in ttft]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ("recompute_engine_s", "recompute: engine prefill (256-token chunks)", "s-"),
        ("recompute_oneshot_s", "recompute: one forward over the prompt", "o-"),
        ("restore_cold_s", "restore from store, cold page cache (disk)", "v--"),
        ("restore_warm_s", "restore from store, warm, hashes on the GPU", "^-"),
        ("restore_warm_host_verify_s", "restore from store, warm, hashes on 16 CPU threads", "d-"),
        ("ceiling_s", "CPU verification ceiling (2 hash passes, 16 threads + H2D)", "k:"),
    ]
    for key, label, style in series:
        ax.plot(n, [r.get(key) for r in ttft], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(n, [f"{x:,}" for x in n])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"{env['model']} f16 on {env['device']} (torch {env['torch']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
