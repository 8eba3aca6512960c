"""Profile helper: build an 8B-shaped f16 Llama on CUDA, prefill N tokens, save the cut, then
restore it --repeat times (the part to profile, e.g. under ``py-spy record --gil``).
Prints one JSON line with the restore times."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--store-dir", default=tempfile.mkdtemp())
    ap.add_argument("--tails", default="", help="also restore with these device_host_tail values (comma list)")
    ap.add_argument("--variants", action="store_true", help="also: GIL switch interval 0.5 ms, 8 and 12 workers, host verify")
    args = ap.parse_args()
    import torch

    from bench_gpu import build_model  # the benchmark's own model builder

    from kvpack.engine.transformers_adapter import TransformersEngine
    from kvpack.store import PackStore

    spec = argparse.Namespace(
        device="cuda", dtype="f16", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, seed=0, tokens=[args.tokens]
    )
    engine = TransformersEngine(build_model(spec, torch), device="cuda", prefill_chunk_tokens=256, max_context=args.tokens + 256)
    tokens = torch.randint(0, 128000, (args.tokens,), generator=torch.Generator().manual_seed(5)).tolist()
    s = engine.new_session()
    with torch.inference_mode():
        s.prefill(tokens)
    store = PackStore.init(os.path.join(args.store_dir, "p"))
    store.workers = args.workers
    store.save(s)
    hit = store.find_deepest(tokens, engine.layout, engine.identity.ids())
    print("RESTORE-START", flush=True)

    def measure(label: str, repeat: int) -> None:
        times, phases = [], []
        for _ in range(repeat):
            r = engine.new_session()
            t0 = time.perf_counter()
            rep = store.restore(hit, r, tokens)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            phases.append(rep.phases)
            del r
        mid = sorted(range(repeat), key=lambda i: times[i])[repeat // 2]
        print(
            json.dumps(
                {
                    "variant": label,
                    "tokens": args.tokens,
                    "restore_s": [round(t, 4) for t in times],
                    "median_s": round(statistics.median(times), 4),
                    "phases": {k: round(v, 4) for k, v in phases[mid].items()},
                }
            ),
            flush=True,
        )

    measure("default", args.repeat)
    if args.tails:
        for tail in [int(x) for x in args.tails.split(",")]:
            store.device_host_tail = tail
            measure(f"host_tail_{tail}", args.repeat)
        store.device_host_tail = None
    if args.variants:
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        measure("switch_0.5ms", args.repeat)
        sys.setswitchinterval(old)
        for workers in (8, 12):
            store.workers = workers
            measure(f"workers_{workers}", args.repeat)
        store.workers = args.workers
        store.verify_on = "host"
        measure("host_verify", args.repeat)


if __name__ == "__main__":
    main()
