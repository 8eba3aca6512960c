"""The prefill node (``kvpack producer``): control plane in, Handoff V2 out.

Figure 30.1 of seed 003, steps 1-6 and the answer, from this side:

1. the control listener (:class:`~kvpack.node.transport.Listener`, ALPN
   ``muser-prefill-control-v1``, mutual TLS, the receivers' leaves pinned) hands every
   authenticated connection to a worker; the worker reads one MUPCTL1 request V1 (C.14,
   errata M6 bounds) of at most :data:`~kvpack.node.control.MAX_REQUEST_BYTES` within
   ``request_read_s``, lifts the kvpack extensions it honours (``kvpack_prefix_cut``,
   ``kvpack_stripes``), takes a *prefill slot* (at most ``prefill_slots`` jobs at once; a
   full node answers ``failed: busy``) and answers ``accepted``. A control connection that
   becomes readable mid-job (the receiver went away or spoke) cancels the job (errata H2);
2. the request's tokens minus the held-back boundary token are prefilled exactly, in the
   engine's absolute 256-token chunks. A prefix this node computed before (in memory, or
   in its pack store) is installed instead of recomputed, so ``prefill_tokens`` in the
   receipt counts only what was really computed; tiles a resident prefix already holds are
   shipped from it at once, while the prefix is copied into the job's session;
3. it connects back to ``receiver_host:receiver_port`` on the data ALPN with its own leaf,
   pinning the receiver's leaf and checking its SAN (errata H1) -- once per stripe, every
   stripe at once under one deadline (``stripe_connect_s``); any stripe that fails aborts all;
4. each stripe's begin (deferred mode, as upstream's resident producer; ``prefix_cut`` when
   the receiver armed a delta valid for this prompt) leaves at once;
5. each tile leaves as soon as the prefill chunk that completes it ran, on the stripe it
   belongs to (tile ``j`` on stripe ``j mod k``): per stripe, a framing thread packs (a
   resident tile) and hashes it while the stripe's writer thread encrypts and writes the
   tile before it, and the next prefill chunk computes meanwhile;
6. every stripe seals and awaits exactly one ACK; then ``committed`` with the C.14 receipt.

Cache bytes never ride the control channel: control messages are the request, ``accepted``
and ``committed``/``failed`` (each recorded with its size in the producer receipt). A
``failed`` answer echoes the request id only when it is a valid C.14 id.

The generation ledger (``{"next_generation": N}``, C.9) is advanced durably *before* a
generation is used, so a crash can skip a generation but never reuse one; a striped job
takes its ``k`` generations in one durable write.

This module must never answer ``committed`` before every stripe's ACK, nor write a receipt
field it did not bound (the receipt writer bounds them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from ..durable import REAL_OPS, FileOps, atomic_write, call_with_deadline, ensure_dir
from ..errors import KvpackError, ProtocolError, SecurityError
from ..handoff import canonical_json as cj
from ..handoff.hashing import INLINE
from ..handoff.control import ControlDecoder, ControlReceipt, ControlRequestV1, ControlResponse
from ..handoff.manifest import PROTOCOL, BeginManifestV2, ComponentV2, HmacRef
from ..handoff.schedule import schedule_span
from ..handoff.sender import Sender
from ..security.config import ProducerConfig
from ..security.secret_files import load_hmac_key
from ..security.tls import client_context, connect, server_context
from ..vocab import FileLock, LockHeld, align_tokens_down, is_token_aligned, strict_json_loads
from .common import chunk_tokens, hash_workers, now_ms, read_control, readable, verdict_of
from .control import EXT_PREFIX_CUT, EXT_STRIPES, EXTENSIONS, MAX_REQUEST_BYTES, echo_id, split_extensions
from .ladder import ResidentRadix, RowsSource, window_covers
from .metrics import NodeMetrics
from .receipts import ReceiptBudget, ReceiptWriter, RefusalLog
from .status import attach_producer
from .striping import stripe_count, stripe_transfer_id
from .transport import Limits, Listener, bind_tcp
from .wire import TileGeometry, copy_prefix, pack_tile, span_layout, tile_pieces, wire_identity

log = logging.getLogger("kvpack.node.producer")

EXPIRY_MS = 900_000  # errata H3: prefilld's begin expires 900 s after creation
MAX_ERROR = 1024
ACK_WAIT_S = 60.0
#: one deadline for connecting all the stripes of a job, concurrently (TCP, TLS, begin)
STRIPE_CONNECT_S = 10.0
#: how long an abort lets the stripe threads stop on their own (they check every 0.1 s) before
#: it interrupts the channels of those still blocked in a write or an ack read
ABORT_GRACE_S = 1.0
#: the longest a request waits for an earlier job's prefix to enter the resident tier
REMEMBER_WAIT_S = 10.0
#: committed jobs that may wait for the remember thread (resident copy, store saves)
REMEMBER_QUEUE = 8
#: how long a job waits for the generation ledger (its lock, its durable write)
GENERATION_DEADLINE_S = 5.0


class GenerationLedger:
    """The producer's durable generation counter (C.9 ``{"next_generation": N}``).

    :meth:`take` persists ``N + 1`` (temp file, fsync, rename, directory fsync) and only then
    returns ``N``. An exclusive ``flock`` keeps a second producer process off the same file.

    Bounded (issue 14): a job waits for the lock and for the write at most ``deadline_s``,
    then is refused ``ledger_unavailable``. A write that did not return (a hung volume) leaves
    its generations unused but skipped in memory (never handed out: their durability is
    unknown), and every later take is refused at once until that write returned -- two
    writes in flight could land out of order and move the file backwards.
    """

    def __init__(self, path: str, *, ops: FileOps = REAL_OPS, deadline_s: float = GENERATION_DEADLINE_S) -> None:
        self.path = os.path.abspath(path)
        self.ops = ops
        self.deadline_s = deadline_s
        self._stuck: Optional[threading.Thread] = None
        ensure_dir(os.path.dirname(self.path), mode=0o700)
        self._lock = FileLock(self.path + ".lock")
        try:
            self._lock.acquire()
        except LockHeld:
            raise SecurityError("locked", f"generation ledger {self.path!r} is held by another producer") from None
        try:
            self.next = self._load()
        except BaseException:
            self._lock.release()  # a refused ledger leaves no lock behind
            raise
        self._mutex = threading.Lock()

    def _load(self) -> int:
        """The next generation the file holds (1 and a new file when there is none), or a
        typed ``ledger`` refusal: never a traceback for a damaged file."""
        if not os.path.exists(self.path):
            self._persist(1)
            return 1
        st = os.lstat(self.path)
        if not os.path.isfile(self.path) or os.path.islink(self.path) or st.st_mode & 0o077:
            raise SecurityError("ledger", f"generation ledger {self.path!r} must be a regular 0600 file")
        try:
            with open(self.path, "rb") as fh:
                obj = strict_json_loads(fh.read(4096))
        except ValueError as exc:  # truncated, garbage, not UTF-8 or nested too deeply
            raise SecurityError("ledger", f"generation ledger {self.path!r} is not valid ledger JSON: {exc}") from None
        except OSError as exc:
            raise SecurityError("ledger", f"generation ledger {self.path!r} cannot be read: {exc.strerror or exc}") from None
        n = obj.get("next_generation") if isinstance(obj, dict) and set(obj) == {"next_generation"} else None
        if type(n) is not int or n < 1:
            raise SecurityError("ledger", f"generation ledger {self.path!r} is malformed")
        return n

    def _persist(self, n: int) -> None:
        body = json.dumps({"next_generation": n}, sort_keys=True).encode() + b"\n"
        atomic_write(self.path, body, mode=0o600, ops=self.ops)

    def take(self) -> int:
        return self.take_many(1)[0]

    def take_many(self, n: int) -> list[int]:
        """``n`` consecutive generations, made durable in one write before any is used."""
        if not self._mutex.acquire(timeout=max(0.0, self.deadline_s)):
            raise SecurityError(
                "ledger_unavailable", f"generation ledger {self.path!r} busy for {self.deadline_s:g} s: a write has not returned (hung volume?)"
            )
        try:
            if self._stuck is not None and self._stuck.is_alive():
                raise SecurityError("ledger_unavailable", f"an earlier write of generation ledger {self.path!r} has not returned (hung volume)")
            gen = self.next
            stuck = call_with_deadline(lambda: self._persist(gen + n), self.deadline_s, name="kvpack-generation-io")
            if stuck is not None:
                self._stuck = stuck
                self.next = gen + n  # skipped, never handed out: the write may still land
                raise SecurityError("ledger_unavailable", f"generation ledger {self.path!r}: a write did not return within {self.deadline_s:g} s (hung volume)")
            self.next = gen + n
            return list(range(gen, gen + n))
        finally:
            self._mutex.release()

    def close(self) -> None:
        self._lock.release()


class _Cancelled(Exception):
    pass


@dataclass
class _StripeOut:
    """One stripe's data connection: its sender, queue of tiles and progress."""

    index: int
    sender: Sender
    channel: Any
    q: "queue.Queue[Any]" = field(default_factory=lambda: queue.Queue(maxsize=4))  # bounded: prefill never runs far ahead
    #: framed buffers for the writer thread: one framed tile waits while one is written
    out: "queue.Queue[Any]" = field(default_factory=lambda: queue.Queue(maxsize=1))
    wire_ns: int = 0
    first_segment_ns: int = 0
    acked_ns: int = 0
    error: Optional[BaseException] = None
    thread: Optional[threading.Thread] = None


