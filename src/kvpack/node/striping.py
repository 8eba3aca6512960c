"""Striped handoff: one session's transfer split over N connections, committed once.

Why it exists: one TLS stream is bounded by one core's decryption and hashing; a large
handoff moves faster over several connections (benchmarks/bench_handoff_procs.py). kvpack
stripes *without weakening anything*:

* **Negotiation** (control plane): the receiver asks with the request extension
  ``kvpack_stripes: N``; a kvpack producer that honours it sends ``k = min(N, its own
  maximum, segments in the schedule)`` stripes; a strict upstream producer refuses the
  unknown key before ``accepted`` and the receiver retries with one stream (nothing was sent).
* **Each stripe is a whole Handoff V2 transfer**: its own begin, generation (taken durably by
  the producer), transfer id ``<request_id>-<generation>-s<index>.<k>`` (so the binding of
  errata M8 holds and the receiver learns the stripe from the sealed begin), its own seal
  and HMAC, its own replay-ledger reservation. Stripe ``i`` carries the span schedule's
  segments ``[i::k]`` in order, which the receiver's schedule witness enforces
  (``ReceiverConfig.stripe``).
* **One install, one commit**: every stripe writes its verified segments into one detached
  install (:class:`SharedInstall`); a stripe that verified its seal and reserved its
  generation *arrives* at the commit barrier; the last arrival proves the install complete
  and commits it; only then do the stripes acknowledge. Any stripe's refusal (or the
  deadline) aborts the install for all: nothing is installed, every stripe is refused.

In place: when the node can map a segment onto the install's rows (``targets``; the
arrays engine hands out row views), the stripe's sink gives the handoff receiver the
segment's destination pieces (:mod:`kvpack.handoff.target`) once its header passed the
checks, the payload is read straight into the detached install, and the verified segment
only marks its rows written (``landed``): no staging buffer, no scatter copy. Bytes that
fail their digest were written into rows nothing counts, of an install the refusal aborts.

Writes: an install that declares ``concurrent_row_writes`` (disjoint rows from several
threads are safe: the arrays engine) takes every stripe's segments at once; any other
install takes one write at a time. A stripe's sink may write a segment *asynchronously*
(on the node's install pool) while its connection reads the next one -- the handoff
receiver then keeps two payload buffers (``payload_buffers=2``) and the sink waits for the
previous write before it starts the next, before ``prepare`` and before ``abort``, so a
payload buffer is never refilled while it is still being written from. An abort waits for
the writes in flight before the install is dropped.

What it must never do: commit before every stripe verified and reserved, acknowledge a
stripe whose install did not commit, or accept a stripe of another prompt into the install.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Callable, Optional

from ..errors import EngineError, ProtocolError
from ..handoff.manifest import BeginManifestV2, SegmentDescriptorV2
from ..handoff.target import PayloadTarget

_STRIPE_SUFFIX = re.compile(r"-(\d{1,20})-s(\d{1,2})\.(\d{1,2})\Z")


def stripe_transfer_id(request_id: str, generation: int, index: int, count: int) -> str:
    """The transfer id of stripe ``index`` of ``count`` (``count == 1``: the plain form)."""
    if count == 1:
        return f"{request_id}-{generation}"
    return f"{request_id}-{generation}-s{index}.{count}"


def parse_stripe(request_id: str, transfer_id: str) -> Optional[tuple[int, int]]:
    """``(index, count)`` of a striped transfer id of ``request_id``; None for a plain one."""
    if not transfer_id.startswith(request_id + "-"):
        return None
    m = _STRIPE_SUFFIX.search(transfer_id[len(request_id) :])
    if m is None:
        return None
    index, count = int(m.group(2)), int(m.group(3))
    if not 0 <= index < count or count < 2:
        raise ProtocolError("identity", f"transfer id {transfer_id!r} names stripe {index} of {count}")
    return index, count


def stripe_count(requested: int, producer_max: int, segments: int) -> int:
    """How many stripes a producer sends: never more than asked, allowed or segments."""
    return max(1, min(requested, producer_max, segments))


class SharedInstall:
    """One detached engine install fed by ``count`` stripes, committed once.

    ``open_install(manifest, prefix_cut)`` opens the engine install (and copies a delta's
    held prefix) for the first stripe; ``scatter(install, descriptor, payload)`` writes one
    verified segment. Both come from the node, so this class knows no engine.
    """

    def __init__(
        self,
        count: int,
        open_install: Callable[[BeginManifestV2, int], Any],
        scatter: Callable[[Any, SegmentDescriptorV2, memoryview], None],
        deadline: float,
        targets: Optional[Callable[[Any, SegmentDescriptorV2], Optional[list[memoryview]]]] = None,
        landed: Optional[Callable[[Any, SegmentDescriptorV2], None]] = None,
    ) -> None:
        self.count = count
        self._open = open_install
        self._scatter = scatter
        self._targets = targets
        self._landed = landed
        self.deadline = deadline  # monotonic: every stripe must have arrived by then
        self.install: Any = None
        self._key: Optional[tuple] = None
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        self._writers = threading.Condition()  # writes in flight (``_active``) vs an abort
        self._active = 0
        self.concurrent = False  # set from the install once it is open
        self.joined: set[int] = set()
        self.arrived: set[int] = set()
        self.failed: Optional[str] = None
        self.committed = False
        self.t: dict[str, float] = {}

    def join(self, index: int, manifest: BeginManifestV2, prefix_cut: int) -> None:
        key = (manifest.position, manifest.prompt_token_ids, manifest.identity, manifest.components, manifest.hmac, prefix_cut)
        with self._cond:
            self._raise_if_failed()
            if index in self.joined or not 0 <= index < self.count:
                raise ProtocolError("sequence", f"stripe {index} of {self.count} joined twice or out of range")
            if self.install is None:
                self.install = self._open(manifest, prefix_cut)
                self.concurrent = bool(getattr(self.install, "concurrent_row_writes", False))
                self._key = key
            elif key != self._key:
                raise ProtocolError("identity", f"stripe {index} describes another prompt, identity or key than the first stripe")
            self.joined.add(index)

    def write(self, descriptor: SegmentDescriptorV2, payload: memoryview) -> None:
        if not self.concurrent:
            with self._write_lock:  # installs are not required to take concurrent writers
                self._raise_if_failed()
                self._scatter(self.install, descriptor, payload)
            return
        with self._writers:
            self._raise_if_failed()
            self._active += 1
        try:
            self._scatter(self.install, descriptor, payload)  # disjoint rows: stripes at once
        finally:
            with self._writers:
                self._active -= 1
                self._writers.notify_all()

    def target(self, descriptor: SegmentDescriptorV2) -> Optional[PayloadTarget]:
        """The segment's destination pieces in the install (claimed), or None: stage it.
        Only installs that take concurrent writers hand out rows (disjoint per stripe)."""
        if self._targets is None or self._landed is None or not self.concurrent:
            return None
        with self._writers:
            self._raise_if_failed()
            self._active += 1
        try:
            pieces = self._targets(self.install, descriptor)
        finally:
            with self._writers:
                self._active -= 1
                self._writers.notify_all()
        return None if pieces is None else PayloadTarget(pieces, token=descriptor)

    def land(self, descriptor: SegmentDescriptorV2, target: PayloadTarget) -> None:
        """A segment read into :meth:`target`'s pieces verified: its rows count as written."""
        if target.token is not descriptor or self._landed is None:
            raise ProtocolError("sink", "a verified payload target that this install did not hand out", remote=False)
        with self._writers:
            self._raise_if_failed()
            self._active += 1
        try:
            self._landed(self.install, descriptor)
        finally:
            with self._writers:
                self._active -= 1
                self._writers.notify_all()

    def arrive(self, index: int) -> None:
        """Stripe ``index`` verified its seal and reserved its generation: wait until every
        stripe did, then the last one commits. Raises if any stripe failed meanwhile."""
        with self._cond:
            self._raise_if_failed()
            self.arrived.add(index)
            if len(self.arrived) == self.count:
                self._commit_locked()
                return
            while not self.committed and self.failed is None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._fail_locked(f"{self.count - len(self.arrived)} of {self.count} stripes did not arrive before the deadline")
                    break
                self._cond.wait(left)
            self._raise_if_failed()

    def _commit_locked(self) -> None:
        self.t["prepare0"] = time.perf_counter()
        try:
            gaps = self.install.missing()
            if gaps:
                layer, role, left = gaps[0]
                raise EngineError("install", f"{len(gaps)} planes incomplete after every stripe (layer {layer} {role}: {left} rows)")
            self.t["prepare1"] = self.t["commit0"] = time.perf_counter()
            self.install.commit(require_logits=False)  # the receiver decodes the boundary token itself
        except BaseException as exc:
            self._fail_locked(f"{type(exc).__name__}: {exc}")
            raise
        self.committed = True
        self.t["commit1"] = time.perf_counter()
        self._cond.notify_all()

    def fail(self, reason: str) -> None:
        """A stripe was refused or the request was cancelled: abort the install for all."""
        with self._cond:
            self._fail_locked(reason)

    def _fail_locked(self, reason: str) -> None:
        if self.committed or self.failed is not None:
            return
        with self._writers:
            self.failed = reason[:500]  # no write starts from here on
            while self._active:  # writes in flight are bounded copies: let them end
                self._writers.wait(1.0)
        if self.install is not None:
            with self._write_lock:
                try:
                    self.install.abort()
                except Exception:  # noqa: BLE001 - the refusal that got us here is what counts
                    pass
        self._cond.notify_all()

    def _raise_if_failed(self) -> None:
        if self.failed is not None:
            raise ProtocolError("sink", f"another stripe was refused: {self.failed}", remote=False)


