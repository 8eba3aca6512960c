"""Profile helper: where a verified GPU restore spends its time, per chunk size and knob.

Builds the 8B-shape f16 Llama engine of bench_gpu, installs a *random* cache of N tokens
(no prefill: the restore does not care what the rows mean, and a 131k prefill costs device
time), saves it with each ``--chunk-mib`` store chunk size, then restores it ``--repeat``
times per variant (the default pipeline, the earlier per-chunk read submission, the
calibrated host tail, other worker counts, other ring sizes), the variants of one store
interleaved round by round so they share the machine's minutes. One JSON line per (tokens,
chunk size, variant) with the restore times, the median run's phases (``device_*_s``: where
the installing thread waited; ``device_host_tail``: chunks verified on the host) and the
save. The first restore of every variant is checked bit for bit against the installed cache
(and not timed).

    python3 benchmarks/profile_gpu_restore.py --tokens 32768,131072 --chunk-mib 1,2
    python3 benchmarks/profile_gpu_restore.py --tokens 8192,32768,131072 --chunk-mib 2 \
        --variants items,default,host_tail,items+host_tail   # old vs new submission, tail
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def random_session(engine, n: int, seed: int):
    """A session at ``n`` tokens whose cache rows and logits are random (installed)."""
    import torch

    g = torch.Generator(device=engine.device).manual_seed(seed)
    tokens = torch.randint(3, engine.layout.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    s = engine.new_session()
    install = s.begin_install(n, tokens, engine.identity)
    for layer, role in engine.layout.states():
        rows = n * engine.layout.layer(layer).row_bytes
        data = torch.randint(0, 256, (rows,), dtype=torch.uint8, device=engine.device, generator=g)
        install.write_rows(layer, role, 0, data)
    install.write_logits(torch.randn(engine.layout.vocab_size, dtype=torch.float32).numpy().tobytes())
    install.commit()
    return s, tokens


def configure(store, variant: str, workers: int, defaults: tuple) -> None:
    """Set ``store`` (and the ring's stream count) to ``variant`` (see --variants)."""
    from kvpack.engine import device_verify

    store.workers, store.device_host_tail, store.device_waves = workers, 0, defaults[0]
    store.read_processes = os.environ.get("KVPACK_READ_PROCESSES", "auto")  # "always": a CPU dry run uses the processes too
    store.device_staging_bytes = defaults[1]
    store.tuning.read_submit, store.tuning.device_host_tail_scale = "table", 1.0
    device_verify.MAX_STREAMS, device_verify.DIGESTS = defaults[2], defaults[3]
    for part in variant.split("+"):  # e.g. waves_8+host_tail
        if part == "threads":
            store.read_processes = "never"
        elif part == "mapped":
            device_verify.DIGESTS = "mapped"
        elif part == "items":
            store.tuning.read_submit = "items"
        elif part == "host_tail":
            store.device_host_tail = None
        elif part.startswith("host_tail_"):
            store.device_host_tail = int(part.split("_")[2])
        elif part.startswith("tail_scale_"):
            store.device_host_tail, store.tuning.device_host_tail_scale = None, float(part.split("_")[2])
        elif part.startswith("workers_"):
            store.workers = int(part.split("_")[1])
        elif part.startswith("waves_"):
            store.device_waves = int(part.split("_")[1])
        elif part.startswith("staging_mib_"):
            store.device_staging_bytes = int(part.split("_")[2]) << 20
        elif part.startswith("streams_"):
            device_verify.MAX_STREAMS = int(part.split("_")[1])
        elif part != "default":
            raise SystemExit(f"unknown variant part {part!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--chunk-mib", default="1,2")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--store-dir", default=None)
    ap.add_argument(
        "--variants",
        default="items,default,host_tail,items+host_tail",
        help="comma-separated; each is default or parts joined by '+': items (per-chunk read batches to the least busy reader, the "
        "protocol before wave slices), mapped (the kernel writes digests into pinned host rows: no digest copy), threads (no reader processes), host_tail (calibrated), host_tail_N (N chunks), tail_scale_X "
        "(calibrated tail times X), workers_N, waves_N, staging_mib_N, streams_N (a new ring geometry pins its staging once)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32, help="fewer for a CPU dry run")
    args = ap.parse_args()
    import torch

    from bench_gpu import _emit, build_model, planes_equal  # the benchmark's own model builder

    from kvpack.engine import device_verify
    from kvpack.engine.transformers_adapter import TransformersEngine
    from kvpack.store import PackStore

    lengths = [int(x) for x in args.tokens.split(",") if x]
    spec = argparse.Namespace(
        device=args.device,
        dtype="f16",
        layers=args.layers,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=1024,
        vocab=128256,
        seed=0,
        tokens=lengths,
    )
    engine = TransformersEngine(build_model(spec, torch), device=args.device, prefill_chunk_tokens=256, max_context=max(lengths) + 256)
    root = args.store_dir or tempfile.mkdtemp(prefix="kvpack-profile-")

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    def emit(line: dict) -> None:
        _emit(line, args.out)

    warm, wtokens = random_session(engine, 1024, 1)  # pins the ring, compiles the kernel
    wstore = PackStore.init(os.path.join(root, "warm"))
    wstore.workers = args.workers
    wstore.save(warm)
    wstore.restore(wstore.find_deepest(wtokens, engine.layout, engine.ids()), engine.new_session(), wtokens)
    del warm
    for n in lengths:
        s, tokens = random_session(engine, n, n)
        for mib in [float(x) for x in args.chunk_mib.split(",") if x]:
            path = os.path.join(root, f"n{n}-c{mib}")
            shutil.rmtree(path, ignore_errors=True)
            store = PackStore.init(path, chunk_bytes=int(mib * (1 << 20)))
            store.workers = args.workers
            save = store.save(s)
            hit = store.find_deepest(tokens, engine.layout, engine.ids())
            defaults = (store.device_waves, store.device_staging_bytes, device_verify.MAX_STREAMS, device_verify.DIGESTS)
            variants = [v for v in args.variants.split(",") if v]
            runs: dict[str, list] = {v: [] for v in variants}

            failed: dict[str, str] = {}
            for round_no in range(args.repeat + 1):  # round 0: each variant's first restore, checked, not timed
                for variant in variants:
                    if variant in failed:
                        continue
                    configure(store, variant, args.workers, defaults)
                    sync()
                    t0 = time.perf_counter()
                    r = engine.new_session()
                    try:  # an experimental variant that refuses is reported, the others still run
                        rep = store.restore(hit, r, tokens)
                    except Exception as exc:  # noqa: BLE001 - reported in its JSON line
                        failed[variant] = f"{type(exc).__name__}: {exc}"
                        continue
                    sync()
                    elapsed = time.perf_counter() - t0
                    if round_no == 0:
                        if not planes_equal(torch, s, r):
                            failed[variant] = "restored cache differs"
                    else:
                        runs[variant].append((elapsed, rep.phases, rep.hashed_on))
                    del r
            configure(store, "default", args.workers, defaults)
            for variant, why in failed.items():
                emit(
                    {
                        "bench": "profile_restore",
                        "tokens": n,
                        "chunk_bytes": store.chunk_bytes,
                        "variant": variant,
                        "error": why,
                        "bit_identical": False if why == "restored cache differs" else None,
                    }
                )
            for variant in [v for v in variants if v not in failed]:
                times = [t for t, _p, _h in runs[variant]]
                mid = sorted(range(len(times)), key=lambda i: times[i])[len(times) // 2]
                emit(
                    {
                        "bench": "profile_restore",
                        "tokens": n,
                        "chunk_bytes": store.chunk_bytes,
                        "chunks": save.chunks_written,
                        "variant": variant,
                        "bit_identical": True,
                        "restore_s": [round(t, 4) for t in times],
                        "median_s": round(statistics.median(times), 4),
                        "phases": {k: round(v, 4) for k, v in runs[variant][mid][1].items()},
                        "hashed_on": runs[variant][mid][2],
                        "save_s": round(save.seconds, 3),
                        "save_object_gbps": round(save.bytes_written / save.seconds / 1e9, 3),
                        "kv_bytes": save.plaintext_bytes,
                    }
                )
            shutil.rmtree(path, ignore_errors=True)
        del s
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