class ProducerNode:
    """A prefill node: control listener, engine, generation ledger, reuse, metrics."""

    def __init__(
        self,
        config: ProducerConfig,
        engine=None,
        *,
        receipts_dir: str,
        store=None,
        metrics_port: Optional[int] = 0,
        resident_bytes: int = 1 << 30,
        pacing_bytes_per_s: Optional[float] = None,
        wire_tap=None,
        accept_prefix_cut_extension: bool = True,
        limits: Optional[Limits] = None,
        prefill_slots: int = 4,
        max_stripes: int = 8,
        stripe_connect_s: float = STRIPE_CONNECT_S,
        slot_wait_s: float = 10.0,
        request_read_s: float = 30.0,
        ledger_deadline_s: float = GENERATION_DEADLINE_S,
        ledger_ops: FileOps = REAL_OPS,
        receipt_wait_s: float = ReceiptBudget.wait_s,
    ) -> None:
        self.config = config
        #: how long a job waits for the generation ledger before it is answered failed
        self.ledger_deadline_s = ledger_deadline_s
        self._ledger_ops = ledger_ops
        # False behaves like the upstream prefill daemon, whose request V1 denies unknown
        # fields: a request with a kvpack extension key is answered "failed" before "accepted"
        self.extensions: tuple[str, ...] = EXTENSIONS if accept_prefix_cut_extension else ()
        self.accept_prefix_cut_extension = accept_prefix_cut_extension
        self.engine = engine
        self.store = store
        self.receipts_dir = receipts_dir
        self.refusal_log = RefusalLog("producer", os.path.join(os.path.abspath(receipts_dir), "refusals.log"))
        self.receipts = ReceiptWriter(receipts_dir, ReceiptBudget(wait_s=receipt_wait_s), refusal_log=self.refusal_log)
        self.metrics = NodeMetrics("producer")
        self.metrics.watch_receipts(self.receipts)
        self.refusal_log.on_count = self.metrics.refusal
        self._metrics_port = metrics_port
        self.resident = ResidentRadix(resident_bytes)
        self.pacing = pacing_bytes_per_s
        #: diagnostics: called with every buffer written on a data connection, in order
        self.wire_tap = wire_tap
        self.limits = limits or Limits()
        self.max_stripes = max_stripes
        #: one deadline for connecting every stripe of a job (TCP, mutual TLS, its begin)
        self.stripe_connect_s = stripe_connect_s
        self.slot_wait_s = slot_wait_s
        self.request_read_s = request_read_s
        self._slots = threading.BoundedSemaphore(max(1, prefill_slots))
        #: jobs whose prefix is being remembered (resident copy, store saves) after their reply
        self._remembering = 0
        self._remembered = threading.Condition()
        self._remember_q: "queue.Queue[tuple[dict, Any]]" = queue.Queue(maxsize=REMEMBER_QUEUE)
        self._remember_thread: Optional[threading.Thread] = None
        #: when the remember thread started its current job (None: idle)
        self._remember_since: Optional[float] = None
        #: committed jobs whose prefix was not remembered (the queue was full)
        self.remember_skipped = 0
        self.prefill_slots = max(1, prefill_slots)
        self.ledger: Optional[GenerationLedger] = None
        self.listener: Optional[Listener] = None
        self._sock: Optional[socket.socket] = None
        self._hash_pool: Optional[ThreadPoolExecutor] = None
        self.control_port: Optional[int] = None
        self._bound = False

    # -- lifecycle: bind (no engine needed), then start ---------------------------------------

    def bind(self) -> "ProducerNode":
        """Everything that can fail without a model: the generation ledger's lock, the keys,
        the TLS contexts, the control port. The CLI calls this before loading the engine."""
        if self._bound:
            return self
        cfg = self.config
        self.ledger = GenerationLedger(cfg.generation_ledger, ops=self._ledger_ops, deadline_s=self.ledger_deadline_s)
        self._keys = {r.name: load_hmac_key(r.hmac_key_file) for r in cfg.receivers}
        self._by_pin = {pin: r for r in cfg.receivers for pin in r.leaf_sha256}
        self._ctl_ep = cfg.control_endpoint()
        self._ctl_ctx = server_context(self._ctl_ep)
        endpoints = {r.name: cfg.data_endpoint(r.name) for r in cfg.receivers}
        self._data = {name: (ep, client_context(ep)) for name, ep in endpoints.items()}
        self._sock = bind_tcp(cfg.control_listen_host, cfg.control_listen_port, "control listener")
        self.control_port = self._sock.getsockname()[1]
        self._serve_metrics()
        self._bound = True
        return self

    def start(self, engine=None) -> "ProducerNode":
        if engine is not None:
            self.engine = engine
        if self.engine is None:
            raise ProtocolError("state", "a producer needs an engine to start", remote=False)
        self.bind()
        self.layout = span_layout(self.engine.layout)
        self.geometry = TileGeometry.of(self.engine.layout)
        self.exact, self.target = wire_identity(self.engine)
        self._check_identity()
        self.identity_digest = self.engine.identity.ids().digest()
        # each stripe's sender hashes a large tile's own digest on this pool while it feeds
        # the running digest (kvpack.handoff.hashing: the core never starts threads itself)
        self._hash_pool = ThreadPoolExecutor(max_workers=hash_workers(), thread_name_prefix="kvpack-producer-hash")
        assert self._sock is not None
        self.listener = Listener(
            "producer-control", self._sock, self._ctl_ep, self._ctl_ctx, self._serve_control, limits=self.limits, refusals=self.refusal_log
        )
        self.listener.start()
        attach_producer(self)  # status page sections and readiness checks
        return self

    def _serve_metrics(self) -> None:
        """The observability listener binds with the other ports (fail fast); until
        :meth:`start` registered the node's readiness checks, /readyz answers 503."""
        if self._metrics_port is None or self.metrics.port is not None:
            return
        self.metrics.serve(self._metrics_port)

    def _check_identity(self) -> None:
        """Refuse to serve with an engine whose identity is not the one every receiver of
        this config was enrolled to admit (before: the producer started, prefilled each
        request, and every begin was refused ``identity`` by the receiver)."""
        mine = self.exact.to_json()
        unchecked = [r.name for r in self.config.receivers if r.identity is None]
        if unchecked:  # a config written before enrollment recorded identities
            log.warning(
                "%s: receiver(s) %s have no recorded identity: the engine's identity is not checked at start "
                "(a mismatch shows only as identity refusals at the receiver); re-enroll to record it",
                self.config.path,
                ", ".join(unchecked),
            )
        for r in self.config.receivers:
            if r.identity is None:
                continue
            if r.identity != mine or r.target_cache_identity_sha256 != self.target:
                which = "identity" if r.identity != mine else "target cache identity"
                diff = sorted(k for k in set(mine) | set(r.identity) if mine.get(k) != r.identity.get(k)) if r.identity != mine else []
                raise SecurityError(
                    "config",
                    f"{self.config.path}: the loaded engine's {which} differs from the one receiver {r.name!r} admits"
                    f"{' (' + ', '.join(diff) + ')' if diff else ''}: run the --engine and --threads the cluster's identity was "
                    "written with (the thread count is part of the identity), or re-enroll with this engine's identity "
                    "(kvpack identity --engine ... --threads ...)",
                )

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.stop()
            self.refusal_log.close(timeout=0.5)  # its writer thread ends (at once, or when a hung write returns)
        elif self._sock is not None:
            self._sock.close()
        self.metrics.close()
        self.receipts.close(timeout=1.0)  # what is queued, if the disk answers; never longer
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=False, cancel_futures=True)
        if self.ledger is not None:
            self.ledger.close()

    # -- control plane --------------------------------------------------------------------

    def _respond(self, ctl, frames: list, response: ControlResponse) -> None:
        data = response.encode()
        ctl.sendall(data)
        frames.append({"dir": "sent", "type": response.status, "bytes": len(data)})

    def _serve_control(self, ctl) -> None:
        """One authenticated control connection (a worker thread of the listener)."""
        frames: list = []
        receipt: dict = {"role": "producer", "peer": ctl.peer_address, "control_frames": frames}
        try:
            self._control(ctl, frames, receipt)
        except Exception as exc:  # noqa: BLE001 - the daemon outlives any one request
            reason, detail = verdict_of(exc)
            receipt.setdefault("verdict", "failed")
            receipt.update(reason=reason, detail=detail[:2000])
            self.metrics.refusal(reason)
        finally:
            job = receipt.pop("_job", None)
            if "receipt_path" not in receipt:
                receipt.update(self.receipts.record({k: v for k, v in receipt.items() if not k.startswith("_")}))
            if job is not None:
                self._queue_remember(receipt, job)  # off the critical path: the reply went out

    def _queue_remember(self, receipt: dict, job: "_Job") -> None:
        """Hand a committed job's prefix to the remember thread (resident copy, store saves)
        so that its control connection ends now: a slow or hung store disk then holds that one
        thread, never a connection slot per job (64 stuck saves used to lock the receiver
        out, ``limit``). At most ``REMEMBER_QUEUE`` jobs wait; beyond that one is not
        remembered (counted: ``remember_skipped``)."""
        with self._remembered:
            if self._remember_thread is None:
                self._remember_thread = threading.Thread(target=self._remember_loop, name="kvpack-producer-remember", daemon=True)
                self._remember_thread.start()
        try:
            self._remember_q.put_nowait((receipt, job))
        except queue.Full:
            self.remember_skipped += 1
            log.warning("prefix of request %s not remembered: %d jobs already wait for the store", receipt.get("request_id"), REMEMBER_QUEUE)
            self._remember_done()

    def _remember_loop(self) -> None:
        while True:
            receipt, job = self._remember_q.get()
            self._remember_since = time.monotonic()
            try:
                self._remember(receipt, job)
            except Exception:  # noqa: BLE001 - the remember thread never dies
                log.exception("remembering request %s failed", receipt.get("request_id"))
            finally:
                self._remember_since = None
                self._remember_done()

    def _remember_done(self) -> None:
        with self._remembered:
            self._remembering -= 1
            self._remembered.notify_all()

    def _read_request(self, ctl, frames: list) -> tuple[str, Any]:
        """``(id to echo, raw request)``: at most ``MAX_REQUEST_BYTES`` within the read
        deadline; the id is echoed only if it is a valid C.14 id."""
        raw = read_control(ctl, time.monotonic() + self.request_read_s, ControlDecoder(MAX_REQUEST_BYTES))
        frames.append({"dir": "received", "type": "request", "bytes": len(cj.canonical_bytes(raw)) + 12})
        return echo_id(raw.get("request_id")) if isinstance(raw, dict) else "unknown", raw

    def _parse_request(self, ctl, raw: Any) -> tuple[ControlRequestV1, dict[str, int], Any]:
        """The typed request, the extensions this node honours, and the requesting receiver."""
        raw, ext = split_extensions(raw, self.extensions)
        req = ControlRequestV1.from_json(raw)
        req.validate(now_ms(), self.engine.max_context)
        receiver = self._by_pin.get(ctl.peer.leaf_sha256)
        if receiver is None:  # pinned by the TLS layer, so this is a config bug
            raise SecurityError("pin", "control peer is not a configured receiver")
        return req, ext, receiver

    def _refuse_request(self, ctl, frames: list, receipt: dict, rid: str, reason: str, detail: str) -> None:
        self._respond(ctl, frames, ControlResponse(rid, "failed", error=f"{reason}: {detail}"[:MAX_ERROR]))
        receipt.update(verdict="refused", phase="request", reason=reason, detail=detail[:2000], request_id=rid)
        self.metrics.refusal(reason)

    def _control(self, ctl, frames: list, receipt: dict) -> None:
        rid = "unknown"
        try:
            rid, raw = self._read_request(ctl, frames)
            req, ext, receiver = self._parse_request(ctl, raw)
        except (KvpackError, TimeoutError) as exc:
            self._refuse_request(ctl, frames, receipt, rid, *verdict_of(exc))
            return
        got = self._await_slot(ctl)
        if got is None:  # errata H2: the receiver spoke or left while it waited: no job
            receipt.update(
                verdict="refused", phase="request", reason="aborted", detail="the receiver went away while waiting for a prefill slot", request_id=rid
            )
            self.metrics.refusal("aborted")
            return
        if not got:
            self._refuse_request(ctl, frames, receipt, rid, "busy", f"all {self.prefill_slots} prefill slots busy for {self.slot_wait_s:g} s")
            return
        try:
            self._accepted_job(ctl, frames, receipt, req, ext, receiver)
        finally:
            self._slots.release()

    def _await_slot(self, ctl) -> Optional[bool]:
        """Take a prefill slot within ``slot_wait_s``: True, False (busy), or None when the
        control connection became readable meanwhile (the receiver cancelled or went away:
        no generation is taken, no data connection opened for a request nobody waits for)."""
        end = time.monotonic() + self.slot_wait_s
        while True:
            if self._slots.acquire(timeout=max(0.0, min(0.1, end - time.monotonic()))):
                if readable(ctl.sock):
                    self._slots.release()
                    return None
                return True
            if readable(ctl.sock):
                return None
            if time.monotonic() >= end:
                return False

    def _accepted_job(self, ctl, frames: list, receipt: dict, req: ControlRequestV1, ext: dict, receiver) -> None:
        rid = req.request_id
        self._respond(ctl, frames, ControlResponse(rid, "accepted"))
        receipt.update(
            request_id=rid,
            receiver=receiver.name,
            prompt_tokens=len(req.prompt_token_ids),
            hint_prefix_cut=ext.get(EXT_PREFIX_CUT, 0),
            stripes_requested=ext.get(EXT_STRIPES, 1),
        )
        try:
            job = _Job(self, ctl, req, receiver, ext, receipt).run()
        except BaseException as exc:  # noqa: BLE001 - answered as "failed"
            reason, detail = verdict_of(exc if not isinstance(exc, _Cancelled) else ProtocolError("aborted", "receiver went away"))
            receipt.update(verdict="failed", reason=reason, detail=detail[:2000])
            self.metrics.transfer(reason)
            self.metrics.refusal(reason)
            try:
                self._respond(ctl, frames, ControlResponse(rid, "failed", error=f"{reason}: {detail}"[:MAX_ERROR]))
            except (KvpackError, OSError):
                pass
            return
        # the receipt is evidence of a committed transfer (every stripe acked): it is on disk
        # before the answer leaves, so whoever reads the answer finds it -- unless the receipts
        # disk does not answer within ReceiptBudget.wait_s: then the answer goes out and the
        # receipt follows when the disk answers (an audit record never holds a commit)
        answer = ControlResponse(rid, "committed", receipt=job.control_receipt)
        data = answer.encode()
        frames.append({"dir": "sent", "type": "committed", "bytes": len(data)})
        receipt.update(verdict="committed", receipt=job.control_receipt.to_json())
        receipt.update(self.receipts.record(dict(receipt)))
        self.metrics.transfer("committed", job.control_receipt.payload_bytes)
        with self._remembered:  # counted before the answer: a next request sees it
            self._remembering += 1
        receipt["_job"] = job
        ctl.sendall(data)

    # -- reuse ----------------------------------------------------------------------------

    def _await_remembered(self, wait_s: float = REMEMBER_WAIT_S) -> None:
        """A request that arrives while an earlier job's prefix is still being remembered
        waits for it (bounded): recomputing a prefix costs more than the copy in flight (a
        client that sends its next turn at once would otherwise miss its own prefix)."""
        end = time.monotonic() + wait_s
        since = self._remember_since
        if since is not None:  # a remember stuck past the wait (a hung store) costs no more waits
            end = min(end, since + wait_s)
        with self._remembered:
            while self._remembering > 0:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._remembered.wait(left)

    def _reuse_plan(self, prompt: list[int]) -> tuple[int, str, Any]:
        """The deepest 256-aligned prefix this node already computed, leaving at least one
        token to prefill (the receipt's ``prefill_tokens`` is never zero): ``(cut, tier,
        source)``. Only aligned cuts: prefill chunks end at absolute multiples of 256, so a
        prefix restored there and extended by prefill computes exactly what an uninterrupted
        prefill computes. A durable hit is ``(cut, "durable", hit)`` (restored by the job)."""
        position = len(prompt) - 1
        limit = align_tokens_down(position - 1)
        if limit <= 0:
            return 0, "none", None
        self._await_remembered()
        held = self.resident.lookup(self.identity_digest, prompt[: limit + 1])  # 'prompt' of limit rows + 1
        best_res = 0 if held is None else min(held.matched, limit)
        best_res = align_tokens_down(best_res)
        if best_res and held is not None and not window_covers(self.engine.layout, held.source.position, best_res):
            best_res = 0  # a windowed entry deeper than the cut no longer holds its window
        if self.store is not None:
            hit = self.store.find_deepest(prompt[:limit], self.engine.layout, self.engine.identity.ids())
            if hit is not None and is_token_aligned(hit.cut) and hit.cut > best_res:
                return hit.cut, "durable", hit
        if best_res:
            assert held is not None  # best_res > 0 only from a resident hit
            return best_res, "resident", held.source
        return 0, "none", None

    def _install_prefix(self, session, prompt: list[int], cut: int, tier: str, source) -> tuple[int, str]:
        if tier == "durable":
            # a cut failing verification is quarantined by the store and is a miss here
            if self.store.restore_healing(source, session, prompt[:cut])[0] is not None:
                return cut, "durable"
            return 0, "none"
        if tier == "resident":
            install = session.begin_install(cut, prompt[:cut], self.engine.identity)
            try:
                copy_prefix(source, install, self.geometry, cut)
                install.commit(require_logits=False)
            except BaseException:
                install.abort()
                raise
            return cut, "resident"
        return 0, "none"

    def _send(self, data, buf) -> None:
        if not self.pacing:
            data.sendall(buf)
            return
        # Application-level pacing (upstream paces with SO_MAX_PACING_RATE, C.1/L5): slices
        # of at most 64 KiB, each followed by the time it is worth at the configured rate.
        view = memoryview(buf).cast("B")
        step = 1 << 16
        for i in range(0, len(view), step):
            part = view[i : i + step]
            data.sendall(part)
            time.sleep(len(part) / self.pacing)

    def _remember(self, receipt: dict, job: "_Job") -> None:
        session, checkpoints, tokens = job.session, job.checkpoints, job.tokens
        if session is None or not tokens:
            return
        t0 = time.perf_counter()
        try:
            # the job's session ends here: its rows are kept by reference where the engine allows
            self.resident.insert(self.identity_digest, RowsSource.capture(session, len(tokens), last_use=True))
            saved = []
            if self.store is not None:
                # aligned checkpoints only (see _reuse_plan), and of a windowed layout only those
                # whose windows the session still holds (the others slid out during the prefill)
                for c in sorted(checkpoints):
                    if window_covers(self.engine.layout, session.position, c):
                        self.store.save(session, cut=c, logits=checkpoints[c])
                        saved.append(c)
        except KvpackError as exc:  # a full store degrades only this save
            receipt["remembered"] = {"error": f"{exc.category}: {exc.message}"[:500]}
            return
        receipt["remembered"] = {"resident_tokens": len(tokens), "saved_cuts": saved, "seconds": round(time.perf_counter() - t0, 4)}


