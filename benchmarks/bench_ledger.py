"""Replay-ledger reservation latency with the rollback witness, against the ledger write alone.

A reservation sits on the commit path between the verified seal and the ACK. Since issue 15 it
writes the ledger durably (temp, write, fsync, rename, directory fsync) and then the witness
(temp, write, fsync, rename; its rename made durable by the next directory fsync). The peer
measured in the same run, on the same directory, is the old reservation's I/O: the ledger's
``atomic_write`` alone. Samples alternate (ledger-only, reservation, ...) so both see the same
disk weather.

Prints ONE JSON line: medians and p99 (nearest rank) of each, and ``ratio`` = median
reservation / median ledger-only write (the witness's relative cost).

    python3 benchmarks/bench_ledger.py [--n 400] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time

from kvpack.durable import atomic_write
from kvpack.security.ledger import ReplayLedger, encode_ledger


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="reservations (and as many peer writes)")
    ap.add_argument("--dir", default=None, help="directory to measure (default: a temp dir)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvpack-bench-ledger-") as tmp:
        peer_path = os.path.join(tmp, "peer-ledger.json")
        reserve_ms: list[float] = []
        peer_ms: list[float] = []
        with ReplayLedger.open(os.path.join(tmp, "replay-ledger.json")) as led:
            for g in range(1, args.n + 1):
                body = encode_ledger({"prefill-a-to-decode-a:1": g})
                t0 = time.perf_counter_ns()
                atomic_write(peer_path, body)
                t1 = time.perf_counter_ns()
                led.reserve("prefill-a-to-decode-a", 1, g)
                t2 = time.perf_counter_ns()
                peer_ms.append((t1 - t0) / 1e6)
                reserve_ms.append((t2 - t1) / 1e6)
    line = {
        "bench": "ledger_reserve_with_witness",
        "n": args.n,
        "reserve_median_ms": round(statistics.median(reserve_ms), 4),
        "reserve_p99_ms": round(_p99(reserve_ms), 4),
        "ledger_only_median_ms": round(statistics.median(peer_ms), 4),
        "ledger_only_p99_ms": round(_p99(peer_ms), 4),
        "ratio": round(statistics.median(reserve_ms) / statistics.median(peer_ms), 3),
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
