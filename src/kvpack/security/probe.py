"""The ledger-volume probe (INTEROP.md C.9 bind-time probe; seeds 003 §30.7, 004 §24.7).

Every reservation puts a file fsync *and* a directory fsync on the commit path, between the
verified seal and the ACK. A volume whose directory fsync has a slow tail (the seed's evidence
volume: median 0.22 ms, tail ~0.7 s) stalls first decode at random. So a receiver measures its
ledger's directory with the exact reservation pattern before it binds, and refuses to start when
the worst of 20 samples exceeds 100 ms. What matters is the tail, not the average.

Each sample times one :func:`kvpack.durable.atomic_write` of 4096 zero bytes to
``ledger-probe-<pid>-<i>`` in the ledger's directory (temp file O_EXCL 0600, write, fsync, rename,
directory fsync: the very code path :meth:`ReplayLedger.reserve` runs); the file is removed after
the sample, outside the timed window.

It must never leave probe files behind or time anything but the reservation's own write path.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

from ..durable import REAL_OPS, FileOps, atomic_write
from ..errors import DurableIOError, SecurityError

PROBE_ITERATIONS = 20
PROBE_MAX_TAIL_MS = 100.0
PROBE_BYTES = 4096


@dataclass(frozen=True)
class ProbeResult:
    directory: str
    samples_ms: tuple[float, ...]

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def p99_ms(self) -> float:
        # Nearest-rank percentile: with fewer than 100 samples this is the maximum, which is the
        # honest answer (we have not observed anything rarer than 1 in n).
        ordered = sorted(self.samples_ms)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    def to_json(self) -> dict[str, object]:
        return {
            "directory": self.directory,
            "iterations": len(self.samples_ms),
            "min_ms": round(self.min_ms, 4),
            "median_ms": round(self.median_ms, 4),
            "p99_ms": round(self.p99_ms, 4),
            "max_ms": round(self.max_ms, 4),
            "samples_ms": [round(s, 4) for s in self.samples_ms],
        }


def probe_volume(
    directory: str | os.PathLike[str],
    *,
    iterations: int = PROBE_ITERATIONS,
    ops: FileOps = REAL_OPS,
) -> ProbeResult:
    """Run the reservation pattern ``iterations`` times in ``directory``; return the samples."""
    if iterations < 1:
        raise SecurityError("config", f"probe iterations must be >= 1, got {iterations}")
    target_dir = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(target_dir):
        raise SecurityError("volume", f"probe directory {target_dir!r} does not exist")
    payload = bytes(PROBE_BYTES)
    samples: list[float] = []
    pid = os.getpid()
    for i in range(iterations):
        target = os.path.join(target_dir, f"ledger-probe-{pid}-{i}")
        start = time.perf_counter_ns()
        try:
            atomic_write(target, payload, ops=ops)
        except DurableIOError as exc:
            raise SecurityError("volume", f"ledger volume probe failed in {target_dir!r}: {exc}") from exc
        samples.append((time.perf_counter_ns() - start) / 1e6)
        try:
            ops.unlink(target)
        except OSError:
            pass
    return ProbeResult(target_dir, tuple(samples))


def check_ledger_volume(
    ledger_path: str | os.PathLike[str],
    *,
    iterations: int = PROBE_ITERATIONS,
    max_tail_ms: float = PROBE_MAX_TAIL_MS,
    ops: FileOps = REAL_OPS,
) -> ProbeResult:
    """Bind-time gate: probe the ledger's directory; refuse when the worst sample is too slow."""
    directory = os.path.dirname(os.path.abspath(os.fspath(ledger_path)))
    result = probe_volume(directory, iterations=iterations, ops=ops)
    if result.max_ms > max_tail_ms:
        raise SecurityError(
            "volume",
            f"replay ledger volume {directory!r} is too slow for the commit path: worst of "
            f"{len(result.samples_ms)} reservations took {result.max_ms:.1f} ms (limit "
            f"{max_tail_ms:g} ms, median {result.median_ms:.2f} ms). Move replay_ledger to the "
            f"internal disk (check a directory with: kvpack probe-volume DIR)",
        )
    return result
