"""One inbound Handoff V2 data connection on the decode node, from a TLS-verified channel to a
committed install (or a typed refusal with a receipt).

Why it exists: the decode node serves many data connections at once -- several requests in
flight, each perhaps striped over several connections -- and every one must be bound to the
right request *before* a byte of its payload is read. The flow per connection:

1. **First frame under a deadline.** Only the preamble and header of the first frame are
   read (``first_frame_s``; a begin carries no payload, and a segment header before a begin
   is refused before its payload is sized). The begin's transfer id names the request
   (``<request_id>-<generation>``, errata M8) and, for a striped transfer, the stripe
   (``...-s<index>.<count>``, :mod:`.striping`).
2. **Routing.** :meth:`Router.route` finds the outstanding request of *that producer* (the
   peer's pinned leaf picks the producer link: its key, key id and replay ledger) by
   transfer id, or by prompt for ids outside the ``muser-`` namespace. No request: refused
   ``unsolicited``. A link without ``producer_control`` takes unsolicited transfers instead
   (C.15): each lands in a new named session.
3. **The sans-I/O receiver** (:class:`kvpack.handoff.Receiver`) checks everything of C.4/C.8
   in the spec's order; :class:`~kvpack.node.striping.StripeSink` scatters each verified
   segment into the request's detached install (shared by its stripes); every read runs
   under the accept deadline before admission and, after it, under ``timeout_ms`` per read
   and the request's whole-transfer deadline; a cancelled request stops the loop.
4. **Commit** happens inside the state machine (seal, HMAC, completeness, durable
   reservation, then the stripes' commit barrier); the ACK is written and nothing more is
   read (errata H4).

What it must never do: read a payload for a connection it has not routed, touch the landing
session outside the install's commit, or let a peer hold a worker past a deadline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import KvpackError, ProtocolError
from ..handoff.admission import AdmissionExpectations
from ..handoff.events import Begin
from ..handoff.frames import PREAMBLE, PREAMBLE_BYTES, FrameDecoder, FrameLimits
from ..handoff.receiver import Admitted, Committed, Receiver, SegmentStored
from ..handoff.receiver import ReceiverConfig as HandoffReceiverConfig
from .common import refusal_error, verdict_of
from .ledger_gate import LedgerGate
from .local_api import NEVER, CancelToken
from .striping import SharedInstall, StripeSink, parse_stripe
from .transport import Deadline, fill
from .wire import copy_prefix, held_digest, scatter_tile, tile_landed, tile_target

FIRST_FRAME_S = 30.0
#: a payload's digests are fed in ranges of this size while it arrives: 1 MiB instead of the
#: core's 256 KiB default, so the stripes of a transfer (threads of one process) take the
#: GIL a quarter as often for the hand-offs to the hash lanes, at a lag of ~1 MiB of hashing
NODE_STREAM_HASH_CHUNK = 1 << 20
#: the first frame's header limit: the largest begin (131,072 token ids of up to 10 digits,
#: identity and components) is ~1.5 MB of JSON; a header declared longer than this is refused
#: before it is allocated, so a peer in its first frame costs the node at most this much
FIRST_FRAME_MAX_HEADER = 2 << 20


class PayloadBufferPool:
    """Payload buffers kept between data connections (at most ``max_bytes`` idle), so a
    transfer does not allocate, zero-fill and page-fault two tile-sized buffers per
    connection. Only buffers of a committed transfer come back (its receiver hands them out
    only then); a buffer is in one connection's hands at a time."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, count: int) -> list[bytearray]:
        with self._lock:
            self._free.sort(key=len)
            out = self._free[-count:] if count else []
            del self._free[len(self._free) - len(out) :]
            return out

    def give(self, buffers: list[bytearray]) -> None:
        with self._lock:
            held = sum(len(b) for b in self._free)
            for buf in sorted(buffers, key=len, reverse=True):
                if held + len(buf) <= self.max_bytes:
                    self._free.append(buf)
                    held += len(buf)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for b in self._free)


