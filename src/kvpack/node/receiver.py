"""The decode node (``kvpack receiver``): the engine-owning server of Handoff V2.

Figure 30.1 of seed 003, steps 1 and 3-10 from this side, for many requests at once:

1. a prompt arrives (local API, :mod:`.local_api`); the request borrows a *decode slot*
   (:mod:`.slots`: one engine session per slot, the slot already holding the longest prefix
   preferred); the reuse ladder (:mod:`.ladder`) serves it locally, arms a delta, or asks a
   producer for a full transfer: the control client (:mod:`.control`) writes one MUPCTL1
   request -- with ``kvpack_stripes`` when striping is on -- reads ``accepted`` and keeps
   the connection open and silent (errata H2); a producer that refuses kvpack's extension
   keys before ``accepted`` is asked again without them (one stream, full transfer);
3. the producer connects back on the data ALPN, once per stripe; the shared transport
   (:mod:`.transport`) proves *who* (TLS 1.3, CA, leaf pin, exact ALPN) under a handshake
   deadline before a byte of protocol is read; refusals before that are aggregated;
4-10. :mod:`.inbound` routes each connection to its request by transfer id, runs the
   sans-I/O receiver (admission in the spec's order, per-segment digests, seal, HMAC,
   durable reservation through :mod:`.ledger_gate`) and scatters verified segments into the
   request's one detached install, committed once after every stripe verified; the ACKs go
   out and nothing more is read (errata H4).

Then the node decodes the held-back boundary token itself and generates greedily, checking
the request's cancel token between steps: a client that goes away frees its slot at once.

Several producers, one node: every ``--config`` (one enrolled producer each: its pins, HMAC
key, replay ledger, control address) becomes a *producer link*; the data listener accepts
the union of their pins on one port, and a connection's pinned leaf picks its link. Configs
must agree on the listen address, certificate, key, CA and identity (checked at start).

Startup fails fast (:meth:`ReceiverNode.bind`, before any model is loaded): ledgers locked
and opened, their volumes probed, the data port and the local API socket bound (an API
socket served by a live process is never taken over), the metrics listener bound.

**Unsolicited mode** (a link without ``producer_control``, C.15 and errata M8/M9): any of
its pinned producers may send a transfer; there is no request to bind it to, everything else
is checked the same. A committed transfer lands in a new *named session* (its transfer id)
that the local API decodes from (``kvpack request --session``), enters the resident tier and
is saved as a prefix cut when a store is configured; :attr:`ReceiverNode.landed` hands every
admitted outcome to ``kvpack receive --once``. Deltas need a held prefix named by a request,
so in this mode a nonzero ``prefix_cut`` is refused (``delta``).

Nothing is installed before the seal verified and the generation was reserved, so a slot's
session is exactly as it was after any refusal.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..durable import REAL_OPS, FileOps, call_with_deadline
from ..errors import EngineError, KvpackError, NetworkError, ProtocolError, SecurityError, StoreError, UsageError
from ..handoff.control import MAX_PROMPT_TOKENS, ControlRequestV1
from ..handoff.delta import ReuseAction
from ..security.config import ReceiverConfig
from ..security.ledger import LEDGER_IO_DEADLINE_S, ReplayLedger
from ..security.probe import PROBE_ITERATIONS, PROBE_MAX_TAIL_MS, ProbeResult, check_ledger_volume
from ..security.tls import DATA_ALPN, TlsEndpoint, client_context, server_context
from ..vocab import is_token_aligned
from .common import greedy, hash_workers, logits_bytes, now_ms, verdict_of
from .control import EXT_PREFIX_CUT, EXT_STRIPES, MAX_STRIPES, ControlClient, ControlSession, RequestRefused
from .inbound import FIRST_FRAME_S, InboundRun, Outcome, PayloadBufferPool, Pending, Router, first_frame
from .ladder import DurableMiss, HeldPrefix, Ladder, Plan, ResidentRadix, RowsSource
from .ledger_gate import LedgerGuard
from .local_api import NEVER, ApiLimits, ApiSocket, CancelToken, LocalApi, request_local
from .metrics import NodeMetrics
from .receipts import ReceiptBudget, ReceiptWriter, RefusalLog
from .slots import DecodeSlots, Slot
from .status import attach_receiver, log_request
from .striping import parse_stripe
from .tls_front import FrontPool, FrontsSetting, resolve_fronts
from .transport import Limits, Listener, bind_tcp
from .wire import TileGeometry, copy_prefix, span_layout, wire_identity

__all__ = ["EXT_PREFIX_CUT", "NamedSessions", "Pending", "ProducerLink", "ReceiverNode", "accept_wait_s", "request_local"]


#: idle payload buffers a decode node keeps for the next transfers (two per connection)
PAYLOAD_POOL_BYTES = 512 << 20
#: how long a waiter that sees the shared install failed waits for the refusing stripe to
#: report its category (it finishes the request itself, normally at once)
SHARED_FAIL_GRACE_S = 0.5
#: opening a replay ledger (lock, read, rollback check, first writes) may take this much
#: longer than the ledger deadline before a start is refused
OPEN_GRACE_S = 5.0


log = logging.getLogger("kvpack.node.receiver")


def accept_wait_s(cfg: ReceiverConfig, prompt_tokens: int) -> float:
    """Errata H3: max(wait_for_producer_ms, 200 ms per prompt token), capped at 900 s."""
    return min(900.0, max(cfg.wait_for_producer_ms / 1000.0, 0.2 * prompt_tokens))


class NamedSessions:
    """Sessions that unsolicited transfers landed in, by name (the transfer id), bounded:
    the least recently used is dropped beyond ``limit`` (a peer cannot grow memory)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._by_name: "OrderedDict[str, Any]" = OrderedDict()
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()

    def put(self, name: str, session: Any, *, held: bool = False) -> threading.Lock:
        """Name ``session``; with ``held`` its lock is returned already taken, so a request
        for it waits until the caller (the landing: resident copy, store save) releases it."""
        lock = threading.Lock()
        if held:
            lock.acquire()
        with self._mutex:
            self._by_name.pop(name, None)
            self._by_name[name] = session
            self._locks[name] = lock
            while len(self._by_name) > self.limit:
                old, _ = self._by_name.popitem(last=False)
                self._locks.pop(old, None)
        return lock

    def get(self, name: str) -> tuple[Any, threading.Lock]:
        with self._mutex:
            if name not in self._by_name:
                raise EngineError("install", f"no received session named {name!r} (known: {list(self._by_name)[-8:]})")
            self._by_name.move_to_end(name)
            return self._by_name[name], self._locks[name]

    def names(self) -> list[dict]:
        with self._mutex:
            return [{"name": n, "position": s.position} for n, s in self._by_name.items()]


