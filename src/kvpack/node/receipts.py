"""Receipts and refusal logs that cannot take a node down.

Why this module exists: every transfer leaves evidence (DESIGN.md principle 7), but evidence
is written to a disk an attacker can fill. A flood of refused connections once wrote one
fsynced receipt file each (656/s), filled the disk, and the next legitimate transfer then
latched the replay ledger degraded; a failed receipt write killed the producer's control
thread and hung the local API. So the rules here are:

* **Receipts are budgeted.** :class:`ReceiptWriter` publishes each receipt durably
  (``kvpack.durable.atomic_write``) but bounds every field before it is written (a 64 MiB
  ``request_id`` becomes 128 characters), keeps the directory under a byte, file-count and
  age budget by deleting the oldest receipts (rotation), and rate-limits *refusal* receipts
  (a token bucket): refusals beyond the rate are counted in the refusal log instead.
* **Writes never raise.** A full or failing disk costs the one receipt (counted in
  :attr:`ReceiptWriter.failures`, logged at most once per interval); it never kills a
  thread, never blocks a request on an exception path, and never touches the ledger.
* **Writes never hold a reply for long.** A receipt is an audit record, the replay ledger
  the safety record: receipts are written by the writer's own thread from a bounded queue,
  and a reply waits for its receipt at most ``ReceiptBudget.wait_s`` (1 s). A hung disk (an
  fsync that never returns) makes later receipts ``pending`` -- the reply goes out, the
  receipt is written when the disk answers -- and past the in-memory budget
  (``max_pending`` receipts, ``max_pending_bytes``) receipts are dropped and counted.
* **Refusals before authentication are aggregated.** A peer that has not passed mutual TLS
  gets no receipt: :class:`RefusalLog` counts it by reason, remembers the last detail, and
  writes one summary line per interval to the log and to a size-capped file
  (``refusals.log``, rotated once to ``refusals.log.1``) -- from its own writer thread, so a
  hung disk never stops a listener's accept thread.

What it must never do: raise out of a write, write an unbounded field, or grow the directory
past its budget.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..durable import REAL_OPS, FileOps, atomic_write, call_with_deadline, ensure_dir

RECEIPT_SCHEMA = "kvpack-node-receipt-v1"
RECENT_RECEIPTS = 256
#: longest string kept in a receipt field (details, ids); longer ones are cut with a marker
MAX_FIELD_CHARS = 2048
#: longest list kept in a receipt (control frames, refusals); the rest is counted
MAX_LIST_ITEMS = 256
#: a receipt larger than this after bounding is replaced by its summary fields
MAX_RECEIPT_BYTES = 256 << 10
_NAME_PART = re.compile(r"[^a-z0-9_]")
log = logging.getLogger("kvpack.node.receipts")


@dataclass(frozen=True)
class ReceiptBudget:
    """How much receipt evidence a node keeps (docs/operations.md, "Receipts and logs").

    ``max_bytes``/``max_files``: the oldest receipts are deleted once either is exceeded;
    ``max_age_s``: receipts older than this are deleted (checked at most once a minute);
    ``refusals_per_s``/``refusal_burst``: refusal receipts beyond this rate are only counted;
    ``wait_s``: the longest a reply waits for its receipt (then it goes out, the receipt
    ``pending``); ``max_pending``/``max_pending_bytes``: receipts held in memory for a disk
    that does not answer (beyond them a receipt is dropped and counted).
    """

    max_bytes: int = 256 << 20
    max_files: int = 100_000
    max_age_s: float = 14 * 86400.0
    refusals_per_s: float = 20.0
    refusal_burst: int = 200
    #: how long a reply waits for its receipt to be on disk before it goes out without it
    wait_s: float = 1.0
    #: receipts held in memory while the disk does not answer; more are dropped (counted)
    max_pending: int = 1024
    max_pending_bytes: int = 32 << 20


def bound_fields(value: Any, depth: int = 0) -> Any:
    """``value`` with every string cut to :data:`MAX_FIELD_CHARS` and every list to
    :data:`MAX_LIST_ITEMS` (recursively, 8 levels): what a peer sent can be echoed into a
    receipt only in bounded form."""
    if isinstance(value, str):
        return value if len(value) <= MAX_FIELD_CHARS else value[:MAX_FIELD_CHARS] + f"...[{len(value) - MAX_FIELD_CHARS} more chars]"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    if depth >= 8:
        return "<nested too deep>"
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k)[:128]: bound_fields(v, depth + 1) for k, v in items[:MAX_LIST_ITEMS]}
        if len(items) > MAX_LIST_ITEMS:
            out["_truncated_keys"] = len(items) - MAX_LIST_ITEMS
        return out
    if isinstance(value, (list, tuple)):
        out_list = [bound_fields(v, depth + 1) for v in list(value)[:MAX_LIST_ITEMS]]
        if len(value) > MAX_LIST_ITEMS:
            out_list.append(f"...[{len(value) - MAX_LIST_ITEMS} more items]")
        return out_list
    return value


def _name_part(value: Any, default: str) -> str:
    text = _NAME_PART.sub("", str(value).lower())[:24]
    return text or default


class _TokenBucket:
    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self.tokens = float(burst)
        self.stamp = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class _Ticket:
    """One receipt on its way to the disk (serialized, named, bounded)."""

    __slots__ = ("name", "data", "body", "done", "state", "waited")

    def __init__(self, name: str, data: bytes, body: dict) -> None:
        self.name, self.data, self.body = name, data, body
        self.done = threading.Event()
        self.state = "pending"
        self.waited = True  # False once the caller gave up waiting (a late write)


class ReceiptWriter:
    """Per-transfer JSON receipts, each published durably, within a :class:`ReceiptBudget`,
    written by the writer's own thread.

    A receipt is an *audit* record; the replay ledger is the *safety* record. So a hung or
    failing receipts disk must never hold a reply: :meth:`record` serializes the bounded
    receipt on the caller's thread, queues it for the writer thread (at most
    ``budget.max_pending`` receipts and ``budget.max_pending_bytes`` held in memory; beyond
    that a receipt is dropped and counted) and waits at most ``budget.wait_s`` for it to be on
    disk -- not at all while the writer is already stuck past that deadline. A receipt not
    written in time is ``pending`` (written when the disk answers again: :attr:`late`), one that
    failed is ``failed``; either way the caller goes on. :meth:`record` and :meth:`write`
    never raise.
    """

    def __init__(self, directory: str, budget: ReceiptBudget = ReceiptBudget(), *, refusal_log: Optional["RefusalLog"] = None, ops: FileOps = REAL_OPS) -> None:
        self.directory = os.path.abspath(directory)
        ensure_dir(self.directory, mode=0o700)
        self.budget = budget
        self.refusal_log = refusal_log
        self.ops = ops
        #: summaries of the latest receipts (status page), newest last
        self.recent: collections.deque[dict] = collections.deque(maxlen=RECENT_RECEIPTS)
        self.failures = 0
        self.written = 0
        self.rotated = 0
        #: replies that went out before their receipt was on disk (``pending``)
        self.deferred = 0
        #: receipts written after their reply went out (the disk answered again)
        self.late = 0
        #: receipts dropped because the in-memory queue was full (or the writer closed)
        self.dropped = 0
        self.last_error: Optional[str] = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._held = 0  # receipts queued or being written (in memory)
        self._held_bytes = 0
        self._writer: Optional[threading.Thread] = None
        self._closed = False
        #: when the writer entered its current write (None: idle); the status page shows it
        self.writing_since: Optional[float] = None
        self._bucket = _TokenBucket(budget.refusals_per_s, budget.refusal_burst, time.monotonic)
        self._last_error_log = 0.0
        self._last_age_check = 0.0
        self._files: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0
        self._index()
        self._load_history()

    def _load_history(self) -> None:
        """The newest receipts' summaries for the status page, read once here (bounded: a
        receipts disk that does not answer within 2 s leaves the page without history), so
        that no page request ever reads the receipts disk."""
        from .status import load_recent_receipts

        loaded: list[dict] = []
        try:
            stuck = call_with_deadline(lambda: loaded.extend(load_recent_receipts(self.directory)), 2.0, name="kvpack-receipts-history")
        except Exception:  # noqa: BLE001 - history is a convenience
            return
        if stuck is None:
            self.recent.extend(loaded)

    def _index(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".json") and not n.startswith("."))
        except OSError:
            return
        for name in names:
            try:
                size = os.stat(os.path.join(self.directory, name)).st_size
            except OSError:
                continue
            self._files[name] = size
            self._bytes += size
        self._rotate()

    def write(self, receipt: dict, *, wait_s: Optional[float] = None) -> Optional[str]:
        """:meth:`record`, returning the receipt's path once it is on disk, else None (over
        the refusal rate, failed, dropped, or still pending after the wait)."""
        out = self.record(receipt, wait_s=wait_s)
        return out["receipt_path"] if out["receipt_state"] == "written" else None

    def record(self, receipt: dict, *, wait_s: Optional[float] = None) -> dict[str, Any]:
        """Queue one receipt and wait (at most ``wait_s``, default ``budget.wait_s``) for it
        to be published durably. Returns ``{"receipt_path", "receipt_state"}``: the state is
        ``written``, ``pending`` (queued or being written: the path it will have), ``failed``,
        ``dropped`` (the queue was full) or ``counted`` (over the refusal rate: only counted in
        the refusal log); the path is None unless written or pending."""
        try:
            return self._record(receipt, self.budget.wait_s if wait_s is None else wait_s)
        except Exception as exc:  # noqa: BLE001 - a receipt must never take the node down
            self._failed(exc)
            return {"receipt_path": None, "receipt_state": "failed"}

    def _record(self, receipt: dict, wait_s: float) -> dict[str, Any]:
        body = bound_fields({"schema": RECEIPT_SCHEMA, **receipt})
        refused = body.get("verdict") != "committed"
        if refused and not self._bucket.take():
            if self.refusal_log is not None:
                self.refusal_log.count(str(body.get("reason", "refused")), "receipt rate exceeded; counted only", str(body.get("detail", "")))
            return {"receipt_path": None, "receipt_state": "counted"}
        data = json.dumps(body, indent=2, sort_keys=True, default=str).encode() + b"\n"
        if len(data) > MAX_RECEIPT_BYTES:
            keep = {k: body.get(k) for k in ("schema", "role", "verdict", "reason", "detail", "phase", "request_id", "transfer_id", "payload_bytes")}
            data = json.dumps({**keep, "truncated": True}, indent=2, sort_keys=True, default=str).encode() + b"\n"
        name = f"{time.time_ns()}-{_name_part(body.get('role'), 'node')}-{_name_part(body.get('verdict'), 'x')}-{secrets.token_hex(3)}.json"
        path = os.path.join(self.directory, name)
        ticket = _Ticket(name, data, body)
        b = self.budget
        with self._lock:
            full = self._held >= b.max_pending or self._held_bytes + len(data) > b.max_pending_bytes
            if self._closed or full:
                self.dropped += 1
                why = "the receipt writer is closed" if self._closed else f"{self._held} receipts ({self._held_bytes} B) already wait for the disk"
            else:
                self._queue.append(ticket)
                self._held += 1
                self._held_bytes += len(data)
                self._cond.notify()
                if self._writer is None:
                    self._writer = threading.Thread(target=self._write_loop, name="kvpack-receipts", daemon=True)
                    self._writer.start()
                why = ""
            since = self.writing_since
        if why:
            self.last_error = f"receipt dropped: {why}"
            self._complain(self.last_error)
            return {"receipt_path": None, "receipt_state": "dropped"}
        # a writer stuck past the deadline makes every reply wait it out: do not wait then
        if since is not None and time.monotonic() - since >= wait_s:
            wait_s = 0.0
        if ticket.done.wait(max(0.0, wait_s)):
            return {"receipt_path": path if ticket.state == "written" else None, "receipt_state": ticket.state}
        with self._lock:
            if not ticket.done.is_set():
                ticket.waited = False
                self.deferred += 1
        if ticket.done.is_set():  # written just now
            return {"receipt_path": path if ticket.state == "written" else None, "receipt_state": ticket.state}
        self._complain(f"receipt {name} not on disk after {wait_s:g} s: replied without it (written when the disk answers)")
        return {"receipt_path": path, "receipt_state": "pending"}

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                ticket = self._queue.popleft()
                self.writing_since = time.monotonic()
            state = "failed"
            try:
                atomic_write(os.path.join(self.directory, ticket.name), ticket.data, mode=0o600, ops=self.ops)
                state = "written"
            except Exception as exc:  # noqa: BLE001 - the writer never dies
                self._failed(exc)
            if state == "written":
                with self._lock:
                    self._files[ticket.name] = len(ticket.data)
                    self._bytes += len(ticket.data)
                    self.written += 1
                    self._rotate()
                try:  # before the caller hears of it: the status page and the log have it then
                    self._announce(ticket.body, ticket.name)
                except Exception:  # noqa: BLE001 - a log handler must not stop the writer
                    pass
            with self._lock:
                self.writing_since = None
                self._held -= 1
                self._held_bytes -= len(ticket.data)
                ticket.state = state
                if state == "written" and not ticket.waited:
                    self.late += 1
                ticket.done.set()
                self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait at most ``timeout`` s until every queued receipt was written (or failed)."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._held:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Write what is queued (waiting at most ``timeout``), then end the writer thread (at
        once, or when a hung write returns); receipts recorded later are dropped (counted)."""
        self.drain(timeout)
        with self._lock:
            self._closed = True
            left = self._held
            self._cond.notify_all()
        if left:
            self._complain(f"{left} receipts were still waiting for the disk at close and are lost")

    def _announce(self, body: dict, name: str) -> None:
        from ..logs import event
        from .status import summarize_receipt

        summary = summarize_receipt(body, name[: -len(".json")])
        self.recent.append(summary)
        event(log, "transfer", level=logging.INFO if summary["verdict"] == "committed" else logging.WARNING, **summary)

    def _rotate(self) -> None:
        """Delete the oldest receipts until the directory is within its budget (call with the
        lock held, or from the constructor)."""
        b = self.budget
        now = time.time()
        expired_before = None
        if now - self._last_age_check > 60.0:
            self._last_age_check = now
            expired_before = int((now - b.max_age_s) * 1e9)
        while self._files and (self._bytes > b.max_bytes or len(self._files) > b.max_files or _older(next(iter(self._files)), expired_before)):
            name, size = self._files.popitem(last=False)
            self._bytes -= size
            try:
                os.unlink(os.path.join(self.directory, name))
                self.rotated += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._failed(exc)
                break

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:500]
        self._complain(self.last_error)

    def _complain(self, error: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= 10.0:  # at most one line per 10 s, however many fail
            self._last_error_log = now
            from ..logs import event

            event(
                log,
                "receipt_write_failed",
                level=logging.ERROR,
                error=error[:500],
                failures=self.failures,
                deferred=self.deferred,
                dropped=self.dropped,
                pending=self._held,
                directory=self.directory,
            )

    def stats(self) -> dict[str, Any]:
        with self._lock:
            since = self.writing_since
            return {
                "files": len(self._files),
                "bytes": self._bytes,
                "written": self.written,
                "rotated": self.rotated,
                "failures": self.failures,
                "pending": self._held,
                "pending_bytes": self._held_bytes,
                "deferred": self.deferred,
                "late": self.late,
                "dropped": self.dropped,
                "writer_stuck_s": None if since is None else round(time.monotonic() - since, 3),
                "last_error": self.last_error,
                "budget": {
                    "max_bytes": self.budget.max_bytes,
                    "max_files": self.budget.max_files,
                    "max_age_s": self.budget.max_age_s,
                    "wait_s": self.budget.wait_s,
                    "max_pending": self.budget.max_pending,
                    "max_pending_bytes": self.budget.max_pending_bytes,
                },
            }

    def all(self) -> list[dict]:
        out = []
        for name in sorted(os.listdir(self.directory)):
            if name.endswith(".json") and not name.startswith("."):
                with open(os.path.join(self.directory, name), "rb") as fh:
                    out.append(json.loads(fh.read()))
        return out


def _older(name: str, before_ns: Optional[int]) -> bool:
    if before_ns is None:
        return False
    stamp = name.split("-", 1)[0]
    return stamp.isdigit() and int(stamp) < before_ns


class RefusalLog:
    """Aggregated refusals (connections that never authenticated, and refusals beyond the
    receipt rate): counters by reason, the last detail of each, one summary line per
    ``interval_s`` to the log and to ``path`` (capped at ``max_bytes``, rotated once).

    :meth:`count` is called on a listener's accept thread: it is a lock and a dict update,
    never I/O. The summary lines are written by the log's own *writer thread* (started on
    the first summary due): a hung or slow disk (or log handler) stalls only that thread;
    the counts keep accumulating in memory (bounded: one counter and one 200-character
    detail per reason) and go out in the next line once the disk answers. A failing write
    costs the line (``write_failures``), never a refusal count (the metrics have them).
    """

    #: how long :meth:`flush` waits for the writer by default (a node's stop on a hung disk)
    FLUSH_WAIT_S = 2.0

    def __init__(
        self, role: str, path: Optional[str] = None, *, interval_s: float = 10.0, max_bytes: int = 1 << 20, on_count: Optional[Callable[[str], None]] = None
    ) -> None:
        self.role = role
        self.path = path
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self.on_count = on_count
        self.totals: collections.Counter[str] = collections.Counter()
        self._window: collections.Counter[str] = collections.Counter()
        self._last: dict[str, str] = {}
        self._lock = threading.Lock()
        self._flushed = time.monotonic()
        self.write_failures = 0
        #: summary lines written (to the log and, with ``path``, appended to the file)
        self.lines_written = 0
        self._wake = threading.Event()
        self._done = threading.Condition(self._lock)
        self._requested = 0  # flush requests made; the writer answers them in order
        self._answered = 0
        self._last_line: Optional[dict] = None
        self._writer: Optional[threading.Thread] = None
        self._closed = False
        #: True while the writer is inside a write (the status page shows a stuck disk)
        self.writing_since: Optional[float] = None

    def count(self, reason: str, detail: str = "", peer: str = "") -> None:
        reason = _name_part(reason, "refused")
        with self._lock:
            self.totals[reason] += 1
            self._window[reason] += 1
            self._last[reason] = (f"{peer}: " if peer else "") + detail[:200]
            due = time.monotonic() - self._flushed >= self.interval_s
            if due:
                self._flushed = time.monotonic()  # one wake per interval, however many count
        if self.on_count is not None:
            try:
                self.on_count(reason)
            except Exception:  # noqa: BLE001 - metrics must not break the accept path
                pass
        if due:
            self._kick()
        elif self._writer is None:
            self._start_writer()  # it writes what is left once the interval passed

    def _start_writer(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name=f"kvpack-{self.role}-refusals", daemon=True)
                self._writer.start()
        return True

    def _kick(self) -> bool:
        """Wake the writer thread (start it first if needed); never waits for it. False
        once closed (no writer will answer)."""
        if self._start_writer():
            self._wake.set()
            return True
        return False

    def _write_loop(self) -> None:
        while True:
            # woken for a due summary or a flush; else every interval it writes what is left
            # of a burst (refusals counted after the last line, with none since to wake it)
            woke = self._wake.wait(max(self.interval_s, 0.05))
            self._wake.clear()
            with self._lock:
                upto = self._requested
                left_over = bool(self._window) and time.monotonic() - self._flushed >= self.interval_s
            if not woke and not left_over:
                continue
            try:
                line = self._write_summary()
            except Exception:  # noqa: BLE001 - the writer never dies; the counters stay
                line = None
                self.write_failures += 1
            with self._lock:
                self._last_line = line
                self._answered = max(self._answered, upto)
                self._done.notify_all()
                if self._closed:
                    return

    def _write_summary(self) -> Optional[dict]:
        with self._lock:
            self._flushed = time.monotonic()
            if not self._window:
                return None
            line = {
                "event": "refusals",
                "role": self.role,
                "unix_ms": time.time_ns() // 1_000_000,
                "counts": dict(self._window),
                "last": {k: self._last.get(k, "") for k in self._window},
            }
            self._window.clear()
        from ..logs import event

        self.writing_since = time.monotonic()
        try:
            event(log, "refusals", level=logging.WARNING, **{k: v for k, v in line.items() if k != "event"})
            self._append(json.dumps(line, sort_keys=True).encode() + b"\n")
        finally:
            self.writing_since = None
        self.lines_written += 1
        return line

    def flush(self, timeout: Optional[float] = None) -> Optional[dict]:
        """Have the writer write one summary of the refusals counted since the last one (if
        any) and wait for it at most ``timeout`` seconds (default :attr:`FLUSH_WAIT_S`).
        Returns the line written, or None (nothing to write, or the writer did not finish
        in time: a hung disk never holds the caller longer than ``timeout``)."""
        wait = self.FLUSH_WAIT_S if timeout is None else timeout
        with self._lock:
            self._requested += 1
            ticket = self._requested
        if not self._kick():
            return None  # closed: nothing more is written (a second stop returns at once)
        end = time.monotonic() + wait
        with self._lock:
            while self._answered < ticket:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._done.wait(left)
            return self._last_line

    def close(self, timeout: Optional[float] = None) -> None:
        """Write the last summary (waiting at most ``timeout``) and end the writer thread
        (at once, or when a hung write returns); later counts are only counted."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
        self._wake.set()

    def _append(self, data: bytes) -> None:
        if self.path is None:
            return
        try:
            try:
                size = os.stat(self.path).st_size
            except FileNotFoundError:
                size = 0
            if size + len(data) > self.max_bytes:
                os.replace(self.path, self.path + ".1")  # one old generation: 2x max_bytes at most
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError:
            self.write_failures += 1  # a log line lost; the counters (metrics) still have it

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            since = self.writing_since
            return {
                "totals": dict(self.totals),
                "last": dict(self._last),
                "write_failures": self.write_failures,
                "lines_written": self.lines_written,
                "writer_stuck_s": None if since is None else round(time.monotonic() - since, 3),
            }
