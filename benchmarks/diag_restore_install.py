"""Diagnostic: warm verified POSIX restore GB/s by thread count and pipeline variant, next to
"read + both hashes" and "read + both hashes + the install copy" on the same threads, with
the process's page faults, context switches and CPU time per GiB of each.

One NumPy-adapter cut of --tokens tokens (the ``bench_store_backends`` shape: 8 full-span
f32 layers, 16 KiB per token, 4 MiB chunk objects) is saved once into a POSIX store under
--dir; then, for every thread count, --restores warm restores of every mode, the modes
interleaved restore by restore so all see the same machine. Each restore installs into a
fresh session. Modes (``--modes``, comma-separated):

* ``workers_install``: the default pipeline (each worker installs the rows it verified);
* ``restoring_thread_installs``: ``RestoreTuning.worker_installs = False`` (the copy on the
  restoring thread, the pipeline before issue 16's many-core round);
* ``one_pass_256k`` / ``one_pass_1m``: worker installs, both hashes fed from one pass over
  the object in 256 KiB / 1 MiB blocks (``RestoreTuning.one_pass_block``; the default on
  more than two workers is 0: one whole-object call per hash, the fewest GIL round trips)
  -- whether reading each object once from memory instead of twice beats the extra GIL
  round trips on many cores;
* ``fresh_planes``: worker installs into an engine whose plane pool is off, so the copy
  faults in fresh pages as before 87dd208 (the pool's share);
* ``switch_0_5ms``: worker installs with ``sys.setswitchinterval(0.0005)`` (default 5 ms):
  a thread back from a GIL-free call (read, hash, copy) waits at most that long for a
  thread running Python to hand the GIL over -- whether GIL hand-offs pace 16 workers;
* ``reader_processes``: ``RestoreTuning.host_readers`` = the thread count: reader processes
  read, verify and write the rows into the install's shared planes (no GIL shared between
  them; the usage columns add the processes' CPU time and switches from /proc);
* ``read_verify``: each object read whole, then SHA-256 and HMAC-SHA-256 over it, one call
  each (the verification-bound ceiling ``bench_store_backends`` reports);
* ``read_verify_copy``: the same, then the plaintext copied to its own offset of one
  preallocated, pre-faulted 1-plane destination -- the ceiling of a verified *install*, the
  restore's like for like (read + hashes + the copy, nothing of kvpack).

Prints one JSON line: per thread count and mode the median GB/s, the ratio to
``read_verify`` and to ``read_verify_copy``, and per GiB restored the minor page faults,
voluntary / involuntary context switches and CPU seconds (user + system) of the process
(``getrusage``, medians). Reading them: the restore near ``read_verify_copy`` but below
``read_verify`` says the copy (memory traffic) is the gap; many more voluntary switches per
GiB than the ceilings says GIL hand-offs; ``fresh_planes`` far below ``workers_install``
with many more faults says page faults; the modes at ``--threads`` N-1 vs N (N = cores)
say whether the restoring thread beside N workers oversubscribes the cores.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.format import constants as C
from kvpack.store import PackStore

MODES = (
    "workers_install",
    "restoring_thread_installs",
    "one_pass_256k",
    "one_pass_1m",
    "fresh_planes",
    "switch_0_5ms",
    "reader_processes",
    "read_verify",
    "read_verify_copy",
)
#: what each restore mode sets on the store's RestoreTuning (one_pass_block None: the default)
_TUNING = {
    "workers_install": (True, None),
    "restoring_thread_installs": (False, None),
    "one_pass_256k": (True, 256 << 10),
    "one_pass_1m": (True, 1 << 20),
    "fresh_planes": (True, None),
    "switch_0_5ms": (True, None),
    "reader_processes": (True, None),
}


def _usage() -> tuple[float, ...]:
    """Minor faults, voluntary and involuntary switches, CPU seconds: this process plus the
    host restore's reader processes (getrusage never counts children that still run)."""
    from kvpack.engine.chunk_readers import host_pool

    ru = resource.getrusage(resource.RUSAGE_SELF)
    total = [ru.ru_minflt, ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_utime + ru.ru_stime]
    pool = host_pool()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pool.pids() if pool is not None else []:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
            total[0] += int(fields[7])
            total[3] += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/status") as fh:
                    for line in fh:
                        key, _sep, value = line.partition(":")
                        if key == "voluntary_ctxt_switches":
                            total[1] += int(value)
                        elif key == "nonvoluntary_ctxt_switches":
                            total[2] += int(value)
        except (OSError, ValueError, IndexError):
            pass
    return tuple(total)


