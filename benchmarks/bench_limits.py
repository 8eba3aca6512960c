"""Benchmark: the floors a restore and a save are compared with, measured on this machine.

One JSON line (``bench: limits``) with, over files of the store's object size:

* ``read_warm_gbps``: page cache -> host memory, the fastest of ``readv`` (``os.readv``
  into a pinned buffer on ``--threads`` threads), ``readinto`` (a Python file object's) and
  ``processes`` (``os.readv`` in ``--threads`` processes into one shared memfd, as the
  restore's reader processes read; threads of one interpreter hand the GIL over at every
  system call, which on the H200 host caps them far below the copy rate);
* ``read_cold_gbps`` (buffered ``readv``, page cache dropped first) and
  ``read_cold_odirect_gbps`` (``O_DIRECT`` into the same aligned pinned buffer): the disk;
* ``h2d_gbps``: one pinned host-to-device copy of ``--h2d-mib``;
* ``gpu_sha256``: one launch of the GPU SHA-256 kernel (kvpack.engine.gpu_digest) over
  ``2 * files`` messages of the object size already on the device (a restore's two hashes
  per chunk): seconds and GB/s, per message size in ``--hash-mib``;
* ``write_gbps``: the store's durable write pattern without hashing or encoding: each
  object written through ``kvpack.durable.atomic_write`` exactly as a save writes a chunk
  (temp file, write, fsync, link, unlink the temp name; no directory fsync) on
  ``publish.save_threads`` threads, then one directory fsync.

The functions are importable: bench_gpu measures the same floors over each cut's own
files and reports its restore and save as ratios of them. Without CUDA the GPU fields are
null (a CPU dry run still measures reads and writes).

    python3 benchmarks/bench_limits.py --dir /var/tmp/kvl --object-mib 1 --total-gib 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096


def drop_page_cache(paths: list[str]) -> str:
    """Empty the page cache of ``paths``; returns the method that worked (``drop_caches``
    as root, else ``posix_fadvise`` per file)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise_dontneed"


_buffers: dict[tuple[int, bool], object] = {}


def _host_buffer(nbytes: int, pin: bool):
    """Page-aligned host memory (O_DIRECT needs it): pinned on CUDA, an anonymous map else;
    kept per size (pinning gigabytes takes seconds)."""
    import mmap

    import torch

    key = (nbytes, pin)
    if key not in _buffers:
        if pin:
            _buffers[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            _buffers[key] = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)
    return _buffers[key]


#: Bytes of the pinned buffer reads land in (slots wrap around in it): as large as a
#: restore's staging would be, without pinning a whole 17 GB cut (that takes ~25 s).
READ_BUFFER_BYTES = 2 << 30


def _slots(paths: list[str], limit: int = READ_BUFFER_BYTES) -> tuple[list[tuple[int, int]], int]:
    """``(offset, aligned size)`` of each file in a buffer of at most ``limit`` bytes
    (wrapping around), and the buffer size needed."""
    slots, at, high = [], 0, 0
    for path in paths:
        size = -(-os.path.getsize(path) // ALIGN) * ALIGN
        if at + size > limit:
            at = 0
        slots.append((at, size))
        at += size
        high = max(high, at)
    return slots, high


def read_files(paths: list[str], threads: int, method: str = "readv", buf=None) -> tuple[float, int]:
    """Read every file whole into its slot of one (pinned) buffer on ``threads`` threads:
    ``(seconds, bytes)``. ``method``: ``readv`` (os.readv, the store's read), ``readinto``
    (a Python file object) or ``odirect`` (O_DIRECT: the disk, never the page cache)."""
    slots, total = _slots(paths)
    own = buf is None
    if own:
        buf = _host_buffer(total, pin=_cuda())
    view = memoryview(buf.numpy())
    sizes = [0] * len(paths)

    def one(i: int) -> None:
        lo, size = slots[i]
        region = view[lo : lo + size]
        if method == "readinto":
            with open(paths[i], "rb", buffering=0) as fh:
                n = 0
                while got := fh.readinto(region[n:]):
                    n += got
        else:
            flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if method == "odirect" else 0)
            fd = os.open(paths[i], flags)
            try:
                n = 0
                while n < len(region):
                    got = os.readv(fd, [region[n:]])
                    if not got:
                        break
                    n += got
            finally:
                os.close(fd)
        sizes[i] = n

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(len(paths))))
        elapsed = time.perf_counter() - t0
    if own:
        del buf
    return elapsed, sum(sizes)


