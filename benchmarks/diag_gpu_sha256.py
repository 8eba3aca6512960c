"""Diagnostic: the GPU SHA-256 kernel (kvpack.engine.gpu_digest) against hashlib.

For each job count, one launch hashing that many independent 4 MiB messages already on the
device; prints one JSON line with the launch time (median of device-event timings), the
aggregate rate, and, in the same run, hashlib's one-thread rate and the rate of
``--threads`` hashlib threads over the same bytes on the host (the CPU peer). Every digest
of the first launch is checked against hashlib.

    python3 benchmarks/diag_gpu_sha256.py --jobs 1,64,512,2048,8192
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="1,64,512,2048,8192")
    ap.add_argument("--mib", type=int, default=4, help="bytes per message (MiB)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)

    import torch

    from kvpack.engine import gpu_digest

    counts = [int(x) for x in args.jobs.split(",") if x]
    size = args.mib << 20
    reason = gpu_digest.available("cuda")
    if reason:
        print(json.dumps({"bench": "gpu_sha256", "error": reason}))
        return 1
    most = max(counts)
    data = torch.randint(0, 256, (most * size + 3,), dtype=torch.uint8, device="cuda")
    host_sample = data[: min(most, 256) * size + 3].cpu().numpy()
    for count in counts:
        table = torch.tensor([[data.data_ptr() + i * size + (i % 4), 0, size, 0] for i in range(count)], dtype=torch.int64, device="cuda")
        out = torch.empty((count, 8), dtype=torch.int32, device="cuda")
        gpu_digest.launch(table, out, count)
        torch.cuda.synchronize()
        words = out.cpu().numpy().view("uint32")
        for i in range(min(count, 256)):
            want = hashlib.sha256(host_sample[i * size + (i % 4) : (i + 1) * size + (i % 4)].tobytes()).digest()
            assert gpu_digest.digest_bytes(words[i]) == want, i
        times = []
        for _ in range(args.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            gpu_digest.launch(table, out, count)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = statistics.median(times)
        print(
            json.dumps({"bench": "gpu_sha256", "jobs": count, "message_bytes": size, "launch_s": round(t, 4), "gpu_gbps": round(count * size / t / 1e9, 2)}),
            flush=True,
        )
    # the CPU peer over host copies of the same messages
    msgs = [host_sample[i * size : (i + 1) * size].tobytes() for i in range(min(most, 64))]
    t0 = time.perf_counter()
    for m in msgs[:8]:
        hashlib.sha256(m).digest()
    one = 8 * size / (time.perf_counter() - t0)
    with ThreadPoolExecutor(args.threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda m: hashlib.sha256(m).digest(), msgs))
        many = len(msgs) * size / (time.perf_counter() - t0)
    print(
        json.dumps({"bench": "cpu_sha256", "threads": args.threads, "one_thread_gbps": round(one / 1e9, 2), "all_threads_gbps": round(many / 1e9, 2)}),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
