"""What the installing thread spends handing a device-verified restore's reads to the reader
processes, per protocol (CPU only, no processes: the messages are built and pickled exactly
as ``chunk_readers._write_frame`` would, then dropped).

``items``: per-chunk tuples in batches to the least busy worker (one message per batch);
``table``: one message per worker with its slice of the first wave, then one with its
slices of every other wave the ring gave (WaveSlice, plain bytes). Both run the pipeline's own code (``DeviceVerifiedPipeline.submit_planned``) over
the same jobs in the same run. One JSON line.

    python3 benchmarks/bench_read_submit.py --chunks 2048 --waves 8 --workers 16
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from concurrent.futures import Future
from types import SimpleNamespace


class _PicklingReaders:
    """Stands in for chunk_readers.ReaderPool: pickles each message, counts its bytes."""

    def __init__(self, workers: int) -> None:
        self.workers, self.messages, self.bytes = workers, 0, 0

    def live(self) -> int:
        return self.workers

    def _frame(self, message) -> None:
        self.messages += 1
        self.bytes += len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def submit(self, cid, ctx, geometry, items) -> Future:
        self._frame(("batch", 0, cid, geometry, items))
        return Future()

    def submit_slices(self, worker_index, cid, ctx, parts) -> list[Future]:
        self._frame(("slices", cid, [(k, g, p) for k, (g, p) in enumerate(parts)]))
        return [Future() for _ in parts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=2048)
    ap.add_argument("--waves", type=int, default=8)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import numpy as np

    from kvpack.engine.restore import ChunkJob, DeviceVerifiedPipeline, RestoreTuning
    from kvpack.format.objects import ChunkRef, Span, StateKey

    manifest = SimpleNamespace(family=None)
    obj = (2 << 20) + 4112
    jobs = [
        ChunkJob(
            manifest,
            StateKey(i % 32, "k" if i % 2 else "v"),
            Span(16 * i, 16, 0, 2 << 20),
            ChunkRef(os.urandom(32), os.urandom(32), os.urandom(32), 0, 2 << 20, obj),
            16 * i,
            16 * i + 16,
        )
        for i in range(args.chunks)
    ]
    per_wave = -(-args.chunks // args.waves)
    line: dict = {"bench": "read_submit", "chunks": args.chunks, "waves": args.waves, "workers": args.workers}
    for protocol in ("items", "table"):
        best = float("inf")
        for _ in range(args.repeat):
            pipe = DeviceVerifiedPipeline.__new__(DeviceVerifiedPipeline)
            pipe.tuning = RestoreTuning(workers=args.workers, read_submit=protocol)
            pipe.readers = _PicklingReaders(args.workers)
            pipe.ctx_id, pipe.ctx, pipe.timeline = 1, None, None
            pipe.family_index, pipe.state_names, pipe.worker_turn = {id(manifest): 0}, {}, 0
            pipe.spent, pipe.reading, pipe.pool, pipe.first_host = {"device_submit_s": 0.0}, [], None, args.chunks
            pipe.planned = []
            for lo in range(0, args.chunks, per_wave):
                n = min(per_wave, args.chunks - lo)
                offsets = np.arange(n + 1, dtype=np.int64) * (obj + 4096 - obj % 4096)
                wave = SimpleNamespace(offsets=offsets, starts=offsets.tolist(), sizes=[int(offsets[1])] * n, geometry=lambda: (0, 0, 0, 0, 0, 0))
                pipe.planned.append((wave, jobs[lo : lo + n], lo))
            if protocol == "items":  # the pipeline submits each wave as it takes it
                t0 = time.perf_counter()
                for entry in list(pipe.planned):
                    pipe.planned = [entry]
                    pipe.submit_planned()
            else:  # the first wave at once, then one flush for the others the ring gives
                rest = pipe.planned[1:]
                t0 = time.perf_counter()
                pipe.planned = pipe.planned[:1]
                pipe.submit_planned()
                pipe.planned = rest
                pipe.submit_planned()
            best = min(best, time.perf_counter() - t0)
        line[f"{protocol}_ms"] = round(best * 1e3, 3)
        line[f"{protocol}_messages"] = pipe.readers.messages
        line[f"{protocol}_message_bytes"] = pipe.readers.bytes
    line["table_over_items"] = round(line["table_ms"] / line["items_ms"], 3)
    print(json.dumps(line, sort_keys=True))


if __name__ == "__main__":
    main()