class _Job:
    """One accepted request: generations, stripes, prefill, shipping, acks."""

    def __init__(self, node: ProducerNode, ctl, req: ControlRequestV1, receiver, ext: dict, receipt: dict) -> None:
        self.node, self.ctl, self.req, self.receiver, self.receipt = node, ctl, req, receiver, receipt
        prompt = list(req.prompt_token_ids)
        self.prompt = prompt
        self.position = len(prompt) - 1  # the receiver holds back the boundary token
        self.tokens = prompt[: self.position]
        hint = ext.get(EXT_PREFIX_CUT, 0)
        self.cut = hint if hint and is_token_aligned(hint) and 0 < hint < self.position else 0
        self.schedule = list(schedule_span(node.layout, self.position, self.cut))
        self.count = stripe_count(ext.get(EXT_STRIPES, 1), node.max_stripes, len(self.schedule))
        self.stripes: list[_StripeOut] = []
        self.ns: dict[str, int] = {}
        self.session: Any = None
        self.checkpoints: dict[int, bytes] = {}
        self.next_tile = 0
        self.control_receipt: Any = None
        #: queues a resident prefix's tiles while this thread installs that prefix
        self._feeder: Optional[threading.Thread] = None
        self._feed_error: Optional[BaseException] = None
        self._aborting = False
        #: the request's deadline (C.14 ``deadline_unix_ms``) on this host's monotonic clock:
        #: the whole job -- connects, prefill, writes, acks -- ends by it
        self.end = time.monotonic() + max(0.0, (req.deadline_unix_ms - now_ms()) / 1000.0)

    def run(self) -> "_Job":
        node = self.node
        assert node.ledger is not None  # opened by bind()
        gens = node.ledger.take_many(self.count)  # durable before use: never reused
        self.receipt.update(
            transfer_id=stripe_transfer_id(self.req.request_id, gens[0], 0, self.count),
            generation=gens[0],
            generations=gens,
            stripes=self.count,
            position=self.position,
            prefix_cut=self.cut,
        )
        self.ns["transfer_start"] = time.time_ns()
        try:
            self._open_stripes(gens)
            t_pf = time.perf_counter()
            reused, tier = self._prefill_and_ship()
            prefill_s = time.perf_counter() - t_pf
            self._finish_stripes()
        except BaseException:
            self._abort_stripes()
            raise
        finally:
            for s in self.stripes:
                s.channel.close()
        self._account(reused, tier, prefill_s)
        return self

    def _manifest(self, gen: int, index: int) -> BeginManifestV2:
        node, created = self.node, now_ms()
        return BeginManifestV2(
            protocol=PROTOCOL,
            transfer_id=stripe_transfer_id(self.req.request_id, gen, index, self.count),
            generation=gen,
            created_unix_ms=created,
            expires_unix_ms=created + EXPIRY_MS,
            identity=node.exact,
            prompt_token_ids=tuple(self.tokens),
            multimodal=None,
            hmac=HmacRef(self.receiver.hmac_key_id, self.receiver.hmac_epoch),
            components=(ComponentV2("target", "target_kv", True, node.target),),
            segments=(),
            deferred_segments=True,
        )

    def _open_stripes(self, gens: list[int]) -> None:
        """Connect every stripe at once -- TCP, mutual TLS and its begin, each on its own
        thread -- under one deadline for all (``stripe_connect_s``). The first failure (or
        the deadline, or the receiver going away on the control connection) ends the wait at
        once: the stripes already open are aborted (abort frames, then closed: the receiver
        installs nothing), and a stripe still connecting aborts and closes itself when its
        connect returns (its own deadline is the same). Before, the stripes connected one
        after another, each with a full handshake timeout: one stalled stripe held the job
        (and its prefill slot) for ``k`` x 10 s."""
        node = self.node
        ep, ctx = node._data[self.receiver.name]
        key = node._keys[self.receiver.name]
        senders = [Sender(self._manifest(gen, i), key, prefix_cut=self.cut, hash_executor=node._hash_pool or INLINE) for i, gen in enumerate(gens)]
        end = min(time.monotonic() + node.stripe_connect_s, self.end)
        lock = threading.Lock()
        opened: dict[int, _StripeOut] = {}
        failed: list[tuple[int, BaseException]] = []
        state = {"abandoned": False}
        done = threading.Event()

        def open_one(i: int) -> None:
            stripe: Optional[_StripeOut] = None
            try:
                chan = connect(ep, self.req.receiver_host, self.req.receiver_port, context=ctx, timeout=max(0.001, end - time.monotonic()))
                stripe = _StripeOut(i, senders[i], chan)
                chan.settimeout(max(0.001, end - time.monotonic()))  # the begin too, within the deadline
                self._write(stripe, senders[i].begin())
                chan.settimeout(None)
            except BaseException as exc:  # noqa: BLE001 - reported to the job thread
                if stripe is not None:
                    stripe.channel.close()
                with lock:
                    failed.append((i, exc))
                done.set()
                return
            with lock:
                if not state["abandoned"]:
                    opened[i] = stripe
                    if len(opened) == len(gens):
                        done.set()
                    return
            # the job gave up meanwhile: this stripe is ours alone to abort
            try:
                for b in stripe.sender.abort():
                    stripe.channel.sendall(b)
            except (KvpackError, OSError):
                pass
            stripe.channel.close()

        for i in range(len(gens)):
            threading.Thread(target=open_one, args=(i,), name=f"kvpack-producer-connect-{i}", daemon=True).start()
        error: Optional[BaseException] = None
        while not done.wait(0.1):
            if readable(self.ctl.sock):
                error = _Cancelled()
                break
            if time.monotonic() > end + 1.0:  # connect() keeps the deadline; a last resort
                error = ProtocolError("aborted", f"striped transfer: stripes not connected within {node.stripe_connect_s:g} s", remote=False)
                break
        with lock:
            state["abandoned"] = True
            self.stripes = [opened[i] for i in sorted(opened)]  # aborted by _abort_stripes on failure
            if error is None and failed:
                i, exc = min(failed, key=lambda f: f[0])
                error = exc
                if isinstance(exc, KvpackError) and len(gens) > 1:
                    error = type(exc)(exc.category, f"stripe {i} of {len(gens)}: {exc.message}")
        if error is None and len(self.stripes) != len(gens):
            error = ProtocolError("aborted", "striped transfer: a stripe did not connect", remote=False)
        if error is not None:
            raise error
        for stripe in self.stripes:
            stripe.thread = threading.Thread(target=self._stripe_loop, args=(stripe,), name=f"kvpack-producer-stripe-{stripe.index}", daemon=True)
            stripe.thread.start()

    def _write(self, stripe: _StripeOut, buffers) -> None:
        t = time.perf_counter_ns()
        for b in buffers:
            if self.node.wire_tap is not None:
                self.node.wire_tap(bytes(b))
            self.node._send(stripe.channel, b)
        stripe.wire_ns += time.perf_counter_ns() - t

    def _stripe_loop(self, stripe: _StripeOut) -> None:
        """Pack, hash and frame this stripe's tiles (its writer thread encrypts and writes
        them meanwhile); then seal, and await its one ack."""
        writer = threading.Thread(target=self._writer_loop, args=(stripe,), name=f"kvpack-producer-write-{stripe.index}", daemon=True)
        writer.start()
        try:
            try:
                while not self._aborting:
                    try:
                        item = stripe.q.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    if item is None:
                        break
                    payload, seg = item
                    if callable(payload):  # a tile of a resident prefix: packed here, in parallel
                        payload = payload()
                    self._to_writer(stripe, (stripe.sender.send_segment(payload, seg), True))
                if not self._aborting:  # an aborted stripe is never sealed
                    self._to_writer(stripe, (stripe.sender.seal(), False))
            finally:
                # a failed writer drains its queue, and _abort_stripes interrupts a stuck one:
                # this never blocks for long
                stripe.out.put(None)
            writer.join()
            if stripe.error is not None or self._aborting:
                return
            self._await_ack(stripe)
        except BaseException as exc:  # noqa: BLE001 - reported by the job thread (_check)
            if stripe.error is None:
                stripe.error = exc

    def _to_writer(self, stripe: _StripeOut, item: Any) -> None:
        while True:
            if stripe.error is not None:
                raise stripe.error
            if self._aborting:
                raise _Cancelled()
            try:
                stripe.out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _writer_loop(self, stripe: _StripeOut) -> None:
        """Write framed buffers in order (TLS encryption releases the GIL)."""
        try:
            while (item := stripe.out.get()) is not None:
                buffers, is_segment = item
                self._write(stripe, buffers)
                if is_segment and not stripe.first_segment_ns:
                    stripe.first_segment_ns = time.time_ns()
        except BaseException as exc:  # noqa: BLE001 - the framing thread and the job report it
            stripe.error = exc
            while stripe.out.get() is not None:  # keep the framing thread from blocking
                pass

    def _await_ack(self, stripe: _StripeOut) -> None:
        stripe.channel.settimeout(ACK_WAIT_S)
        ack = None
        while ack is None:
            chunk = stripe.channel.recv(4096)
            if not chunk:
                raise ProtocolError("aborted", f"receiver closed stripe {stripe.index} without an ack")
            ack = stripe.sender.receive_data(chunk)
        stripe.acked_ns = time.time_ns()

    def _check(self) -> None:
        if self._aborting:
            raise _Cancelled()
        for s in self.stripes:
            if s.error is not None:
                raise s.error
        if readable(self.ctl.sock):  # errata H2: the receiver spoke or left: cancel
            raise _Cancelled()
        self._check_deadline()

    def _check_deadline(self) -> None:
        """The request's deadline bounds the job: a receiver that stops reading (its
        process frozen, a black-holed network: neither its data nor its control connection
        ever says so) used to hold the job, its prefill slot and its threads in a blocked
        write or an ack wait indefinitely. Past it the job is aborted (a stuck write is
        interrupted by the abort)."""
        if time.monotonic() >= self.end:
            raise ProtocolError(
                "aborted", f"the request's deadline passed (deadline_unix_ms {self.req.deadline_unix_ms}) before every stripe was acknowledged", remote=False
            )

    def _put(self, payload, seg) -> None:
        stripe = self.stripes[self.next_tile % self.count]
        while True:
            self._check()
            try:
                stripe.q.put((payload, seg), timeout=0.1)
                break
            except queue.Full:
                continue
        self.next_tile += 1

    def _ship_ready(self, s, upto: int) -> None:
        """Queue every scheduled tile whose rows ``s`` holds below ``upto``."""
        self._join_feeder()  # tiles leave in schedule order: the resident ones first
        self._check()
        while self.next_tile < len(self.schedule):
            seg = self.schedule[self.next_tile]
            if seg.logical_start + seg.logical_count > upto:
                break
            self._put(self._payload(s, seg), seg)

    def _payload(self, source: Any, seg: Any) -> Any:
        """A tile's payload: its plane rows by reference where they never change under the
        views (tile_pieces), else a packed copy."""
        pieces = tile_pieces(source, self.node.geometry, seg)
        return pieces if pieces is not None else pack_tile(source, self.node.geometry, seg)

    def _feed_resident(self, cut: int, source: Any) -> None:
        try:
            while self.next_tile < len(self.schedule):
                seg = self.schedule[self.next_tile]
                if seg.logical_start + seg.logical_count > cut:
                    break
                self._put(lambda seg=seg: self._payload(source, seg), seg)
        except BaseException as exc:  # noqa: BLE001 - raised again by _join_feeder
            self._feed_error = exc

    def _join_feeder(self) -> None:
        feeder = self._feeder
        if feeder is None:
            return
        while feeder.is_alive():  # each of its waits is bounded (_put polls _check)
            feeder.join(timeout=0.1)
        self._feeder = None
        if self._feed_error is not None:
            raise self._feed_error

    def _prefill_and_ship(self) -> tuple[int, str]:
        node = self.node
        cut, tier, source = node._reuse_plan(self.prompt)
        if tier == "resident":
            # tiles the resident prefix holds leave at once (packed on the stripe threads,
            # queued by a feeder thread) while this thread copies the prefix into the job's
            # session for the rest of the prefill: the copy overlaps the wire instead of
            # following it
            self._feeder = threading.Thread(target=self._feed_resident, args=(cut, source), name="kvpack-producer-feed", daemon=True)
            self._feeder.start()
        session = self.session = node.engine.new_session()
        self.ns["prefill_start"] = time.time_ns()
        reused, tier = node._install_prefix(session, self.prompt, cut, tier, source)

        def on_chunk(s) -> None:
            if is_token_aligned(s.position) and s.position > reused and node.store is not None:
                self.checkpoints[s.position] = bytes(s.export_logits())
            self._ship_ready(s, s.position)

        on_chunk(session)  # tiles of an installed prefix beyond the cut leave at once
        session.prefill(self.tokens[session.position :], chunk_size=chunk_tokens(node.engine), on_chunk=on_chunk)
        self.ns["prefill_end"] = time.time_ns()
        self._ship_ready(session, session.position)
        self.ns["state_saved"] = time.time_ns()
        return reused, tier

    def _finish_stripes(self) -> None:
        for s in self.stripes:
            self._put_end(s)
        for s in self.stripes:
            assert s.thread is not None
            while s.thread.is_alive():
                s.thread.join(timeout=0.1)
                if readable(self.ctl.sock):
                    raise _Cancelled()
                self._check_deadline()
            if s.error is not None:
                raise s.error
        self.ns["transfer_acked"] = max(s.acked_ns for s in self.stripes)

    def _put_end(self, stripe: _StripeOut) -> None:
        while True:
            if stripe.error is not None:
                raise stripe.error
            try:
                stripe.q.put(None, timeout=0.1)
                return
            except queue.Full:
                self._check()

    def _abort_stripes(self) -> None:
        self._aborting = True  # a feeder still queueing tiles stops at its next check
        if self._feeder is not None:
            self._feeder.join(timeout=5)
        # A stripe's threads own its sender and its TLS channel until they end: OpenSSL objects
        # are not thread-safe, so nothing here writes, reads or closes a channel a stripe
        # thread may still be inside of (that corrupted memory: a sendall of the abort frames
        # beside the writer thread's, or beside the stripe thread's read of its ack).
        deadline = time.monotonic() + ABORT_GRACE_S
        for s in self.stripes:
            if s.thread is not None:  # idle or framing: it sees _aborting within 0.1 s
                s.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [s for s in self.stripes if s.thread is not None and s.thread.is_alive()]
        for s in stuck:
            s.channel.interrupt()  # a write to a peer that stopped reading, or an ack read
        for s in stuck:
            s.thread.join(timeout=5)  # type: ignore[union-attr]
        for s in self.stripes:
            if s not in stuck and (s.thread is None or not s.thread.is_alive()):
                try:  # no thread uses this channel or sender any more: tell the receiver
                    for b in s.sender.abort():
                        s.channel.sendall(b)
                except (KvpackError, OSError):
                    pass
            if s.thread is None or not s.thread.is_alive():
                s.channel.close()

    def _account(self, reused: int, tier: str, prefill_s: float) -> None:
        node, stripes = self.node, self.stripes
        prefilled = self.position - reused
        node.metrics.prefilled.labels("producer").inc(prefilled)
        node.metrics.reused.labels("producer", tier).inc(reused)
        wire_ns = max(s.wire_ns for s in stripes)
        node.metrics.phases({"prefill": prefill_s, "wire": wire_ns / 1e9})
        payload = sum(s.sender.bytes_sent for s in stripes)
        first = min(s.first_segment_ns for s in stripes if s.first_segment_ns)
        self.receipt.update(
            reused_tokens=reused,
            reuse_tier=tier,
            prefilled_tokens=prefilled,
            segments=sum(s.sender.segments_sent for s in stripes),
            payload_bytes=payload,
            begin_sha256=stripes[0].sender.manifest.begin_sha256(),
            seal=None if stripes[0].sender.seal_manifest is None else stripes[0].sender.seal_manifest.to_json(),
            stripe_detail=[
                {
                    "index": s.index,
                    "transfer_id": s.sender.manifest.transfer_id,
                    "segments": s.sender.segments_sent,
                    "payload_bytes": s.sender.bytes_sent,
                    "wire_s": round(s.wire_ns / 1e9, 6),
                }
                for s in stripes
            ],
        )
        self.control_receipt = ControlReceipt(
            prefill_start_unix_ns=self.ns["prefill_start"],
            prefill_end_unix_ns=self.ns["prefill_end"],
            state_saved_unix_ns=self.ns["state_saved"],
            transfer_start_unix_ns=self.ns["transfer_start"],
            first_segment_sent_unix_ns=first,
            transfer_acked_unix_ns=self.ns["transfer_acked"],
            prefill_tokens=prefilled,
            payload_bytes=payload,
            payload_wire_ns=max(1, wire_ns),
        )


def digest_tokens(tokens) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()