_CHILD = r"""
import mmap, os, pickle, sys
fd, nbytes = int(sys.argv[1]), int(sys.argv[2])
view = memoryview(mmap.mmap(fd, nbytes))
jobs = pickle.load(sys.stdin.buffer)
sys.stdout.write("ready\n"); sys.stdout.flush()
while sys.stdin.readline():
    total = 0
    for path, lo, size in jobs:
        fd2 = os.open(path, os.O_RDONLY)
        try:
            n = 0
            while n < size:
                got = os.readv(fd2, [view[lo + n : lo + size]])
                if not got:
                    break
                n += got
        finally:
            os.close(fd2)
        total += n
    sys.stdout.write(f"{total}\n"); sys.stdout.flush()
"""


def read_files_processes(paths: list[str], processes: int, rounds: int = 3) -> list[tuple[float, int]]:
    """Like :func:`read_files` (readv, warm) but in ``processes`` worker processes that map
    one shared staging buffer (a memfd), as the restore's persistent reader processes do:
    no shared GIL. One ``(seconds from the go signal to the last file, bytes)`` per round;
    the first round also maps the pages (a restore's first use)."""
    import mmap
    import pickle
    import subprocess

    slots, total = _slots(paths)
    fd = os.memfd_create("kvpack-limits")
    os.ftruncate(fd, total)
    keep = mmap.mmap(fd, total)  # the parent's mapping: the pages are shared, not copied
    shares = [[(paths[i], slots[i][0], slots[i][1]) for i in range(k, len(paths), processes)] for k in range(processes)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(fd), str(total)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), text=False)
        for _ in range(processes)
    ]
    runs = []
    try:
        for proc, share in zip(procs, shares):
            proc.stdin.write(pickle.dumps(share))
            proc.stdin.flush()
        for proc in procs:
            assert proc.stdout.readline().strip() == b"ready"
        for _ in range(rounds):
            t0 = time.perf_counter()
            for proc in procs:
                proc.stdin.write(b"go\n")
                proc.stdin.flush()
            got = sum(int(proc.stdout.readline()) for proc in procs)
            runs.append((time.perf_counter() - t0, got))
    finally:
        for proc in procs:
            proc.stdin.close()
            proc.wait()
        keep.close()
        os.close(fd)
    return runs


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def h2d_rate(nbytes: int, repeat: int = 4) -> float | None:
    """GB/s of one pinned host-to-device copy of ``nbytes`` (median)."""
    if not _cuda():
        return None
    import torch

    host = _host_buffer(nbytes, pin=True)
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del host, dev
    return nbytes / statistics.median(times[1:]) / 1e9


def gpu_sha256(message_bytes: int, count: int, repeat: int = 3, distinct: int = 4096) -> dict | None:
    """One launch hashing ``count`` messages of ``message_bytes`` on the device: the
    kernel's latency and rate at a restore's message size (random data, checked). At most
    ``distinct`` different buffers: further messages reread them (the kernel only reads)."""
    if not _cuda():
        return None
    import hashlib

    import torch

    from kvpack.engine import gpu_digest

    if gpu_digest.available("cuda") is not None:
        return {"error": gpu_digest.available("cuda")}
    stride = -(-message_bytes // ALIGN) * ALIGN
    unique = min(count, distinct)
    data = torch.randint(0, 256, (unique * stride,), dtype=torch.uint8, device="cuda")
    table = torch.tensor([[data.data_ptr() + (i % unique) * stride, 0, message_bytes, 0] for i in range(count)], dtype=torch.int64, device="cuda")
    out = torch.empty((count, 8), dtype=torch.int32, device="cuda")
    gpu_digest.launch(table, out, count)
    torch.cuda.synchronize()
    words = out.cpu().numpy().view("uint32")
    for i in (0, count - 1):
        j = i % unique
        assert gpu_digest.digest_bytes(words[i]) == hashlib.sha256(data[j * stride : j * stride + message_bytes].cpu().numpy().tobytes()).digest()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gpu_digest.launch(table, out, count)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    t = statistics.median(times)
    del data, table, out
    torch.cuda.empty_cache()
    return {"message_bytes": message_bytes, "messages": count, "launch_s": round(t, 4), "gbps": round(count * message_bytes / t / 1e9, 2)}


def durable_write_rate(directory: str, object_bytes: int, count: int, threads: int) -> dict:
    """The store's chunk write pattern without its hashing: ``count`` distinct objects of
    ``object_bytes`` through ``atomic_write(create_only, no directory fsync)`` on
    ``threads`` threads, then one directory fsync (what ``env.commit`` does)."""
    from kvpack.durable import atomic_write, sync_dir

    os.makedirs(directory, exist_ok=True)
    base = os.urandom(object_bytes)
    payloads = [i.to_bytes(8, "little") + base[8:] for i in range(min(count, 64))]  # distinct pages, no dedup anywhere

    def one(i: int) -> None:
        atomic_write(os.path.join(directory, f"o{i:06d}"), payloads[i % len(payloads)], mode=0o600, sync_dir=False, replace=False)

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(count)))
        sync_dir(directory)
        elapsed = time.perf_counter() - t0
    shutil.rmtree(directory, ignore_errors=True)
    return {"write_gbps": round(count * object_bytes / elapsed / 1e9, 3), "write_s": round(elapsed, 3), "write_objects": count, "write_threads": threads}


