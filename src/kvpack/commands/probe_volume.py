"""``kvpack probe-volume DIR``: measure the replay-ledger reservation pattern on a directory.

The operator twin of the receiver's bind-time gate (:mod:`kvpack.security.probe`): it runs the
exact reservation (temp file, write 4 KiB, fsync, rename, directory fsync) ``--iterations`` times
and exits 1 when the worst sample exceeds ``--max-tail-ms``, because the tail, not the median,
is what stalls a commit path.
"""

from __future__ import annotations

import argparse
import json

from ._args import existing_dir, int_range, nonneg_float


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("probe-volume", help="probe a directory's durable-rename latency tail")
    parser.add_argument("dir", type=existing_dir, help="directory to probe (where the replay ledger will live)")
    parser.add_argument("--iterations", type=int_range(1, 100000, what="a count"), default=20, help="reservations to time")
    parser.add_argument("--max-tail-ms", type=nonneg_float, default=100.0, help="worst sample allowed, in milliseconds")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ..security.probe import probe_volume

    result = probe_volume(args.dir, iterations=args.iterations)
    ok = result.max_ms <= args.max_tail_ms
    if args.json:
        doc = result.to_json()
        doc["max_tail_ms"] = args.max_tail_ms
        doc["ok"] = ok
        print(json.dumps(doc, sort_keys=True))
    else:
        print(
            f"{result.directory}: {len(result.samples_ms)} reservations, min {result.min_ms:.3f} ms, "
            f"median {result.median_ms:.3f} ms, p99 {result.p99_ms:.3f} ms, max {result.max_ms:.3f} ms "
            f"(limit {args.max_tail_ms:g} ms): {'ok' if ok else 'TOO SLOW'}"
        )
    if not ok:
        from ..errors import SecurityError

        raise SecurityError(
            "volume",
            f"worst reservation {result.max_ms:.3f} ms exceeds --max-tail-ms {args.max_tail_ms:g}: "
            "a replay ledger here would stall commits; keep it on the internal disk",
        )
    return 0
