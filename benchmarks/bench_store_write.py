"""Benchmark: a pack-store save against the disk's own durable write rate, same run.

One JSON line (``bench: store_write``). A NumPy-adapter session of about ``--gib`` GiB of
KV rows is saved into a fresh POSIX store (``--chunk-mib`` chunks, ``--workers`` store
workers); then the very same chunk objects (read back from that store, held in memory)
are written again with no hashing or encoding, three ways, on the threads the save uses
(``publish.save_threads``):

* ``store_pattern``: what a save does per chunk, through ``kvpack.durable.atomic_write``
  (temp file O_EXCL, write, fsync, link to the final name, unlink the temp; no directory
  fsync), then one directory fsync: the ceiling the save is compared with (issue 20 asks
  for ``save_over_store_pattern >= 0.9``);
* ``plain``: open O_EXCL, write, fsync, close per object, one directory fsync (the disk's
  simplest durable pattern, no temp names);
* ``batched_fsync``: every temp file written first (no fsync), then fsynced from the same
  pool, then linked, then one directory fsync: whether batching the fsyncs pays on this
  disk.

* ``o_tmpfile``: each object written into an unnamed file (``O_TMPFILE``), fsynced, then
  given its name with ``linkat`` (no temp name to create and unlink; same guarantees for a
  create-only object): whether the store's pattern should move to it (null where the
  filesystem refuses ``O_TMPFILE``).

* ``hash_then_pattern``: the save's two hashes of each object, then ``store_pattern``'s
  write, on the same thread (no encoding, no kvpack code): the save's floor on these
  threads if only hashing is added; ``save_over_hash_then_pattern`` tells kvpack's own
  per-chunk cost (below ~0.9) from the cost of hashing on the writer threads.

For context, ``hash_gbps``: the two SHA-256 passes a save must make per chunk (the
content-id HMAC over the plaintext, the object digest over the object) over the same
objects on the same threads, no I/O: where it is below ``store_pattern_gbps`` the save is
bound by the CPUs, not the disk.

Rounds are interleaved (save, store_pattern, plain, batched_fsync, repeated ``--repeat``
times); each figure is the median, in GB/s of chunk-object bytes. ``bit_identical``: a
restore of the saved cut reproduces the session's cache digest.

    python3 benchmarks/bench_store_write.py --dir /var/tmp/kvsw --gib 2 --out $OUT/store_write.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from kvpack.durable import atomic_write, sync_dir, temp_path_for
from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.store import PackStore
from kvpack.store.publish import save_threads

#: bytes of K and V rows per token: 8 layers x 8 kv heads x 32 dims x f32 x 2 roles
TOKEN_BYTES = 8 * 8 * 32 * 4 * 2


def _fsync_dir(path: str) -> None:
    sync_dir(path)


def write_store_pattern(directory: str, objects: list[bytes], threads: int) -> float:
    """Seconds for ``atomic_write(create_only, no dir fsync)`` per object + one dir fsync."""
    os.makedirs(directory)

    def one(i: int) -> None:
        atomic_write(os.path.join(directory, f"c{i:06d}"), objects[i], mode=0o600, sync_dir=False, replace=False)

    return _timed_per_object(directory, len(objects), threads, one)


def write_hash_then_pattern(directory: str, objects: list[bytes], threads: int) -> float:
    """Seconds for the save's two hashes then the store pattern per object, on one thread
    per object (no encoding, no kvpack per-chunk code) + one dir fsync: what a save on
    these threads costs if only the hashing is added to the pattern."""
    os.makedirs(directory)
    key = os.urandom(32)

    def one(i: int) -> None:
        hmac.new(key, memoryview(objects[i])[4096:], hashlib.sha256).digest()
        hashlib.sha256(objects[i]).digest()
        atomic_write(os.path.join(directory, f"c{i:06d}"), objects[i], mode=0o600, sync_dir=False, replace=False)

    return _timed_per_object(directory, len(objects), threads, one)


def _timed_per_object(directory: str, count: int, threads: int, one) -> float:
    """Seconds for ``one(i)`` of every object on ``threads`` threads, then one fsync of
    ``directory`` (the shape every create-only pattern here shares)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))
    _fsync_dir(directory)
    return time.perf_counter() - t0


def write_plain(directory: str, objects: list[bytes], threads: int) -> float:
    """Seconds for open O_EXCL + write + fsync + close per object + one dir fsync."""
    os.makedirs(directory)

    def one(i: int) -> None:
        fd = os.open(os.path.join(directory, f"c{i:06d}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(objects[i])
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(objects))))
    _fsync_dir(directory)
    return time.perf_counter() - t0


def write_batched_fsync(directory: str, objects: list[bytes], threads: int) -> float:
    """Seconds for: every temp file written (no fsync), then fsync + close of each from the
    pool, then link + unlink of each, then one dir fsync (same durability order per file)."""
    os.makedirs(directory)
    names = [os.path.join(directory, f"c{i:06d}") for i in range(len(objects))]
    temps = [temp_path_for(n) for n in names]

    def write(i: int) -> int:
        fd = os.open(temps[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        view = memoryview(objects[i])
        while view:
            view = view[os.write(fd, view) :]
        return fd

    def sync(fd: int) -> None:
        os.fsync(fd)
        os.close(fd)

    def publish(i: int) -> None:
        os.link(temps[i], names[i])
        os.unlink(temps[i])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        fds = list(pool.map(write, range(len(objects))))
        list(pool.map(sync, fds))
        list(pool.map(publish, range(len(objects))))
    _fsync_dir(directory)
    return time.perf_counter() - t0


def write_o_tmpfile(directory: str, objects: list[bytes], threads: int) -> float:
    """Seconds for O_TMPFILE + write + fsync + linkat(/proc/self/fd) per object + one dir
    fsync (raises OSError where the filesystem has no O_TMPFILE)."""
    os.makedirs(directory)
    # a directory descriptor makes os.link call linkat(AT_SYMLINK_FOLLOW), which links the
    # file /proc/self/fd/N names (plain link() would link the proc symlink: EXDEV)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

    def one(i: int) -> None:
        fd = os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600)
        try:
            view = memoryview(objects[i])
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
            os.link(f"/proc/self/fd/{fd}", f"c{i:06d}", dst_dir_fd=dfd, follow_symlinks=True)
        finally:
            os.close(fd)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(objects))))
        os.fsync(dfd)
        return time.perf_counter() - t0
    finally:
        os.close(dfd)