class StripeSink:
    """The handoff ``Sink`` of one stripe (``count == 1``: a plain transfer) over a
    :class:`SharedInstall`: ``commit`` is the stripe's arrival at the commit barrier.

    With ``executor`` a segment is written there while the connection reads the next one
    (the receiver must then run with ``payload_buffers=2``); at most one write is in flight."""

    def __init__(self, shared: SharedInstall, index: int, executor: Optional[Executor] = None) -> None:
        self.shared = shared
        self.index = index
        self.executor = executor
        self._inflight: Optional[Future[None]] = None
        self.t: dict[str, float] = {}
        self.in_place = 0  # segments read straight into the install (receipts say so)

    def begin(self, manifest: BeginManifestV2, prefix_cut: int) -> None:
        self.shared.join(self.index, manifest, prefix_cut)

    def payload_target(self, descriptor: SegmentDescriptorV2) -> Optional[PayloadTarget]:
        return self.shared.target(descriptor)

    def write_segment(self, descriptor: SegmentDescriptorV2, payload: "memoryview | PayloadTarget") -> None:
        self._settle()  # the previous segment's buffer is free only once its write ended
        if isinstance(payload, PayloadTarget):  # already in place: count its rows
            self.shared.land(descriptor, payload)
            self.in_place += 1
            return
        if self.executor is None:
            self.shared.write(descriptor, payload)
            return
        self._inflight = self.executor.submit(self.shared.write, descriptor, payload)

    def _settle(self) -> None:
        """Wait for the write in flight; its failure is this stripe's refusal."""
        pending, self._inflight = self._inflight, None
        if pending is not None:
            pending.result()

    def prepare(self) -> None:
        self._settle()
        # this stripe's share is complete (the schedule witness proved it at the seal); the
        # whole install's completeness is proven once, at the barrier
        self.t["prepare0"] = self.t["prepare1"] = time.perf_counter()

    def commit(self) -> None:
        self.t["commit0"] = time.perf_counter()
        self.shared.arrive(self.index)
        self.t["commit1"] = time.perf_counter()

    def abort(self) -> None:
        try:
            self._settle()
        except Exception:  # noqa: BLE001 - the refusal that got us here is what counts
            pass
        self.shared.fail(f"stripe {self.index} refused")