def make_files(directory: str, object_bytes: int, count: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    block = os.urandom(object_bytes)
    paths = []
    for i in range(count):
        path = os.path.join(directory, f"f{i:06d}")
        with open(path, "wb") as fh:
            fh.write(i.to_bytes(8, "little") + block[8:])
        paths.append(path)
    os.sync()
    return paths


def read_floors(paths: list[str], threads: int, repeat: int = 3, cold: bool = True) -> dict:
    """Warm reads (both methods, median of ``repeat``) and cold reads (buffered and
    O_DIRECT) of ``paths`` into one pinned buffer."""
    _slots_, total = _slots(paths)
    buf = _host_buffer(total, pin=_cuda())
    out: dict = {"read_bytes": 0, "read_files": len(paths), "read_threads": threads}
    read_files(paths, threads, "readv", buf)  # page cache warm
    for method in ("readv", "readinto"):
        runs = [read_files(paths, threads, method, buf) for _ in range(repeat)]
        out["read_bytes"] = runs[0][1]
        out[f"read_warm_{method}_s"] = round(statistics.median(t for t, _ in runs), 4)
        out[f"read_warm_{method}_gbps"] = round(runs[0][1] / statistics.median(t for t, _ in runs) / 1e9, 2)
    runs = read_files_processes(paths, threads, repeat + 1)[1:]  # the first round maps the pages
    out["read_warm_processes_s"] = round(statistics.median(t for t, _ in runs), 4)
    out["read_warm_processes_gbps"] = round(runs[0][1] / statistics.median(t for t, _ in runs) / 1e9, 2)
    # the floor: the fastest way this machine moves these files into host memory
    best = min(("readv", "readinto", "processes"), key=lambda m: out[f"read_warm_{m}_s"])
    out["read_warm_method"] = best
    out["read_warm_s"] = out[f"read_warm_{best}_s"]
    out["read_warm_gbps"] = out[f"read_warm_{best}_gbps"]
    if cold:
        out["cold_method"] = drop_page_cache(paths)
        t, n = read_files(paths, threads, "readv", buf)
        out["read_cold_s"], out["read_cold_gbps"] = round(t, 4), round(n / t / 1e9, 3)
        drop_page_cache(paths)
        try:
            t, n = read_files(paths, threads, "odirect", buf)
            out["read_cold_odirect_s"], out["read_cold_odirect_gbps"] = round(t, 4), round(n / t / 1e9, 3)
        except OSError as exc:  # a filesystem without O_DIRECT
            out["read_cold_odirect_error"] = str(exc)[:80]
    del buf
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="scratch directory on the store's filesystem")
    ap.add_argument("--object-mib", type=float, default=1.0, help="chunk plaintext MiB (objects are 8 KiB larger)")
    ap.add_argument("--total-gib", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="read threads (the restore's workers)")
    ap.add_argument("--write-threads", type=int, default=None, help="default: what a save with --threads workers uses")
    ap.add_argument("--hash-mib", default="1,2,4", help="message sizes for the GPU SHA-256 line")
    ap.add_argument("--h2d-mib", type=int, default=1024)
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tempfile

    from kvpack.format import constants as C

    root = args.dir or tempfile.mkdtemp(prefix="kvpack-limits-")
    object_bytes = -(-(C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES + int(args.object_mib * (1 << 20))) // ALIGN) * ALIGN
    count = max(1, int(args.total_gib * (1 << 30)) // object_bytes)
    write_threads = args.write_threads or (1 if args.threads <= 1 else 2 * args.threads)
    line: dict = {"bench": "limits", "object_bytes": object_bytes, "objects": count, "cpus": os.cpu_count()}
    line.update(durable_write_rate(os.path.join(root, "w"), object_bytes, count, write_threads))
    paths = make_files(os.path.join(root, "r"), object_bytes, count)
    line.update(read_floors(paths, args.threads, cold=not args.skip_cold))
    shutil.rmtree(os.path.join(root, "r"), ignore_errors=True)
    rate = h2d_rate(args.h2d_mib << 20)
    line["h2d_gbps"] = round(rate, 2) if rate else None
    hashes = []
    for mib in [float(x) for x in args.hash_mib.split(",") if x]:
        msg = -(-(C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES + int(mib * (1 << 20))) // ALIGN) * ALIGN
        n = 2 * max(1, int(args.total_gib * (1 << 30)) // msg)
        got = gpu_sha256(msg, n)
        if got is not None:
            hashes.append(got)
    line["gpu_sha256"] = hashes or None
    text = json.dumps(line, sort_keys=True)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