@dataclass
class ProducerLink:
    """One enrolled producer of this decode node (one receiver config)."""

    name: str
    config: ReceiverConfig
    key: bytes
    ledger: ReplayLedger
    guard: LedgerGuard
    control: Optional[ControlClient]
    probe: Optional[ProbeResult] = None

    @property
    def unsolicited(self) -> bool:
        return self.control is None


def _link_name(cfg: ReceiverConfig) -> str:
    if cfg.producer_control is not None:
        return cfg.producer_control.server_name
    base = os.path.basename(cfg.path)
    return base[len("receiver.") : -len(".json")] if base.startswith("receiver.") and base.endswith(".json") else base


def check_shared_configs(configs: Sequence[ReceiverConfig]) -> None:
    """Several producer configs can share one decode node only when they describe the same
    node: listen address, certificate, key, CA and identity equal; keys, ledgers and pins
    distinct (a leaf pinned by two configs would make its link ambiguous)."""
    first = configs[0]
    same = ("listen_host", "listen_port", "certificate_chain", "private_key", "peer_ca", "identity", "target_cache_identity_sha256")
    for cfg in configs[1:]:
        for name in same:
            if getattr(cfg, name) != getattr(first, name):
                raise SecurityError("config", f"{cfg.path}: {name} differs from {first.path}; configs of one decode node must share it")
    for attr in ("hmac_key_id", "replay_ledger"):
        values = [getattr(c, attr) for c in configs]
        if len(set(values)) != len(values):
            raise SecurityError("config", f"two configs share {attr}: each producer needs its own")
    pins = [p for c in configs for p in c.peer_leaf_sha256]
    if len(set(pins)) != len(pins):
        raise SecurityError("config", "a producer leaf is pinned by two configs: its connections could not be told apart")