@dataclass
class Pending:
    """One outstanding request: what its data connections must be, and how it ended.

    ``deadline`` (monotonic) bounds the wait for an admissible begin, ``end`` the whole
    transfer; ``stripes`` is the most stripes the request allows (1: one stream)."""

    request_id: Optional[str]
    prompt: Optional[tuple[int, ...]]
    t0_ms: int
    deadline: float
    end: float
    session: Any
    link: Any = None
    held_tokens: Optional[tuple[int, ...]] = None
    held_source: Any = None
    stripes: int = 1
    cancel: CancelToken = NEVER
    event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    admitted: bool = False
    done: bool = False
    outcome: Optional[dict] = None
    error: Optional[BaseException] = None
    #: the latest refusal of each rank (:data:`REFUSAL_RANKS`): what the request reports
    refusals: dict = field(default_factory=dict)
    shared: Optional[SharedInstall] = None
    committed_stripes: dict = field(default_factory=dict)
    #: when the waiter first saw the shared install failed with no refusal of the producer's
    #: own connections recorded yet (the refusing stripe is still reporting it)
    failed_seen: Optional[float] = None

    def finish(self, outcome: Optional[dict] = None, error: Optional[BaseException] = None) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            self.outcome, self.error = outcome, error
            shared = self.shared
        if error is not None and shared is not None:
            shared.fail(f"{type(error).__name__}: {error}")
        self.event.set()

    def install_for(
        self, count: int, open_install: Callable, scatter: Callable, targets: Optional[Callable] = None, landed: Optional[Callable] = None
    ) -> SharedInstall:
        """The request's one detached install, made by its first admitted stripe."""
        with self.lock:
            if self.done:
                raise ProtocolError("state", "the request this connection could serve is finished", remote=False)
            if self.shared is None:
                self.shared = SharedInstall(count, open_install, scatter, self.end, targets, landed)
            elif self.shared.count != count:
                raise ProtocolError("identity", f"stripe count {count} differs from the request's first stripe ({self.shared.count})")
            return self.shared

    def stripe_committed(self, index: int, info: dict) -> None:
        with self.lock:
            self.committed_stripes[index] = info
            complete = self.shared is not None and len(self.committed_stripes) == self.shared.count
        if complete:
            self.finish(outcome=merge_stripes(self.committed_stripes))

    def refused(self, category: str, detail: str, *, authenticated: bool) -> None:
        """Remember a refusal that may explain why this request is not served: one of its
        producer's authenticated connections (``authenticated``), or a connection refused
        before authentication -- by anyone: see :data:`REFUSAL_RANKS`."""
        rank = 3 if authenticated else REFUSAL_RANKS.get(category, 1)
        with self.lock:
            self.refusals[rank] = (category, detail[:2000])

    def last_refusal(self, why: str) -> KvpackError:
        """The request's error: the category of the most telling refusal seen -- the latest
        of the highest rank -- so a flood of junk connections from anyone cannot replace the
        producer's own refusal (``identity``, ``pin`` ...) with ``tls``."""
        with self.lock:
            last = self.refusals[max(self.refusals)] if self.refusals else None
        if last is None:
            return ProtocolError("aborted", why)
        return refusal_error(last[0], f"{why} (last refusal {last[0]}: {last[1][:200]})")


#: how much a refusal before authentication says about a waiting request: a peer refused for
#: its pin or ALPN passed the cluster CA (an enrolled node: perhaps the producer with a leaf
#: this node does not pin); anything else (not TLS, a timeout, a self-signed certificate, a
#: limit) can come from anyone. Refusals of the producer's authenticated connections rank 3.
REFUSAL_RANKS = {"pin": 2, "alpn": 2}


def merge_stripes(infos: dict[int, dict]) -> dict:
    """One request's outcome from its stripes' receipts (one stripe: that receipt)."""
    ordered = [infos[i] for i in sorted(infos)]
    if len(ordered) == 1:
        return dict(ordered[0], stripes=1)
    first = dict(ordered[0])
    stamps = [o.get("timestamps") or {} for o in ordered]
    first.update(
        stripes=len(ordered),
        segments=sum(o.get("segments", 0) for o in ordered),
        segments_in_place=sum(o.get("segments_in_place", 0) for o in ordered),
        payload_bytes=sum(o.get("payload_bytes", 0) for o in ordered),
        transfer_ids=[o.get("transfer_id") for o in ordered],
        generations=[o.get("generation") for o in ordered],
        receipt_paths=[o.get("receipt_path") for o in ordered],
        receipt_states=[o.get("receipt_state") for o in ordered],
        timestamps={
            "admitted_unix_ns": min(s.get("admitted_unix_ns", 1 << 62) for s in stamps),
            "committed_unix_ns": max(s.get("committed_unix_ns", 0) for s in stamps),
        },
    )
    return first


