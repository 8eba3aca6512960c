"""Decode slots: the engine sessions a decode node serves concurrent requests with.

Why it exists: the decode node used to hold one live session and serve one request at a
time, so one slow (or abandoned) request stalled everyone. Now it holds ``count`` sessions;
each request borrows one for its whole life (plan, transfer into a detached install of that
session, boundary token, decode) and gives it back. A request prefers the free slot whose
session already holds the longest prefix of its prompt (the *live* tier of the reuse
ladder), else the least recently used one. Waiting for a slot has a deadline and stops as
soon as the request is cancelled, so a full node answers "busy" instead of queueing forever.
A decode from a named (received) session holds a slot as well while it runs (the slot's own
session untouched): the slot count bounds every decode in flight.

What it must never do: lend one session to two requests at once, or wait without a deadline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..errors import NetworkError
from .ladder import common_prefix
from .local_api import NEVER, CancelToken


@dataclass
class Slot:
    """One engine session and what the ladder may reuse of it."""

    index: int
    session: Any
    #: tokens of the session computed by prefill or install (decoded continuations are not
    #: reusable: a cut reached one decode step at a time is not what a chunked prefill computes)
    live_prefilled: int = 0
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def live_match(self, tokens: Sequence[int]) -> int:
        held = list(self.session.tokens)[: self.live_prefilled]
        return common_prefix(held, tokens)


class DecodeSlots:
    """``count`` sessions of one engine, lent one request at a time."""

    def __init__(self, new_session: Callable[[], Any], count: int) -> None:
        if count < 1:
            raise ValueError("at least one decode slot")
        self.slots = [Slot(i, new_session()) for i in range(count)]
        self._cond = threading.Condition()

    def acquire(self, tokens: Sequence[int], *, wait_s: float, cancel: CancelToken = NEVER) -> Slot:
        """The best free slot for ``tokens``; waits up to ``wait_s`` (refused ``timeout``).

        A decode from a named (received) session takes a slot too (``tokens`` empty: the
        least recently used free slot), for the cap, not for its session; it gives it back
        with ``release(slot, touched=False)``, so that slot stays as old as it was."""
        end = time.monotonic() + wait_s
        with self._cond:
            while True:
                cancel.check()
                free = [s for s in self.slots if not s.busy]
                if free:
                    best = max(free, key=lambda s: (s.live_match(tokens), -s.last_used))
                    best.busy = True
                    return best
                left = end - time.monotonic()
                if left <= 0:
                    raise NetworkError("timeout", f"all {len(self.slots)} decode slots stayed busy for {wait_s:g} s; retry later")
                self._cond.wait(min(left, 0.1))

    def release(self, slot: Slot, *, touched: bool = True) -> None:
        with self._cond:
            slot.busy = False
            if touched:
                slot.last_used = time.monotonic()
            self._cond.notify()

    def busy(self) -> int:
        with self._cond:
            return sum(s.busy for s in self.slots)

    def snapshot(self) -> list[dict]:
        with self._cond:
            return [{"slot": s.index, "busy": s.busy, "position": getattr(s.session, "position", None), "prefilled": s.live_prefilled} for s in self.slots]

    def first(self) -> Optional[Slot]:
        return self.slots[0] if self.slots else None
