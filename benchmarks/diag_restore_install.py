"""Diagnostic: warm verified POSIX restore GB/s by thread count, with each chunk's rows
installed by the worker that verified it (``RestoreTuning.worker_installs``, the default)
against the restoring thread installing every chunk (the pipeline before issue 16's
many-core round), next to "read + both hashes" on the same threads.

One NumPy-adapter cut of --tokens tokens (the ``bench_store_backends`` shape: 8 full-span
f32 layers, 16 KiB per token, 4 MiB chunk objects) is saved once into a POSIX store under
--dir; then, for every thread count, --restores warm restores in each mode, the modes
interleaved restore by restore so both see the same machine. Each restore installs into a
fresh session (fresh pages, as a real restore). ``read_verify_gbps``: every chunk object
read whole and both hashes computed over it, one pass each (SHA-256 + HMAC-SHA-256), on the
same threads: the verification-bound ceiling. Prints one JSON line: medians per thread
count and mode, and each mode's ratio to that ceiling.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.store import PackStore


def _read_verify_seconds(paths: list[str], threads: int) -> float:
    key = bytes(32)

    def one(path: str) -> None:
        with open(path, "rb", buffering=0) as fh:
            data = fh.read()
        hashlib.sha256(data).digest()
        hmac.new(key, data, "sha256").digest()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, paths))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536, help="cut length (16 KiB per token: 65,536 = 1 GiB)")
    ap.add_argument("--threads", default="4,8,16", help="thread counts (from 3 up the workers install; at 1-2 both modes are the same)")
    ap.add_argument("--restores", type=int, default=3, help="warm restores per mode and thread count")
    ap.add_argument("--dir", default=None, help="parent of the store (default: a temporary folder)")
    args = ap.parse_args()
    layout = array_layout(layers=8, kv_heads=8, head_dim=32, dtype="f32", vocab=256)
    eng = ArrayEngine(layout, name="diag-restore-install")
    tokens = [(i * 7 + 3) % 256 for i in range(args.tokens)]
    tmp = tempfile.mkdtemp(prefix="kvpack-diag-install-", dir=args.dir)
    try:
        store = PackStore.init(os.path.join(tmp, "store"), chunk_bytes=4 << 20, root_key_file=os.path.join(tmp, "root.key"))
        src = eng.new_session()
        src.prefill(tokens)
        store.save(src)
        del src
        hit = store.find_deepest(tokens, eng.layout, eng.ids())
        assert hit is not None
        chunk_dir = os.path.join(store.path, "chunks")
        paths = [os.path.join(dirpath, n) for dirpath, _d, files in os.walk(chunk_dir) for n in files if not n.startswith(".")]
        nbytes = sum(os.path.getsize(p) for p in paths)
        out: dict = {"bench": "diag_restore_install", "tokens": args.tokens, "object_bytes": nbytes, "objects": len(paths), "cpus": os.cpu_count()}
        out["load_1m_start"] = round(os.getloadavg()[0], 2)
        rows = {}
        for threads in (int(t) for t in args.threads.split(",")):
            store.workers = threads
            seconds: dict[str, list[float]] = {"workers_install": [], "restoring_thread_installs": [], "read_verify": []}
            _read_verify_seconds(paths, threads)  # warm the page cache and the pool's code paths
            for _ in range(args.restores):
                for mode, on_workers in (("workers_install", True), ("restoring_thread_installs", False)):
                    store.tuning.worker_installs = on_workers
                    live = eng.new_session()
                    seconds[mode].append(store.restore(hit, live, tokens).seconds)
                    del live
                seconds["read_verify"].append(_read_verify_seconds(paths, threads))
            row = {name: round(nbytes / 1e9 / statistics.median(vals), 3) for name, vals in seconds.items()}
            for mode in ("workers_install", "restoring_thread_installs"):
                row[f"{mode}_over_read_verify"] = round(row[mode] / row["read_verify"], 3)
            rows[str(threads)] = row
        store.tuning.worker_installs = True
        out["gbps"] = rows
        out["load_1m_end"] = round(os.getloadavg()[0], 2)
        print(json.dumps(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
