"""The decode node's replay ledger as the handoff core's ``ReplayGate``, with self-healing.

Why it exists: a reservation that fails (full disk, EIO) latches the ledger degraded, and
every later transfer is refused -- correctly, since a ledger that failed to be durable cannot
prove freshness. Before, the latch held until a restart, so one full disk (filled by anyone)
took the node out for good. :class:`LedgerGuard` lets the latch clear itself: an admission
that finds the ledger latched re-probes its volume (the exact reservation pattern, a few
samples, at most once per ``reprobe_interval_s``) and hands a passing probe to
:meth:`kvpack.security.ledger.ReplayLedger.clear_degraded`, which re-reads the file and
refuses a rollback. Freeing space heals the node; a volume that still fails keeps refusing.

Refusals for an unavailable ledger carry their own category, ``ledger_unavailable``, on the
wire-facing ``ProtocolError`` as well: they say "this node cannot reserve now", not "someone
replayed a transfer" (``replay``, which operators page on).

Every wait is bounded (issue 14): the ledger refuses ``ledger_unavailable`` when its lock or
a reservation's write outlives ``ReplayLedger.io_deadline_s`` (a hung volume latches it), and
the guard never probes a volume while a ledger write on it is still outstanding, runs each
probe on a helper thread it waits for at most ``probe_deadline_s``, and waits for another
thread's probe at most as long. A hung ledger volume therefore costs each admission a bounded
wait and a refusal, never a thread of the node.

What it must never do: admit while the ledger is latched, or clear the latch without a fresh
passing probe of the ledger's own directory.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from ..durable import call_with_deadline
from ..errors import KvpackError, ProtocolError, SecurityError
from ..security.ledger import ReplayLedger
from ..security.probe import ProbeResult, check_ledger_volume

log = logging.getLogger("kvpack.node.ledger")

#: the recovery probe asks "does the volume write again", not "is it fast enough to start on":
#: a loaded but working disk must not keep a healed node refusing
RECOVERY_MAX_TAIL_MS = 2000.0
RECOVERY_SAMPLES = 3
#: the longest a recovery probe (and clearing the latch) may take before it counts as failed
PROBE_DEADLINE_S = 10.0


class LedgerGuard:
    """One replay ledger and the rule that heals its degraded latch."""

    def __init__(
        self,
        ledger: ReplayLedger,
        *,
        reprobe_interval_s: float = 2.0,
        probe: Callable[[str], ProbeResult] | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe_deadline_s: float = PROBE_DEADLINE_S,
    ) -> None:
        self.ledger = ledger
        self.reprobe_interval_s = reprobe_interval_s
        self.probe_deadline_s = probe_deadline_s
        self._probing: Optional[threading.Thread] = None
        self._probe = probe or (lambda path: check_ledger_volume(path, iterations=RECOVERY_SAMPLES, max_tail_ms=RECOVERY_MAX_TAIL_MS))
        self._clock = clock
        self._lock = threading.Lock()
        self._last_attempt = -1e18
        self.recoveries = 0
        self.last_probe_error: Optional[str] = None

    def ensure_available(self) -> None:
        """Return if the ledger can reserve; else try to heal it, or refuse
        ``ProtocolError('ledger_unavailable')``."""
        if self.ledger.degraded is None:
            return
        if not self.recover():
            why = self.ledger.degraded or "unknown"
            extra = f"; last probe: {self.last_probe_error}" if self.last_probe_error else ""
            raise ProtocolError("ledger_unavailable", f"replay ledger latched degraded ({why}){extra}", remote=False)

    def recover(self) -> bool:
        """Re-probe the ledger's volume (rate-limited, bounded) and clear the latch if it
        passes. False (refuse) when it did not pass, or could not be tried in time."""
        if self.ledger.degraded is None:
            return True
        if not self._lock.acquire(timeout=self.probe_deadline_s):
            return False  # another admission's probe outlived our deadline
        try:
            if self.ledger.degraded is None:
                return True
            if self.ledger.io_outstanding:  # a hung write: probing that volume would hang too
                self.last_probe_error = "a write to the ledger volume has not returned (hung volume)"
                return False
            if self._probing is not None and self._probing.is_alive():
                self.last_probe_error = f"the previous volume probe has not returned after {self.probe_deadline_s:g} s (hung volume)"
                return False
            now = self._clock()
            if now - self._last_attempt < self.reprobe_interval_s:
                return False
            self._last_attempt = now

            def attempt() -> None:
                probe = self._probe(self.ledger.path)
                self.ledger.clear_degraded(probe, max_tail_ms=RECOVERY_MAX_TAIL_MS)

            try:
                stuck = call_with_deadline(attempt, self.probe_deadline_s, name="kvpack-ledger-probe")
            except KvpackError as exc:
                self.last_probe_error = f"{exc.category}: {exc.message}"[:300]
                return False
            except OSError as exc:  # pragma: no cover - the probe maps its own I/O errors
                self.last_probe_error = f"{type(exc).__name__}: {exc}"[:300]
                return False
            if stuck is not None:
                self._probing = stuck
                self.last_probe_error = f"the volume probe did not return within {self.probe_deadline_s:g} s (hung volume)"
                return False
            self.recoveries += 1
            self.last_probe_error = None
            log.warning("replay ledger %s healed: volume probe passed, degraded latch cleared", self.ledger.path)
            return True
        finally:
            self._lock.release()


def _unavailable(exc: SecurityError) -> ProtocolError:
    return ProtocolError("ledger_unavailable", exc.message, remote=False)


class LedgerGate:
    """The ``ReplayGate`` of one transfer: admission through the guard, reservation timed.

    ``on_reserve(ok, seconds)`` records the reservation (metrics); ``t`` keeps the
    reservation's perf-counter stamps for the receipt's phase split.
    """

    def __init__(self, guard: LedgerGuard, on_reserve: Callable[[bool, float], None] | None = None) -> None:
        self.guard = guard
        self.on_reserve = on_reserve
        self.t: dict[str, float] = {}

    def admit(self, key_id: str, epoch: int, generation: int) -> None:
        self.guard.ensure_available()
        try:
            self.guard.ledger.admit(key_id, epoch, generation)
        except SecurityError as exc:
            if exc.category == "ledger_unavailable":
                raise _unavailable(exc) from exc
            raise

    def reserve(self, key_id: str, epoch: int, generation: int) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            self.guard.ensure_available()
            self.guard.ledger.reserve(key_id, epoch, generation)
            ok = True
        except SecurityError as exc:
            if exc.category == "ledger_unavailable":
                raise _unavailable(exc) from exc
            raise
        finally:
            t1 = time.perf_counter()
            self.t["reserve0"], self.t["reserve1"] = t0, t1
            if self.on_reserve is not None:
                self.on_reserve(ok, t1 - t0)