class ReceiverNode:
    """A decode node: data listener, producer links, decode slots, ladder, local API, metrics."""

    def __init__(
        self,
        config: ReceiverConfig | Sequence[ReceiverConfig],
        engine=None,
        *,
        receipts_dir: str,
        store=None,
        metrics_port: Optional[int] = 0,
        advertised_port: Optional[int] = None,
        resident_bytes: int = 1 << 30,
        committed_wait_s: float = 2.0,
        check_volume: bool = True,
        socket_path: Optional[str] = None,
        decode_slots: int = 1,
        stripes: int = 1,
        limits: Optional[Limits] = None,
        api_limits: Optional[ApiLimits] = None,
        slot_wait_s: float = 60.0,
        max_sessions: int = 8,
        unsolicited_slots: int = 2,
        ledger_max_tail_ms: Optional[float] = None,
        tls_fronts: FrontsSetting = "auto",
        ledger_deadline_s: float = LEDGER_IO_DEADLINE_S,
        ledger_ops: FileOps = REAL_OPS,
        receipt_wait_s: float = ReceiptBudget.wait_s,
    ) -> None:
        self.configs: list[ReceiverConfig] = [config] if isinstance(config, ReceiverConfig) else list(config)
        if not self.configs:
            raise SecurityError("config", "a decode node needs at least one receiver config")
        check_shared_configs(self.configs)
        self.config = self.configs[0]
        self.engine = engine
        self.store = store
        self.refusal_log = RefusalLog("receiver", os.path.join(os.path.abspath(receipts_dir), "refusals.log"))
        self.receipts = ReceiptWriter(receipts_dir, ReceiptBudget(wait_s=receipt_wait_s), refusal_log=self.refusal_log)
        self.metrics = NodeMetrics("receiver")
        self.metrics.watch_receipts(self.receipts)
        self.refusal_log.on_count = self.metrics.refusal
        self._metrics_port = metrics_port
        self._advertised_port = advertised_port
        self.committed_wait_s = committed_wait_s
        self._check_volume = check_volume
        #: the ledger-volume gate (None: the probe's default, 100 ms)
        self._ledger_max_tail_ms = ledger_max_tail_ms
        #: how long an admission waits for a replay ledger (its lock, a reservation's writes)
        self.ledger_deadline_s = ledger_deadline_s
        self._ledger_ops = ledger_ops
        self.socket_path = socket_path
        self.resident = ResidentRadix(resident_bytes)
        self.decode_slot_count = max(1, decode_slots)
        self.stripes = max(1, min(MAX_STRIPES, stripes))
        self.limits = limits or Limits()
        #: TLS front processes of the data listener (kvpack.node.tls_front): "auto" is
        #: min(8, cpus // 2) on 8 cores or more, else 0 (handshakes and records in-process)
        self.tls_fronts = resolve_fronts(tls_fronts)
        self._fronts: Optional[FrontPool] = None
        self.api_limits = api_limits or ApiLimits()
        self.slot_wait_s = slot_wait_s
        self.first_frame_s = FIRST_FRAME_S
        self.links: list[ProducerLink] = []
        self.router = Router()
        self._counter = itertools.count(1)
        self._rr = itertools.count()
        self.listener: Optional[Listener] = None
        self.api: Optional[LocalApi] = None
        self._api_socket: Optional[ApiSocket] = None
        self._sock: Optional[socket.socket] = None
        self.data_port: Optional[int] = None
        self.hash_executor: Optional[ThreadPoolExecutor] = None
        #: writes verified segments into installs while their connections read on
        self.install_executor: Optional[ThreadPoolExecutor] = None
        #: payload buffers kept between transfers (idle bytes bounded)
        self.payload_buffers = PayloadBufferPool(PAYLOAD_POOL_BYTES)
        #: read segments straight into an install that hands out its rows (the arrays
        #: engine; kvpack.handoff.target); False stages and scatters every segment
        self.receive_in_place = True
        self.slots: Optional[DecodeSlots] = None
        self._bound = False
        #: unsolicited links: named sessions and concurrent transfers
        self.sessions = NamedSessions(max_sessions)
        self._unsolicited_slots = threading.BoundedSemaphore(max(1, unsolicited_slots))
        #: every admitted unsolicited outcome, in order (``kvpack receive --once`` reads it)
        self.landed: "queue.Queue[Outcome]" = queue.Queue(maxsize=256)

    # -- lifecycle: bind (fail fast, no engine needed), then start ----------------------------

    def bind(self) -> "ReceiverNode":
        """Everything that can fail without a model, in this order: replay ledgers (locks,
        rollback check) and their volume probes, keys and TLS contexts, the data port, the
        local API socket (never taken over from a live process)."""
        if self._bound:
            return self
        try:
            for cfg in self.configs:
                self.links.append(self._open_link(cfg))
            cfg = self.config
            pins = frozenset(p for c in self.configs for p in c.peer_leaf_sha256)
            self._data_ep = TlsEndpoint(cfg.certificate_chain, cfg.private_key, cfg.peer_ca, pins, DATA_ALPN)
            self._data_ctx = server_context(self._data_ep)
            self._sock = bind_tcp(cfg.listen_host, cfg.listen_port, "data listener")
            self.data_port = self._sock.getsockname()[1]
            if self.tls_fronts:
                # spawned before any model loads (fresh interpreters; fail fast on the key)
                self._fronts = FrontPool("receiver-data", self._data_ep, self.tls_fronts, self.limits.handshake_s).start()
            if self.socket_path:
                self._api_socket = ApiSocket(self.socket_path)
            self._serve_metrics()
        except BaseException:
            self._release()
            raise
        self._bound = True
        return self

    def _probe_volume(self, path: str, gate_ms: float) -> ProbeResult:
        """The start-up probe of a ledger's volume, bounded: a volume that does not answer
        (an fsync that never returns) refuses the start (``volume``) after the ledger deadline
        plus the time the samples may take, instead of hanging it before the ready line."""
        box: list[ProbeResult] = []
        deadline = self.ledger_deadline_s + PROBE_ITERATIONS * gate_ms / 1000.0
        stuck = call_with_deadline(
            lambda: box.append(check_ledger_volume(path, max_tail_ms=gate_ms, ops=self._ledger_ops)), deadline, name="kvpack-ledger-probe"
        )
        if stuck is not None:
            raise SecurityError(
                "volume",
                f"replay ledger volume {os.path.dirname(os.path.abspath(path))!r} did not answer the start-up probe within {deadline:g} s "
                "(a hung disk?): the node cannot reserve transfers there",
            )
        return box[0]

    def _open_link(self, cfg: ReceiverConfig) -> ProducerLink:
        probe = None
        if self._check_volume:
            os.makedirs(os.path.dirname(cfg.replay_ledger), mode=0o700, exist_ok=True)
            gate = PROBE_MAX_TAIL_MS if self._ledger_max_tail_ms is None else self._ledger_max_tail_ms
            probe = self._probe_volume(cfg.replay_ledger, gate)  # refuses a slow volume (C.9)
        # concurrent requests and stripes of one producer reserve out of generation order
        opened: list[ReplayLedger] = []
        handover = threading.Lock()
        gave_up: list[bool] = []

        def open_ledger() -> None:
            led = ReplayLedger.open(
                cfg.replay_ledger, minimum_epoch=cfg.minimum_hmac_epoch, strict=False, io_deadline_s=self.ledger_deadline_s, ops=self._ledger_ops
            )
            with handover:
                if gave_up:
                    led.close()  # opened after the start was refused: its lock is released
                else:
                    opened.append(led)

        wait = self.ledger_deadline_s + OPEN_GRACE_S
        stuck = call_with_deadline(open_ledger, wait, name="kvpack-ledger-open")
        with handover:
            if stuck is not None and not opened:
                gave_up.append(True)
        if not opened:  # a hung volume: refuse the start rather than hang before the ready line
            raise SecurityError("volume", f"replay ledger {cfg.replay_ledger!r} did not open within {wait:g} s (a hung disk?)")
        ledger = opened[0]
        try:
            control = None
            if cfg.producer_control is not None:
                ep = cfg.control_endpoint()
                control = ControlClient(ep, client_context(ep), cfg.producer_control.host, cfg.producer_control.port)
            return ProducerLink(_link_name(cfg), cfg, cfg.load_hmac_key(), ledger, LedgerGuard(ledger), control, probe)
        except BaseException:
            ledger.close()
            raise

    def start(self, engine=None) -> "ReceiverNode":
        if engine is not None:
            self.engine = engine
        if self.engine is None:
            raise ProtocolError("state", "a decode node needs an engine to start", remote=False)
        self.bind()
        cfg, engine = self.config, self.engine
        self.layout = span_layout(engine.layout)
        self.geometry = TileGeometry.of(engine.layout)
        self.exact, self.target = wire_identity(engine)
        if self.exact.to_json() != cfg.identity or self.target != cfg.target_cache_identity_sha256:
            raise SecurityError(
                "config",
                f"{cfg.path}: the loaded engine's identity differs from the configured identity: run the --engine and --threads "
                "the identity file was written with (the thread count is part of the identity), or enroll the receiver with "
                "this engine's identity (kvpack identity --engine ... --threads ...)",
            )
        self.ladder = Ladder(engine, self.resident, self.store)
        self.slots = DecodeSlots(engine.new_session, self.decode_slot_count)
        # the handoff core hashes on the executor its driver passes (kvpack.handoff.hashing)
        self.hash_executor = ThreadPoolExecutor(max_workers=hash_workers(), thread_name_prefix="kvpack-receiver-hash")
        # one write in flight per data connection (kvpack.node.striping.StripeSink)
        self.install_executor = ThreadPoolExecutor(max_workers=MAX_STRIPES, thread_name_prefix="kvpack-receiver-install")
        assert self._sock is not None
        self.listener = Listener(
            "receiver-data",
            self._sock,
            self._data_ep,
            self._data_ctx,
            self._serve_data,
            limits=self.limits,
            refusals=self.refusal_log,
            on_refused=self._tls_refused,
            fronts=self._fronts,
        )
        self.listener.start()
        attach_receiver(self)  # status page sections and readiness checks
        if self._api_socket is not None:
            self.api = LocalApi(self._api_socket, self._api_request, self.api_limits, min(MAX_PROMPT_TOKENS, engine.max_context), on_reply=log_request).start()
        return self

    def _serve_metrics(self) -> None:
        """The observability listener binds with the other ports (fail fast); until
        :meth:`start` registered the node's readiness checks, /readyz answers 503."""
        if self._metrics_port is None or self.metrics.port is not None:
            return
        self.metrics.serve(self._metrics_port)

    def stop(self) -> None:
        for p in self.router.open():
            p.finish(error=ProtocolError("aborted", "receiver shutting down", remote=False))
        if self.api is not None:
            self.api.stop()
        self._release()

    def _release(self) -> None:
        if self.listener is not None:
            self.listener.stop()  # stops the fronts too
            self.listener = None
            self.refusal_log.close(timeout=0.5)  # its writer thread ends (at once, or when a hung write returns)
        elif self._sock is not None:
            self._sock.close()
        if self._fronts is not None:
            self._fronts.stop()
            self._fronts = None
        self._sock = None
        if self.api is None and self._api_socket is not None:
            self._api_socket.close()
        for pool in (self.hash_executor, self.install_executor):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self.metrics.close()
        self.receipts.close(timeout=1.0)  # what is queued, if the disk answers; never longer
        for link in self.links:
            link.ledger.close()

    # -- compatibility views (status page, tests) ---------------------------------------------

    @property
    def ledger(self) -> Optional[ReplayLedger]:
        return self.links[0].ledger if self.links else None

    @property
    def probe(self) -> Optional[ProbeResult]:
        return self.links[0].probe if self.links else None

    @property
    def key(self) -> Optional[bytes]:
        return self.links[0].key if self.links else None

    @property
    def session(self) -> Any:
        """The first decode slot's session (the only one with ``decode_slots=1``)."""
        assert self.slots is not None
        return self.slots.slots[0].session

    @property
    def live_prefilled(self) -> int:
        return self.slots.slots[0].live_prefilled if self.slots else 0

    @property
    def advertised_port(self) -> int:
        port = self._advertised_port or self.data_port
        if port is None:
            raise RuntimeError("the receiver has no data port before bind()")
        return port

    @property
    def unsolicited(self) -> bool:
        return all(link.unsolicited for link in self.links)

    def link_for_pin(self, pin: str) -> ProducerLink:
        for link in self.links:
            if pin in link.config.peer_leaf_sha256:
                return link
        raise SecurityError("pin", "peer leaf is pinned by no producer config")  # the TLS layer pinned it

    # -- data plane -----------------------------------------------------------------------

    def refuse(self, reason: str, detail: str, **extra) -> None:
        self.metrics.refusal(reason)
        self.metrics.transfer(reason)
        self.receipts.write({"role": "receiver", "verdict": "refused", "reason": reason, "detail": detail[:2000], **extra})

    def _tls_refused(self, reason: str, detail: str, peer: str, link: Optional[ProducerLink] = None) -> None:
        # a waiting request reports the receiver's category of a refusal (pin, certificate
        # ...), not a generic timeout. Before authentication the peer may be anyone: every
        # waiting request hears of it, ranked below its producer's own refusals (Pending.
        # refused); with ``link`` it was that producer's authenticated connection.
        for p in self.router.open():
            if link is None:
                p.refused(reason, f"{peer}: {detail}", authenticated=False)
            elif p.link is link:
                p.refused(reason, f"{peer}: {detail}", authenticated=True)

    def _serve_data(self, chan) -> None:
        """One authenticated data connection (a worker thread of the listener)."""
        t_conn = time.time_ns()
        link = self.link_for_pin(chan.peer.leaf_sha256)
        end = self._first_frame_deadline(link)
        try:
            raw, begin = first_frame(self, chan, end)
        except BaseException as exc:  # noqa: BLE001 - refused with a receipt
            err = exc
            # the TLS layer reports a peer silent since its handshake as a close: the truth is
            # that no begin arrived before the deadline (errata M8: dropped without a word)
            if isinstance(exc, TimeoutError) or time.monotonic() >= end:
                err = ProtocolError("aborted", f"read timed out: no begin before the accept deadline ({exc})", remote=False)
            reason, detail = verdict_of(err)
            self.refuse(reason, detail, phase="begin", peer=chan.peer_address, peer_leaf_sha256=chan.peer.leaf_sha256, producer=link.name)
            self._tls_refused(reason, detail, chan.peer_address, link)
            return
        if link.unsolicited:
            self._serve_unsolicited(chan, link, raw, begin, t_conn)
            return
        m = begin.manifest
        pending = self.router.route(m.transfer_id, m.prompt_token_ids, link)
        if pending is None:
            self._unroutable(chan, link, m)
            return
        try:
            stripe = parse_stripe(pending.request_id or "", m.transfer_id) or (0, 1)
            if stripe[1] > pending.stripes:
                raise ProtocolError("identity", f"transfer {m.transfer_id} is stripe {stripe[0]} of {stripe[1]}; the request allows {pending.stripes}")
            run = InboundRun(self, chan, pending, stripe, raw, t_conn)
        except KvpackError as exc:
            self.refuse(exc.category, exc.message, phase="begin", peer=chan.peer_address, transfer_id=m.transfer_id, generation=m.generation)
            pending.refused(exc.category, exc.message, authenticated=True)
            return
        out = run.run()
        if out.error is None:
            # bounded: a hung receipts disk makes the receipt pending, never the commit late
            out.info.update(self.receipts.record(out.info))
            pending.stripe_committed(stripe[0], out.info)
            return
        pending.refused(out.info["reason"], out.info["detail"], authenticated=True)
        if out.admitted:
            pending.finish(error=out.error)  # after admission a failure fails the request
        # before admission: drop this connection, keep waiting (errata M8)

    def _first_frame_deadline(self, link: ProducerLink) -> float:
        """When the first frame must be in: ``first_frame_s``, but never past the latest
        accept deadline of the requests waiting for this producer (a begin after that could
        not be admitted anyway); an unsolicited link (C.15: a silent peer is dropped after
        ``wait_for_producer_ms``, errata M8) or a solicited link with no waiting request gets
        its ``wait_for_producer_ms`` (the begin will be refused, its receipt names it)."""
        now = time.monotonic()
        cap = now + self.first_frame_s
        waiting = [] if link.unsolicited else [p.deadline for p in self.router.open() if p.link is link]
        if not waiting:
            return min(cap, now + link.config.wait_for_producer_ms / 1000.0)
        return min(cap, max(waiting))

    def _unroutable(self, chan, link: ProducerLink, m) -> None:
        """A begin naming no open request of its producer: refused (C.8 step 1); requests
        of that producer that are waiting report it (``identity``), as a single-request
        node always did."""
        waiting = [p for p in self.router.open() if p.link is link]
        reason = "identity" if waiting else "unsolicited"
        detail = f"transfer id {m.transfer_id[:128]!r} names no outstanding request of producer {link.name}"
        self.refuse(reason, detail, phase="begin", peer=chan.peer_address, transfer_id=m.transfer_id, generation=m.generation)
        for p in waiting:
            p.refused(reason, detail, authenticated=True)

    def _serve_unsolicited(self, chan, link: ProducerLink, raw: bytes, begin, t_conn: int) -> None:
        """C.15 without producer_control: admit any pinned producer's transfer (errata M8)."""
        assert self.engine is not None
        deadline = time.monotonic() + link.config.wait_for_producer_ms / 1000.0
        if not self._unsolicited_slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            m = begin.manifest
            self.refuse(
                "aborted",
                "receiver busy: every unsolicited slot holds a transfer",
                phase="begin",
                peer=chan.peer_address,
                producer=link.name,
                transfer_id=m.transfer_id,
                generation=m.generation,
            )
            return
        try:
            session = self.engine.new_session()
            end = deadline + link.config.timeout_ms / 1000.0
            pending = Pending(None, None, now_ms(), deadline, end, session, link)
            out = InboundRun(self, chan, pending, (0, 1), raw, t_conn).run()
            if out.error is None:
                self._land(session, out.info)
            if out.admitted or out.error is None:
                try:
                    self.landed.put_nowait(out)
                except queue.Full:
                    pass  # nobody reads it: the receipts are the record
        finally:
            self._unsolicited_slots.release()

    def _land(self, session, info: dict) -> None:
        """A committed unsolicited transfer: name its session, remember its rows (resident),
        save it as a prefix cut (store), then publish the receipt saying where it landed."""
        name = str(info["transfer_id"])
        # named at once (the producer already has its ACK and may ask for it), but locked
        # until the rows are copied and saved: a decode must not move the session under them
        lock = self.sessions.put(name, session, held=True)
        info["session"] = name
        t0 = time.perf_counter()
        try:
            if self._fits_resident(session.position):
                self.resident.insert(self.ladder.identity, RowsSource.capture(session, session.position))
            if self.store is not None:
                try:
                    rep = self.store.save(session, prefix_only=True)
                    info["saved"] = {"manifest_id": rep.manifest_id, "cut": rep.cut, "kind": rep.kind, "prefix_only": True}
                except KvpackError as exc:  # the transfer committed; a full disk degrades only this save
                    info["saved"] = {"error": f"{exc.category}: {exc.message}"[:500]}
        finally:
            lock.release()
        info["landing_s"] = round(time.perf_counter() - t0, 6)
        info.update(self.receipts.record(info))

    def _fits_resident(self, rows: int) -> bool:
        """Capturing rows for the resident tier copies them: skip what it would evict at once."""
        return self.resident.max_bytes > 0 and self.geometry.tile_bytes(rows) <= self.resident.max_bytes

    # -- requests -------------------------------------------------------------------------

    def expect(
        self,
        request_id: str,
        prompt: Sequence[int],
        *,
        t0_ms: Optional[int] = None,
        held: Optional[HeldPrefix] = None,
        held_source=None,
        wait_s: Optional[float] = None,
        session: Any = None,
        link: Optional[ProducerLink] = None,
        stripes: int = 1,
        cancel: CancelToken = NEVER,
    ) -> Pending:
        """Register an outstanding request its data connections must match (its install lands
        in ``session``: the first slot's unless given)."""
        link = link or next((lk for lk in self.links if not lk.unsolicited), None)
        if link is None:
            raise ProtocolError("state", "unsolicited mode (no producer_control): transfers land in named sessions, not in a request", remote=False)
        prompt = tuple(int(t) for t in prompt)
        wait = accept_wait_s(link.config, len(prompt)) if wait_s is None else wait_s
        start = time.monotonic()
        p = Pending(
            request_id,
            prompt,
            now_ms() if t0_ms is None else t0_ms,
            start + wait,
            start + wait + link.config.timeout_ms / 1000.0,
            session if session is not None else self.session,
            link,
            None if held is None else tuple(held.tokens),
            held_source,
            stripes,
            cancel,
        )
        self.router.add(p)
        return p

    def wait(self, pending: Pending, control: Optional[ControlSession] = None) -> dict:
        """Block until ``pending`` commits or fails; meanwhile watch the control channel (a
        producer's ``failed`` answer ends the wait early), the deadlines and the cancel
        token. Returns the committed outcome."""
        try:
            while not pending.event.wait(0.05):
                self._check_waiting(pending, control)
        except BaseException as exc:
            pending.finish(error=exc)
            raise
        finally:
            self.router.remove(pending)
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None  # finish() sets an outcome or an error
        return dict(pending.outcome)

    def _check_waiting(self, pending: Pending, control: Optional[ControlSession]) -> None:
        pending.cancel.check()
        if control is not None:
            resp = control.poll()
            if resp is not None and resp.status == "failed":
                raise pending.last_refusal(f"producer failed: {resp.error}")
        now = time.monotonic()
        if pending.shared is not None and pending.shared.failed is not None and not pending.shared.committed:
            # the refusing stripe records its category, then finishes the request with its
            # error; give it a moment before answering with less (``aborted``)
            if 3 in pending.refusals or now - (pending.failed_seen or now) >= SHARED_FAIL_GRACE_S:
                raise pending.last_refusal(f"transfer refused: {pending.shared.failed}")
            if pending.failed_seen is None:
                pending.failed_seen = now
        if not pending.admitted and now > pending.deadline:
            raise pending.last_refusal("no admissible transfer before the accept deadline")
        if now > pending.end:
            raise ProtocolError("aborted", "the transfer did not complete before its deadline", remote=False)

    def receive(self, request_id: str, prompt: Sequence[int], **kw) -> dict:
        """Wait for one transfer bound to ``request_id`` and ``prompt`` without sending a
        control request (tests and benchmarks drive the producer themselves)."""
        return self.wait(self.expect(request_id, prompt, **kw))

    def _new_request_id(self, t0_ms: int) -> str:
        # upstream's form "muser-<unix_ms>-<counter>": inside the muser- namespace the
        # transfer id must start with "<request_id>-" (errata M8), so the binding is strict
        return f"muser-{t0_ms}-{next(self._counter)}"

    def _pick_link(self, producer: Optional[str]) -> ProducerLink:
        links = [lk for lk in self.links if not lk.unsolicited]
        if not links:
            raise SecurityError(
                "config",
                f"{self.config.path}: no producer_control (unsolicited mode): this receiver cannot request prefill; decode a received session with --session",
            )
        if producer is not None:
            for lk in links:
                if lk.name == producer:
                    return lk
            raise UsageError("usage", f"no producer named {producer!r} (configured: {[lk.name for lk in links]})")
        return links[next(self._rr) % len(links)]

    def _remote(self, slot: Slot, tokens: list[int], plan: Plan, t0_ms: int, *, stripes: int, link: ProducerLink, cancel: CancelToken) -> dict:
        cut = plan.prefix_cut
        assert not cut or plan.held is not None  # an armed delta always names its held prefix
        held_source = self.ladder.materialize(plan.held) if cut and plan.held is not None else None
        rid = self._new_request_id(t0_ms)
        pending = self.expect(
            rid, tokens, t0_ms=t0_ms, held=plan.held if cut else None, held_source=held_source, session=slot.session, link=link, stripes=stripes, cancel=cancel
        )
        ext: dict[str, int] = {}
        if cut:
            ext[EXT_PREFIX_CUT] = cut
        if stripes > 1:
            ext[EXT_STRIPES] = stripes
        cfg = link.config
        req = ControlRequestV1(rid, t0_ms + cfg.timeout_ms, tuple(tokens), cfg.advertised_receiver_host or "127.0.0.1", self.advertised_port)
        assert link.control is not None
        try:
            ctl = link.control.request(req, ext, cancel=cancel.check)
        except BaseException as exc:
            pending.finish(error=exc)
            self.router.remove(pending)
            raise
        try:
            out = self.wait(pending, control=ctl)
            final = ctl.final(self.committed_wait_s, cancel.check)
        finally:
            ctl.close()
        out["control_s"] = round(ctl.control_s, 6)
        out["control_frames"] = ctl.frames
        out["producer_receipt"] = None if final is None or final.receipt is None else final.receipt.to_json()
        return out

    def generate(
        self,
        tokens: Sequence[int],
        max_new_tokens: int = 32,
        *,
        save: bool = False,
        stop_token_ids: Sequence[int] = (),
        cancel: CancelToken = NEVER,
        stripes: Optional[int] = None,
        producer: Optional[str] = None,
    ) -> dict:
        """Serve one prompt on a decode slot: ladder, handoff (or local reuse), boundary
        token, greedy decode. ``cancel`` stops it (and frees the slot) between steps."""
        assert self.slots is not None, "start() first"
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:
            raise ProtocolError("manifest", "a prompt needs at least 2 tokens (one is the held boundary)", remote=False)
        slot = self.slots.acquire(tokens, wait_s=self.slot_wait_s, cancel=cancel)
        try:
            t_start = time.perf_counter()
            before = slot.session.position
            result, plan = self._acquire(slot, tokens, t_start, cancel=cancel, stripes=stripes, producer=producer)
            self.metrics.reused.labels("receiver", plan.tier if plan.action is not ReuseAction.FULL_TRANSFER else "none").inc(
                plan.matched if plan.action is not ReuseAction.FULL_TRANSFER else 0
            )
            result.update(self._decode_prompt(slot, tokens, t_start, max_new_tokens, save, stop_token_ids, cancel))
            result["session_before"] = before
            result["slot"] = slot.index
            return result
        finally:
            self.slots.release(slot)

    def _acquire(
        self, slot: Slot, tokens: list[int], t_start: float, *, cancel: CancelToken, stripes: Optional[int], producer: Optional[str]
    ) -> tuple[dict, Plan]:
        """Bring the slot's session to the prompt minus its boundary token: local reuse, or a
        full or delta handoff. A producer that refuses kvpack's extension keys before
        "accepted" (an upstream prefilld) is asked again without them: one stream, full."""
        t0_ms = now_ms()
        plan = self.ladder.plan(tokens, slot.session, slot.live_prefilled)
        result: dict = {"prompt_tokens": len(tokens), "plan": plan.to_json(), "transfer": None}
        try:
            plan = self._settle_durable(slot, plan, tokens, result)
            if plan.action is ReuseAction.SERVE_LOCAL:
                self._serve_local(slot, plan, tokens)
            else:
                link = self._pick_link(producer)
                want = max(1, min(MAX_STRIPES, stripes or self.stripes))
                try:
                    result["transfer"] = self._remote(slot, tokens, plan, t0_ms, stripes=want, link=link, cancel=cancel)
                except RequestRefused as exc:
                    if not exc.extensions:
                        raise
                    result["extension_fallback"] = str(exc)[:500]
                    if plan.prefix_cut:
                        result["delta_fallback"] = str(exc)[:500]
                        plan = Plan(ReuseAction.FULL_TRANSFER, "none", 0, None, plan.lookup_s)
                        result["plan"] = plan.to_json()
                    result["transfer"] = self._remote(slot, tokens, plan, now_ms(), stripes=1, link=link, cancel=cancel)
        except BaseException:
            self.metrics.phases({"request_failed": time.perf_counter() - t_start})
            raise
        slot.live_prefilled = len(tokens) - 1
        return result, plan

    def _decode_prompt(
        self, slot: Slot, tokens: list[int], t_start: float, max_new_tokens: int, save: bool, stop_token_ids: Sequence[int], cancel: CancelToken
    ) -> dict:
        """The boundary token, greedy decoding, the resident entry and the optional save."""
        session = slot.session
        # Windowed layers drop their oldest row with every token: the prompt's rows [0, P-1)
        # (resident tier) and the prompt's cut (store) are taken while the windows ending
        # there are still held. Full-attention layouts do both after decoding (off TTFT).
        windowed = bool(self.engine.layout.windowed_layers())
        keep = self._fits_resident(len(tokens) - 1)
        entry = RowsSource.capture(session, len(tokens) - 1) if keep and windowed and session.position == len(tokens) - 1 else None
        t_b = time.perf_counter()
        local_prefill = 0
        if session.position < len(tokens):
            # the held-back boundary token (and nothing else) is computed here
            local_prefill = len(tokens) - session.position
            session.prefill(tokens[session.position :])
        boundary_s = time.perf_counter() - t_b
        ttft_s = time.perf_counter() - t_start
        self.metrics.prefilled.labels("receiver").inc(local_prefill)
        # The saved cut ends with the boundary row computed by a one-token forward; at an
        # aligned length it would be found as an aligned prefix and armed as a delta base,
        # where the producer's rows come from a chunked prefill. Never publish that one.
        saveable = save and self.store is not None and not is_token_aligned(len(tokens))
        logits_at_prompt = bytes(session.export_logits()) if saveable else None
        saved = self._save_prompt_cut(session, len(tokens), logits_at_prompt) if windowed else None
        t_d = time.perf_counter()
        out_tokens, rows = greedy(session, max_new_tokens, stop_token_ids, cancel if cancel is not NEVER else None)
        decode_s = time.perf_counter() - t_d
        self.metrics.phases({"ttft": ttft_s, "boundary": boundary_s, "decode": decode_s})
        if not windowed:
            entry = RowsSource.capture(session, len(tokens) - 1) if keep else None
            saved = self._save_prompt_cut(session, len(tokens), logits_at_prompt)
        if entry is not None:
            self.resident.insert(self.ladder.identity, entry)
        self._last_logit_rows = rows
        return {
            "tokens": out_tokens,
            "logits_sha256": hashlib.sha256(logits_bytes(rows)).hexdigest(),
            "tokens_sha256": hashlib.sha256(json.dumps(out_tokens).encode()).hexdigest(),
            "ttft_s": round(ttft_s, 6),
            "boundary_s": round(boundary_s, 6),
            "decode_s": round(decode_s, 6),
            "local_prefill_tokens": local_prefill,
            "saved": saved,
        }

    def _save_prompt_cut(self, session, cut: int, logits: Optional[bytes]) -> Optional[dict]:
        """Save the prompt's cut (``save``). The pack store is a cache tier: a full or
        failing store disk degrades only this save (``{"error": ...}`` in the reply, one log line),
        as for a landed unsolicited transfer and the producer's own saves. Before, the whole
        request failed after its transfer and decode: the client lost its completion."""
        if logits is None or self.store is None:
            return None
        try:
            rep = self.store.save(session, cut=cut, logits=logits)
        except (KvpackError, OSError) as exc:
            category = exc.category if isinstance(exc, KvpackError) else "io"
            message = exc.message if isinstance(exc, KvpackError) else str(exc)
            log.warning("saving the prompt's cut %d failed (%s: %s); the request is served without it", cut, category, message[:300])
            return {"error": f"{category}: {message}"[:500]}
        return {"manifest_id": rep.manifest_id, "cut": rep.cut, "kind": rep.kind, "seconds": round(rep.seconds, 4)}

    def continue_session(
        self, name: str, tokens: Sequence[int], max_new_tokens: int = 32, *, stop_token_ids: Sequence[int] = (), cancel: CancelToken = NEVER
    ) -> dict:
        """Decode from a received (named) session: ``tokens`` is the whole prompt so far; it
        must start with the session's tokens, and what follows (at least the boundary token
        the producer held back, unless the session already decoded) is computed here."""
        tokens = [int(t) for t in tokens]
        session, lock = self.sessions.get(name)
        # one request at a time per named session: the wait has the decode slots' deadline
        # and stops as soon as the request is cancelled (its client went away)
        end = time.monotonic() + self.slot_wait_s
        while not lock.acquire(timeout=0.1):
            cancel.check()
            if time.monotonic() >= end:
                raise NetworkError("timeout", f"session {name!r} stayed busy for {self.slot_wait_s:g} s; retry later")
        slots = self.slots
        assert slots is not None  # made by start()
        slot: Optional[Slot] = None
        try:
            # a decode like any other: it holds a decode slot (the slot's own session is left
            # as it is), so the decode-slot cap bounds every decode in flight. Taken after the
            # session's lock (a request never holds a slot while it waits for a busy session),
            # within the same deadline; over the cap: ``timeout`` ("all N decode slots ...").
            slot = slots.acquire((), wait_s=max(0.0, end - time.monotonic()), cancel=cancel)
            cancel.check()
            t_start = time.perf_counter()
            held = list(session.tokens)
            if tokens[: len(held)] != held:
                raise ProtocolError("identity", f"the prompt does not start with the {len(held)} tokens session {name!r} holds", remote=False)
            rest = tokens[len(held) :]
            if not rest and session.last_logits is None:
                raise UsageError("usage", f"session {name!r} holds the prompt minus its boundary token: send the whole prompt (at least one more token)")
            if rest:
                session.prefill(rest)
            ttft_s = time.perf_counter() - t_start
            t_d = time.perf_counter()
            out_tokens, rows = greedy(session, max_new_tokens, stop_token_ids, cancel if cancel is not NEVER else None)
            decode_s = time.perf_counter() - t_d
            self.metrics.phases({"ttft": ttft_s, "decode": decode_s})
            return {
                "session": name,
                "prompt_tokens": len(tokens),
                "plan": {"action": "session", "tier": "received", "matched": len(held), "prefix_cut": 0},
                "transfer": None,
                "tokens": out_tokens,
                "logits_sha256": hashlib.sha256(logits_bytes(rows)).hexdigest(),
                "tokens_sha256": hashlib.sha256(json.dumps(out_tokens).encode()).hexdigest(),
                "ttft_s": round(ttft_s, 6),
                "decode_s": round(decode_s, 6),
                "local_prefill_tokens": len(rest),
                "session_position": session.position,
            }
        finally:
            if slot is not None:
                slots.release(slot, touched=False)
            lock.release()

    def _settle_durable(self, slot: Slot, plan: Plan, tokens: list[int], result: dict) -> Plan:
        """Restore a durable plan's cut up front: a cut failing verification is quarantined
        and is a miss, so the ladder plans again (the store heals; the request still serves)."""
        for _attempt in range(4):
            if plan.held is None or plan.held.tier != "durable" or plan.action is ReuseAction.FULL_TRANSFER:
                return plan
            try:
                if plan.action is ReuseAction.SERVE_LOCAL and plan.held.matched == len(tokens):
                    assert isinstance(plan.held.source, tuple)  # a durable hit's source is (hit, tokens)
                    hit, hit_tokens = plan.held.source
                    self.ladder.restore_durable(hit, slot.session, list(hit_tokens))  # verified, with its logits
                    plan.held.source = ("restored", slot.session)
                else:
                    plan.held.source = ("restored", self.ladder.materialize(plan.held))
                return plan
            except DurableMiss as miss:
                result.setdefault("quarantined", []).append(miss.receipt)
                plan = self.ladder.plan(tokens, slot.session, slot.live_prefilled)
                result["plan"] = plan.to_json()
            except StoreError as exc:
                if exc.category != "io":
                    raise
                # the store's storage failed the restore (EIO; an S3 server that did not
                # answer within the restore's deadline): nothing was installed, so the request
                # is planned again without the durable tier and recomputes (or transfers)
                log.warning("durable restore failed (%s); planning without the store", exc.message)
                result.setdefault("durable_unreadable", []).append(exc.message[:300])
                plan = self.ladder.plan(tokens, slot.session, slot.live_prefilled, durable=False)
                result["plan"] = plan.to_json()
        return plan

    def _serve_local(self, slot: Slot, plan: Plan, tokens: list[int]) -> None:
        held = plan.held
        assert held is not None  # SERVE_LOCAL is only planned from a held prefix
        if held.tier == "durable" and held.matched == len(tokens):
            return  # restored into the slot's session by _settle_durable
        source = self.ladder.materialize(held)
        cut = len(tokens) - 1
        install = slot.session.begin_install(cut, tokens[:cut], self.engine.identity)
        try:
            copy_prefix(source, install, self.geometry, cut)
            install.commit(require_logits=False)
        except BaseException:
            install.abort()
            raise

    # -- local API --------------------------------------------------------------------------

    def _api_request(self, req: dict, cancel: CancelToken) -> dict:
        """One checked local API request (see :func:`kvpack.node.local_api.parse_request`)."""
        if req.get("op") == "sessions":
            return {"sessions": self.sessions.names(), "mode": "unsolicited" if self.unsolicited else "solicited"}
        if "tokens" in req:
            tokens = req["tokens"]
        else:
            from ..generate import chat_tokens

            tokens = chat_tokens(self.engine, req["prompt"], chat=req["chat"])
        eos = getattr(getattr(self.engine, "tokenizer", None), "eos_token_id", None)
        stops = [eos] if eos is not None and req["stop_at_eos"] else []
        n = req["max_new_tokens"]
        from ..generate import check_context

        check_context(self.engine, len(tokens), n)  # before a slot or a named session is taken
        if req.get("session") is not None:
            res = self.continue_session(req["session"], tokens, n, stop_token_ids=stops, cancel=cancel)
        else:
            res = self.generate(tokens, n, save=req["save"], stop_token_ids=stops, cancel=cancel, stripes=req.get("stripes"), producer=req.get("producer"))
        if getattr(self.engine, "tokenizer", None) is not None:
            res["text"] = self.engine.decode(res["tokens"])
        return res