def _read_verify_seconds(paths: list[str], threads: int, dest: np.ndarray | None = None) -> float:
    """Read + both hashes per object on ``threads``; with ``dest`` also its plaintext
    copied to the object's own slot of ``dest`` (as an install copies the rows)."""
    key = bytes(32)
    start = C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES

    def one(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as fh:
            data = fh.read()
        hashlib.sha256(data).digest()
        hmac.new(key, data, "sha256").digest()
        if dest is not None:
            src = np.frombuffer(data, np.uint8)[start:]
            n = min(src.size, dest.shape[1])
            dest[i, :n] = src[:n]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(paths))))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536, help="cut length (16 KiB per token: 65,536 = 1 GiB)")
    ap.add_argument("--threads", default="8,12,15,16", help="thread counts (from 3 up the workers install; at 1-2 the restoring thread does)")
    ap.add_argument("--restores", type=int, default=3, help="restores per mode and thread count")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {','.join(MODES)}")
    ap.add_argument("--dir", default=None, help="parent of the store (default: a temporary folder)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}")
    layout = array_layout(layers=8, kv_heads=8, head_dim=32, dtype="f32", vocab=256)
    eng = ArrayEngine(layout, name="diag-restore-install")
    fresh_eng = ArrayEngine(layout, name="diag-restore-install", plane_pool_bytes=0)  # same identity, no plane pool
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
        dest = np.ones((len(paths), max(os.path.getsize(p) for p in paths)), np.uint8)  # pre-faulted
        out: dict = {"bench": "diag_restore_install", "tokens": args.tokens, "object_bytes": nbytes, "objects": len(paths), "cpus": os.cpu_count()}
        out["default_one_pass_block"] = store.tuning.one_pass_block
        out["load_1m_start"] = round(os.getloadavg()[0], 2)
        rows: dict = {}
        out["modes"] = rows
        # a run stopped by `timeout` (SIGTERM) still prints the thread counts it finished
        signal.signal(signal.SIGTERM, _stop)
        try:
            for threads in (int(t) for t in args.threads.split(",")):
                rows[str(threads)] = _thread_row(store, eng, fresh_eng, hit, tokens, paths, dest, threads, modes, args.restores, nbytes)
        except _Stopped:
            out["incomplete"] = "stopped by SIGTERM after the thread counts listed"
        store.tuning.worker_installs = True
        out["plane_pool"] = eng.planes.stats()
        out["load_1m_end"] = round(os.getloadavg()[0], 2)
        print(json.dumps(out))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Stopped(Exception):
    pass


def _stop(_signum, _frame) -> None:
    raise _Stopped


def _thread_row(store, eng, fresh_eng, hit, tokens, paths, dest, threads: int, modes: list[str], restores: int, nbytes: int) -> dict:
    """Every mode at ``threads``, interleaved restore by restore: GB/s and usage per GiB."""
    gib = nbytes / (1 << 30)
    default_block = store.tuning.one_pass_block
    switch = sys.getswitchinterval()
    store.workers = threads
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    usage: dict[str, list[tuple[float, ...]]] = {m: [] for m in modes}
    _read_verify_seconds(paths, threads)  # warm the page cache and the pool's code paths
    live = eng.new_session()
    store.host_readers = 0
    store.restore(hit, live, tokens)  # untimed: the plane pool's roots are made (faulted) here
    del live
    if "reader_processes" in modes:  # untimed: the workers start, the arena is made and mapped
        store.host_readers = threads
        store.restore(hit, eng.new_session(), tokens)
        store.host_readers = 0
    for _ in range(restores):
        for mode in modes:
            before = _usage()
            if mode.startswith("read_verify"):
                seconds[mode].append(_read_verify_seconds(paths, threads, dest if mode == "read_verify_copy" else None))
            else:
                on_workers, block = _TUNING[mode]
                store.tuning.worker_installs = on_workers
                store.tuning.one_pass_block = default_block if block is None else block
                live = (fresh_eng if mode == "fresh_planes" else eng).new_session()
                if mode == "switch_0_5ms":
                    sys.setswitchinterval(0.0005)
                store.host_readers = threads if mode == "reader_processes" else 0
                try:
                    seconds[mode].append(store.restore(hit, live, tokens).seconds)
                finally:
                    sys.setswitchinterval(switch)
                    store.host_readers = 0
                del live
            usage[mode].append(tuple(b - a for a, b in zip(before, _usage())))
    row: dict = {}
    for mode in modes:
        gbps = round(nbytes / 1e9 / statistics.median(seconds[mode]), 3)
        per = [statistics.median(u[k] for u in usage[mode]) / gib for k in range(4)]
        row[mode] = {
            "gbps": gbps,
            "minflt_per_gib": round(per[0]),
            "vol_switches_per_gib": round(per[1]),
            "invol_switches_per_gib": round(per[2]),
            "cpu_s_per_gib": round(per[3], 3),
        }
    for mode in modes:
        for ceiling in ("read_verify", "read_verify_copy"):
            if ceiling in row and mode != ceiling:
                row[mode][f"over_{ceiling}"] = round(row[mode]["gbps"] / row[ceiling]["gbps"], 3)
    store.tuning.one_pass_block = default_block
    return row


if __name__ == "__main__":
    main()