class Router:
    """Outstanding requests by id, per producer link; routes a begin to its request."""

    def __init__(self) -> None:
        self._by_id: dict[str, Pending] = {}
        self._lock = threading.Lock()

    def add(self, pending: Pending) -> None:
        assert pending.request_id is not None
        with self._lock:
            if pending.request_id in self._by_id:
                raise ProtocolError("state", f"request {pending.request_id} is already outstanding", remote=False)
            self._by_id[pending.request_id] = pending

    def remove(self, pending: Pending) -> None:
        with self._lock:
            if pending.request_id is not None and self._by_id.get(pending.request_id) is pending:
                del self._by_id[pending.request_id]

    def open(self) -> list[Pending]:
        with self._lock:
            return [p for p in self._by_id.values() if not p.done]

    def route(self, transfer_id: str, prompt: tuple[int, ...], link: Any) -> Optional[Pending]:
        """The open request of ``link`` this begin names: ``<request_id>-...`` when the id is
        in the ``muser-`` namespace, else the one request whose prompt it carries."""
        with self._lock:
            candidates = [p for p in self._by_id.values() if not p.done and p.link is link]
        for p in candidates:
            if p.request_id is not None and transfer_id.startswith(p.request_id + "-"):
                return p
        if transfer_id.startswith("muser-"):
            return None
        by_prompt = [p for p in candidates if p.prompt is not None and p.prompt[:-1] == prompt]
        return by_prompt[0] if len(by_prompt) == 1 else None


def read_first_frame(chan: Any, deadline: Deadline, limits: FrameLimits, cancelled: Callable[[], bool] | None = None) -> tuple[bytes, Any]:
    """The raw bytes and the event of the connection's first frame. A frame with a payload
    is refused at its header (no payload precedes an admitted begin)."""

    def no_payload_yet(_segment, _length) -> None:
        raise ProtocolError("state", "segment before an admitted begin: no payload is read before admission")

    decoder = FrameDecoder(limits, payload_gate=no_payload_yet)
    raw = bytearray()
    while True:
        buf = decoder.wanted()
        got = fill(chan, buf, deadline, cancelled)
        raw += buf[:got]
        if got < len(buf):
            decoder.advance(got)
            decoder.eof()  # raises: truncated
            raise ProtocolError("aborted", "the peer closed before its first frame")
        frame = decoder.advance(got)
        if frame is not None:
            return bytes(raw), frame


@dataclass
class Outcome:
    """How a data connection ended: ``error`` None means committed (``info`` is its receipt
    body, not yet written: the caller adds where the transfer landed)."""

    admitted: bool
    info: dict
    error: Optional[BaseException] = None