def hash_two_passes(objects: list[bytes], threads: int) -> float:
    """Seconds for HMAC-SHA-256 over each object's payload plus SHA-256 over the object."""
    key = os.urandom(32)

    def one(obj: bytes) -> None:
        hmac.new(key, memoryview(obj)[4096:], hashlib.sha256).digest()
        hashlib.sha256(obj).digest()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, objects))
    return time.perf_counter() - t0


def save_once(root: str, session, chunk_bytes: int, workers: int) -> tuple[float, PackStore, object]:
    store = PackStore.init(root, chunk_bytes=chunk_bytes)
    store.workers = workers
    t0 = time.perf_counter()
    report = store.save(session)
    return time.perf_counter() - t0, store, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--gib", type=float, default=0.25, help="KV bytes of the saved cut")
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="store workers (the save uses publish.save_threads of them)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=None, help="also append the JSON line to this file")
    args = ap.parse_args()

    tokens = max(256, int(args.gib * (1 << 30)) // TOKEN_BYTES // 256 * 256)
    layout = array_layout(layers=8, kv_heads=8, head_dim=32, dtype="f32", vocab=256)
    eng = ArrayEngine(layout, name="bench-store-write")
    ids = [(i * 7 + 3) % 256 for i in range(tokens)]
    session = eng.new_session()
    session.prefill(ids)
    chunk_bytes = int(args.chunk_mib * (1 << 20))
    base = args.dir or tempfile.mkdtemp(prefix="kvpack-bench-sw-")
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=base)
    timings: dict[str, list[float]] = {"save": [], "store_pattern": [], "hash_then_pattern": [], "plain": [], "batched_fsync": [], "o_tmpfile": [], "hash": []}
    line: dict = {
        "bench": "store_write",
        "tokens": tokens,
        "chunk_bytes": chunk_bytes,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_1m_start": round(os.getloadavg()[0], 2),
    }
    try:
        objects: list[bytes] = []
        for r in range(args.repeat):
            seconds, store, report = save_once(os.path.join(work, f"store{r}"), session, chunk_bytes, args.workers)
            timings["save"].append(seconds)
            threads = save_threads(store)
            if not objects:
                names = sorted(i.name for i in store.env.list("chunks/") if not i.name.rpartition("/")[2].startswith("."))
                objects = [bytes(store.env.read(n)) for n in names]
                hit = store.find_deepest(ids, layout, eng.ids())
                live = eng.new_session()
                store.restore(hit, live, ids)
                line.update(
                    bit_identical=live.cache_digest() == session.cache_digest(),
                    chunks=len(objects),
                    chunks_written=report.chunks_written,
                    object_bytes=sum(len(o) for o in objects),
                    save_threads=threads,
                )
            shutil.rmtree(os.path.join(work, f"store{r}"))
            for kind, fn in (
                ("store_pattern", write_store_pattern),
                ("hash_then_pattern", write_hash_then_pattern),
                ("plain", write_plain),
                ("batched_fsync", write_batched_fsync),
                ("o_tmpfile", write_o_tmpfile),
            ):
                d = os.path.join(work, f"{kind}{r}")
                try:
                    timings[kind].append(fn(d, objects, threads))
                except OSError as exc:  # O_TMPFILE unsupported here
                    line[f"{kind}_error"] = str(exc)
                shutil.rmtree(d, ignore_errors=True)
            timings["hash"].append(hash_two_passes(objects, threads))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    gb = line["object_bytes"] / 1e9
    for kind, secs in timings.items():
        line[f"{kind}_s"] = [round(s, 4) for s in secs]
        line[f"{kind}_gbps"] = round(gb / statistics.median(secs), 3) if secs else None
    line["save_over_store_pattern"] = round(line["save_gbps"] / line["store_pattern_gbps"], 3)
    line["save_over_plain"] = round(line["save_gbps"] / line["plain_gbps"], 3)
    line["save_over_hash"] = round(line["save_gbps"] / line["hash_gbps"], 3)
    # above ~0.9: the save costs what hashing on the writer threads costs (stage the hashes
    # apart from the writes to go further); well below: kvpack's per-chunk work is the gap
    line["save_over_hash_then_pattern"] = round(line["save_gbps"] / line["hash_then_pattern_gbps"], 3)
    line["batched_over_store_pattern"] = round(line["batched_fsync_gbps"] / line["store_pattern_gbps"], 3)
    if line["o_tmpfile_gbps"]:
        line["o_tmpfile_over_store_pattern"] = round(line["o_tmpfile_gbps"] / line["store_pattern_gbps"], 3)
    line["load_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(line, sort_keys=True)
    print(text)
    sys.stdout.flush()
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