class InboundRun:
    """One routed data connection: the receive loop and its receipt body."""

    def __init__(self, node: Any, chan: Any, pending: Pending, stripe: tuple[int, int], first: bytes, t_conn: int) -> None:
        self.node, self.chan, self.pending, self.first = node, chan, pending, first
        self.index, self.count = stripe
        link = pending.link
        cfg = link.config
        in_place = getattr(node, "receive_in_place", True)
        self.shared = pending.install_for(
            self.count, self._open_install, self._scatter, self._targets if in_place else None, self._landed if in_place else None
        )
        # segments are written into the install on the node's install pool while the next
        # one is read (two payload buffers, see kvpack.node.striping); no pool: inline
        install_pool = getattr(node, "install_executor", None)
        self.sink = StripeSink(self.shared, self.index, install_pool)
        self.buffers: Optional[PayloadBufferPool] = getattr(node, "payload_buffers", None)
        buffers = 1 if install_pool is None else 2
        self.gate = LedgerGate(link.guard, node.metrics.reservation)
        expectations = AdmissionExpectations(
            identity=node.exact,
            target_cache_identity_sha256=node.target,
            max_context=node.engine.max_context,
            request_prompt=pending.prompt,
            request_id=pending.request_id,
        )
        self.rx = Receiver(
            HandoffReceiverConfig(
                link.key, cfg.hmac_key_id, cfg.minimum_hmac_epoch, layout=node.layout, expectations=expectations, stripe=stripe if self.count > 1 else None
            ),
            self.sink,
            self.gate,
            now_unix_ms=pending.t0_ms,
            held_token_ids=pending.held_tokens,
            hash_executor=node.hash_executor,
            stream_hash_chunk=NODE_STREAM_HASH_CHUNK,
            payload_buffers=buffers,
            reuse_buffers=() if self.buffers is None else self.buffers.take(buffers),
        )
        self.stamps: dict[str, int | str] = {"connected_unix_ns": t_conn, "tls_verified_unix_ns": time.time_ns()}
        self.perf: dict[str, float] = {"begin_wait0": time.perf_counter()}
        self.admitted = False

    def _open_install(self, manifest: Any, prefix_cut: int) -> Any:
        node, p = self.node, self.pending
        install = p.session.begin_install(manifest.position, list(manifest.prompt_token_ids), node.engine.identity)
        if prefix_cut:
            if p.held_source is None:  # admission already proved we hold it; be explicit anyway
                install.abort()
                raise ProtocolError("delta", "delta without a held prefix source", remote=False)
            t0 = time.perf_counter()
            try:
                self.shared.t["prefix_bytes"] = copy_prefix(p.held_source, install, node.geometry, prefix_cut)
            except BaseException:
                install.abort()
                raise
            self.shared.t["prefix_copy_s"] = time.perf_counter() - t0
        return install

    def _scatter(self, install: Any, descriptor: Any, payload: memoryview) -> None:
        scatter_tile(install, self.node.geometry, descriptor, payload)

    def _targets(self, install: Any, descriptor: Any) -> Optional[list[memoryview]]:
        return tile_target(install, self.node.geometry, descriptor)

    def _landed(self, install: Any, descriptor: Any) -> None:
        tile_landed(install, self.node.geometry, descriptor)

    def run(self) -> Outcome:
        try:
            committed = self._pump()
        except BaseException as exc:  # noqa: BLE001 - every failure is a refusal with a receipt
            return self._refused(exc)
        # Committed (C.8 steps 7-9 inside the state machine): the ACK, then close (H4).
        try:
            self.chan.settimeout(10.0)
            self.chan.sendall(committed.ack)
            self.stamps["ack_unix_ns"] = time.time_ns()
        except (OSError, KvpackError) as exc:  # C.8 step 6: only logged; a retry is a replay
            self.stamps["ack_error"] = str(exc)[:200]
        if self.buffers is not None:
            self.buffers.give(self.rx.release_payload_buffers())
        info = self.info()
        self.node.metrics.transfer("committed", committed.total_bytes)
        self.node.metrics.phases(dict(info["durations_s"]))
        info.update(role="receiver", verdict="committed", peer=self.chan.peer_address, peer_leaf_sha256=self.chan.peer.leaf_sha256)
        return Outcome(True, info)

    def _deadline(self) -> Deadline:
        if not self.admitted:  # the accept deadline bounds the whole wait, not each read
            return Deadline.until(self.pending.deadline, what="accept")
        return Deadline.until(self.pending.end, self.pending.link.config.timeout_ms / 1000.0, "transfer")

    def _pump(self) -> Committed:
        """Feed the state machine until it commits (or raises its typed refusal)."""
        rx, cancelled = self.rx, self._cancelled
        # effects are stamped with the arrival of the bytes that caused them (taken before
        # the state machine ran): the seal's stamp precedes its checks, reserve and commit,
        # so "wire" is the wire alone and "verify" never goes negative
        t_got = time.perf_counter()
        effects = rx.receive_data(self.first)
        while True:
            for e in effects:
                done = self._effect(e, t_got)
                if done is not None:
                    return done
            # Fill the whole wanted() view (the rest of a preamble or header, or the next hash
            # range of a payload), then advance once.
            buf = rx.wanted()
            want = len(buf)
            if not want:
                raise ProtocolError("state", "receiver finished without a commit", remote=False)
            got = fill(self.chan, buf, self._deadline(), cancelled)
            t_got = time.perf_counter()
            effects = rx.advance(got) if got else []
            if got < want:
                rx.eof()  # raises: the stream ended before the seal

    def _cancelled(self) -> Optional[str]:
        """Why this connection must stop reading now (None: it goes on). The reason becomes
        its refusal's detail: a stripe stopped because a sibling was refused says so (it
        said "the request ... was cancelled", as if the client had gone away)."""
        p = self.pending
        if p.cancel.cancelled:
            return "cancelled: the request this transfer serves was cancelled (its client went away)"
        if self.shared.failed is not None:
            return f"another stripe of this transfer was refused: {self.shared.failed}"
        if p.done and p.error is not None:
            return f"the request this transfer serves already failed: {p.error}"[:600]
        return None

    def _effect(self, e: Any, t_recv: float) -> Optional[Committed]:
        if isinstance(e, Admitted):
            self.admitted = True
            self.pending.admitted = True
            self.perf["admitted"] = t_recv
            self.stamps["admitted_unix_ns"] = time.time_ns()
        elif isinstance(e, SegmentStored) and "first_segment" not in self.perf:
            self.perf["first_segment"] = t_recv
            self.stamps["first_segment_unix_ns"] = time.time_ns()
        elif isinstance(e, Committed):
            self.perf["seal"] = t_recv
            self.stamps["committed_unix_ns"] = time.time_ns()
            return e
        return None

    def _refused(self, exc: BaseException) -> Outcome:
        # The state machine raised its own typed refusal (and aborted the sink); anything
        # else (TLS record failure, reset, timeout, cancellation) is a local abort.
        err = exc
        if not self.admitted and time.monotonic() >= self.pending.deadline:
            err = ProtocolError("aborted", "read timed out: no admissible begin before the accept deadline", remote=False)
        elif isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
            err = ProtocolError("aborted", f"read timed out ({exc})", remote=False)
        if self.rx.error is None:
            self.rx.abort(f"{type(exc).__name__}: {exc}")
        if self.admitted:
            self.shared.fail(f"stripe {self.index}: {verdict_of(err)[0]}")
        reason, detail = verdict_of(err)
        # the request hears the category before anything slower (the receipt) runs: its
        # waiter may already see the shared install failed and report the best refusal known
        self.pending.refused(reason, detail, authenticated=True)
        info = self.info()
        phase = "admitted" if self.admitted else "begin"
        self.node.refuse(reason, detail, phase=phase, peer=self.chan.peer_address, peer_leaf_sha256=self.chan.peer.leaf_sha256, **info)
        return Outcome(self.admitted, {**info, "reason": reason, "detail": detail[:2000], "phase": phase}, err)

    def info(self) -> dict:
        """The receipt body: what was transferred, digests, timestamps and phase durations.
        A begin refused before admission still names its transfer id and generation."""
        rx, p = self.rx, self.pending
        m = rx.manifest or rx.offered
        core = rx.seal_core()
        return {
            "request_id": p.request_id,
            "mode": "unsolicited" if p.request_id is None else "solicited",
            "producer": p.link.name,
            "transfer_id": None if m is None else m.transfer_id,
            "generation": None if m is None else m.generation,
            "position": None if m is None else m.position,
            "prefix_cut": rx.prefix_cut,
            "stripe": [self.index, self.count],
            "held_tokens": 0 if p.held_tokens is None else len(p.held_tokens),
            "held_prefix_sha256": None if p.held_tokens is None else held_digest(p.held_tokens),
            "segments": rx.segments_received,
            "segments_in_place": self.sink.in_place,
            "payload_bytes": rx.bytes_received,
            "prefix_bytes_copied": int(self.shared.t.get("prefix_bytes", 0)) if self.index == 0 else 0,
            "digests": None if core is None else {k: getattr(core, k) for k in ("begin_sha256", "descriptor_sha256", "payload_sha256")},
            "timestamps": self.stamps,
            "durations_s": {k: round(v, 6) for k, v in self._durations().items()},
        }

    def _durations(self) -> dict[str, float]:
        perf, t, g, shared = self.perf, self.sink.t, self.gate.t, self.shared.t
        d: dict[str, float] = {}
        if "admitted" in perf:
            d["wait_begin"] = perf["admitted"] - perf["begin_wait0"]
        if "seal" in perf and "admitted" in perf:
            d["wire"] = perf["seal"] - perf["admitted"]
        if "prepare0" in t and "seal" in perf:
            d["verify"] = t["prepare0"] - perf["seal"]
        if "prepare1" in shared:
            d["prepare"] = shared["prepare1"] - shared["prepare0"]  # the whole install, once
        if "reserve1" in g:
            d["reserve"] = g["reserve1"] - g["reserve0"]
        if "commit1" in shared:
            d["commit"] = shared["commit1"] - shared["commit0"]
        if "commit1" in t and self.count > 1:
            d["stripe_barrier"] = t["commit1"] - t["commit0"]  # waiting for the other stripes
        if "prefix_copy_s" in shared and self.index == 0:
            d["prefix_copy"] = shared["prefix_copy_s"]
        return d


def first_frame(node: Any, chan: Any, end: float) -> tuple[bytes, Begin]:
    """The connection's first frame by ``end`` (monotonic); it must be a begin."""
    raw, frame = read_first_frame(chan, Deadline.until(end, what="first frame"), FrameLimits(max_header=FIRST_FRAME_MAX_HEADER))
    if not isinstance(frame, Begin):
        raise ProtocolError("state", f"first frame is {type(frame).__name__.lower()}, not a begin")
    return raw, frame


__all__ = [
    "FIRST_FRAME_S",
    "InboundRun",
    "Outcome",
    "PayloadBufferPool",
    "Pending",
    "Router",
    "first_frame",
    "merge_stripes",
    "parse_stripe",
    "PREAMBLE",
    "PREAMBLE_BYTES",
]
