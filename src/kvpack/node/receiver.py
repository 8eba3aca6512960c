"""The decode node (``kvpack receiver``): Handoff V2 over mutual TLS into a live engine session.

Figure 30.1 of seed 003, steps 1 and 3-10 from this side:

1. a prompt arrives (local API); the reuse ladder (:mod:`.ladder`) serves it locally, arms
   a delta, or asks for a full transfer; the node writes one MUPCTL1 request on the control
   ALPN (with its own leaf), reads ``accepted`` and then keeps that connection open and
   silent (errata H2) -- the data listener was bound at start-up (errata M9);
3. the producer connects back on the data ALPN; the TLS layer proves *who* (TLS 1.3, CA,
   leaf pin, exact ALPN) before a byte of protocol is read; a refused handshake is a receipt;
4-6. the sans-I/O :class:`kvpack.handoff.Receiver` checks everything of C.4/C.8 in the
   spec's order (transfer id of the outstanding request, ``replay.admit``, expiry,
   ``validate_begin``, identity / prompt-minus-boundary / target cache / components
   admission, ``prefix_cut`` against the held tokens, schedule witness, per-segment digests)
   while :class:`EngineSink` scatters each verified tile into a *detached* engine install as
   it arrives (``recv_into`` the decoder's buffer, one copy into the install: memory is one
   frame plus the detached generation, never the whole transfer);
7. the seal's HMAC and completeness are verified and the install is prepared (complete);
8. the replay ledger reserves the generation durably (write, fsync, rename, dir fsync) --
   the volume was probed at bind time (``check_ledger_volume``);
9. the install commits atomically into the live session;
10. the ACK is written and the connection closed without reading further (errata H4).

Then the node decodes the held-back boundary token itself and generates greedily. Every
connection, committed or refused, leaves a JSON receipt (phase timestamps, bytes, digests,
verdict or refusal reason) written durably, and Prometheus metrics (:mod:`.metrics`).

Refusals before admission (wrong transfer id, replayed or stale generation, identity
mismatch, malformed begin) drop that connection and keep waiting until the accept deadline
(errata M8); refusals after admission fail the request. Nothing is installed before step 9,
so the live session is exactly as it was after any refusal.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..errors import EngineError, KvpackError, ProtocolError, SecurityError, UsageError
from ..handoff.admission import AdmissionExpectations
from ..handoff.control import ControlRequestV1, ControlResponse, encode_control
from ..handoff.delta import ReuseAction
from ..handoff.receiver import Admitted, Committed, Receiver, SegmentStored
from ..handoff.receiver import ReceiverConfig as HandoffReceiverConfig
from ..security.config import ReceiverConfig
from ..security.ledger import ReplayLedger
from ..security.probe import ProbeResult, check_ledger_volume
from ..security.tls import client_context, connect, listen, server_context, wrap_accepted
from ..vocab import is_token_aligned
from .common import ReceiptWriter, close_listener, greedy, hash_workers, logits_bytes, now_ms, read_control, readable, verdict_of
from .ladder import DurableMiss, HeldPrefix, Ladder, Plan, ResidentRadix, RowsSource
from .metrics import NodeMetrics
from .status import attach_receiver, log_request
from .wire import TileGeometry, copy_prefix, held_digest, scatter_tile, span_layout, wire_identity

#: kvpack's extension key in the MUPCTL1 request: the delta cut the receiver armed. The
#: upstream request V1 has no such field (errata L1); a producer that does not know it
#: refuses the request, and the receiver then retries without it (a full transfer).
EXT_PREFIX_CUT = "kvpack_prefix_cut"


class EngineSink:
    """Handoff sink writing verified tiles straight into a detached engine install.

    ``begin`` opens ``session.begin_install(position, prompt)`` (the engine refuses another
    identity) and, for a delta, copies rows ``[0, cut)`` from the held prefix; each
    ``write_segment`` scatters one tile (the payload view is consumed during the call);
    ``prepare`` proves completeness; ``commit`` swaps the live session atomically;
    ``abort`` drops the install. Timestamps feed the receipt's phase split.
    """

    def __init__(self, session, geometry: TileGeometry, identity, held_source=None) -> None:
        self.session = session
        self.geometry = geometry
        self.identity = identity
        self.held_source = held_source
        self.install: Any = None  # the engine's install handle (engines are duck-typed)
        self.copied_bytes = 0
        self.t: dict[str, float] = {}

    def begin(self, manifest, prefix_cut: int) -> None:
        self.install = self.session.begin_install(manifest.position, list(manifest.prompt_token_ids), self.identity)
        if prefix_cut:
            if self.held_source is None:  # admission already proved we hold it; be explicit anyway
                raise EngineError("install", "delta without a held prefix source")
            t0 = time.perf_counter()
            self.copied_bytes = copy_prefix(self.held_source, self.install, self.geometry, prefix_cut)
            self.t["prefix_copy_s"] = time.perf_counter() - t0

    def write_segment(self, descriptor, payload: memoryview) -> None:
        scatter_tile(self.install, self.geometry, descriptor, payload)

    def prepare(self) -> None:
        self.t["prepare0"] = time.perf_counter()
        gaps = self.install.missing()
        if gaps:
            layer, role, left = gaps[0]
            raise EngineError("install", f"{len(gaps)} planes incomplete (layer {layer} {role}: {left} rows)")
        self.t["prepare1"] = time.perf_counter()

    def commit(self) -> None:
        self.t["commit0"] = time.perf_counter()
        # No logits row travels: the receiver decodes the boundary token itself.
        self.install.commit(require_logits=False)
        self.t["commit1"] = time.perf_counter()

    def abort(self) -> None:
        if self.install is not None:
            self.install.abort()


class _TimedLedger:
    """The replay ledger as the handoff ReplayGate, with reservation latency recorded."""

    def __init__(self, ledger: ReplayLedger, metrics: NodeMetrics) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.t: dict[str, float] = {}

    def admit(self, key_id: str, epoch: int, generation: int) -> None:
        self.ledger.admit(key_id, epoch, generation)

    def reserve(self, key_id: str, epoch: int, generation: int) -> None:
        t0 = time.perf_counter()
        ok = False
        try:
            self.ledger.reserve(key_id, epoch, generation)
            ok = True
        finally:
            t1 = time.perf_counter()
            self.t["reserve0"], self.t["reserve1"] = t0, t1
            self.metrics.reservation(ok, t1 - t0)


@dataclass
class Pending:
    """One outstanding request: what the next admitted begin must be."""

    request_id: str
    prompt: tuple[int, ...]
    t0_ms: int
    deadline: float  # monotonic: an admissible begin must arrive before this
    held_tokens: Optional[tuple[int, ...]] = None
    held_source: object = None
    event: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    admitted: bool = False
    done: bool = False
    outcome: Optional[dict] = None
    error: Optional[BaseException] = None
    refusals: list = field(default_factory=list)

    def finish(self, outcome: Optional[dict] = None, error: Optional[BaseException] = None) -> None:
        if not self.done:
            self.done = True
            self.outcome, self.error = outcome, error
            self.event.set()


def accept_wait_s(cfg: ReceiverConfig, prompt_tokens: int) -> float:
    """Errata H3: max(wait_for_producer_ms, 200 ms per prompt token), capped at 900 s."""
    return min(900.0, max(cfg.wait_for_producer_ms / 1000.0, 0.2 * prompt_tokens))


class ReceiverNode:
    """A decode node: data listener, ledger, engine session, ladder, local API, metrics."""

    def __init__(
        self,
        config: ReceiverConfig,
        engine,
        *,
        receipts_dir: str,
        store=None,
        metrics_port: Optional[int] = 0,
        advertised_port: Optional[int] = None,
        resident_bytes: int = 1 << 30,
        committed_wait_s: float = 2.0,
        check_volume: bool = True,
        socket_path: Optional[str] = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.store = store
        self.receipts = ReceiptWriter(receipts_dir)
        self.metrics = NodeMetrics("receiver")
        self._metrics_port = metrics_port
        self._advertised_port = advertised_port
        self.committed_wait_s = committed_wait_s
        self._check_volume = check_volume
        self.socket_path = socket_path
        self.layout = span_layout(engine.layout)
        self.geometry = TileGeometry.of(engine.layout)
        self.exact, self.target = wire_identity(engine)
        self.session = engine.new_session()
        self.live_prefilled = 0  # tokens of the live session computed by prefill/install
        self.resident = ResidentRadix(resident_bytes)
        self.ladder = Ladder(engine, self.resident, store)
        self.ledger: Optional[ReplayLedger] = None
        self.key: Optional[bytes] = None
        self._pending: Optional[Pending] = None
        self._state_lock = threading.Lock()
        self._request_lock = threading.Lock()
        self._counter = itertools.count(1)
        self._listener: Optional[socket.socket] = None
        self._unix: Optional[socket.socket] = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.data_port: Optional[int] = None
        self.probe: ProbeResult | None = None
        # The handoff core hashes on the executor its driver passes (kvpack.handoff.hashing):
        # this node's pool overlaps a payload's two digests with the reads (threads start on
        # first use, and go with stop()).
        self._hash_pool = ThreadPoolExecutor(max_workers=hash_workers(), thread_name_prefix="kvpack-receiver-hash")

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> "ReceiverNode":
        cfg = self.config
        if self.exact.to_json() != cfg.identity or self.target != cfg.target_cache_identity_sha256:
            raise SecurityError(
                "config",
                f"{cfg.path}: the loaded engine's identity differs from the configured identity (enroll the receiver with this engine's --identity file)",
            )
        if self._check_volume:
            os.makedirs(os.path.dirname(cfg.replay_ledger), mode=0o700, exist_ok=True)
            self.probe = check_ledger_volume(cfg.replay_ledger)  # refuses a slow volume (C.9)
        self.ledger = ReplayLedger.open(cfg.replay_ledger, minimum_epoch=cfg.minimum_hmac_epoch)
        self.key = cfg.load_hmac_key()
        self._data_ep = cfg.data_endpoint()
        self._data_ctx = server_context(self._data_ep)
        if cfg.producer_control is not None:
            self._ctl_ep = cfg.control_endpoint()
            self._ctl_ctx = client_context(self._ctl_ep)
        self._listener = listen(cfg.listen_host, cfg.listen_port)
        self.data_port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop, "kvpack-receiver-accept")
        attach_receiver(self)  # status page sections and readiness checks
        if self._metrics_port is not None:
            self.metrics.serve(self._metrics_port)
        if self.socket_path:
            self._start_local_api(self.socket_path)
        return self

    def stop(self) -> None:
        self._stopping.set()
        for sock in (self._listener, self._unix):
            close_listener(sock)
        with self._state_lock:
            if self._pending is not None:
                self._pending.finish(error=ProtocolError("aborted", "receiver shutting down", remote=False))
        for t in self._threads:
            t.join(timeout=5)
        self._hash_pool.shutdown(wait=False, cancel_futures=True)
        self.metrics.close()
        if self.ledger is not None:
            self.ledger.close()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _spawn(self, fn, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        return t

    @property
    def advertised_port(self) -> int:
        port = self._advertised_port or self.data_port
        if port is None:
            raise RuntimeError("the receiver has no data port before start()")
        return port

    # -- data plane -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        listener = self._listener
        assert listener is not None  # start() binds it before spawning this loop
        while not self._stopping.is_set():
            try:
                raw, _addr = listener.accept()
            except OSError:
                return
            self._spawn(self._serve_connection, "kvpack-receiver-conn", raw)

    def _refuse(self, reason: str, detail: str, **extra) -> None:
        self.metrics.refusal(reason)
        self.metrics.transfer(reason)
        self.receipts.write({"role": "receiver", "verdict": "refused", "reason": reason, "detail": detail[:2000], **extra})

    def _serve_connection(self, raw: socket.socket) -> None:
        peer = "?"
        try:
            peer = "%s:%s" % raw.getpeername()[:2]
        except OSError:
            pass
        t_conn = time.time_ns()
        try:
            chan = wrap_accepted(raw, self._data_ep, context=self._data_ctx)
        except (KvpackError, OSError, ssl.SSLError) as exc:
            reason, detail = verdict_of(exc)
            self._refuse(reason, detail, phase="tls", peer=peer, connected_unix_ns=t_conn)
            return
        try:
            with self._state_lock:
                pending = self._pending
            if pending is None or pending.done:
                self._refuse("unsolicited", "no outstanding request on this receiver", phase="begin", peer=peer, peer_leaf_sha256=chan.peer.leaf_sha256)
                return
            with pending.lock:
                if pending.done:
                    self._refuse("unsolicited", "the request this connection could serve is finished", phase="begin", peer=peer)
                    return
                self._receive(chan, pending, peer, t_conn)
        finally:
            chan.close()

    def _receive(self, chan, pending: Pending, peer: str, t_conn: int) -> None:
        cfg = self.config
        assert self.ledger is not None and self.key is not None  # opened by start()
        sink = EngineSink(self.session, self.geometry, self.engine.identity, pending.held_source)
        gate = _TimedLedger(self.ledger, self.metrics)
        expectations = AdmissionExpectations(
            identity=self.exact,
            target_cache_identity_sha256=self.target,
            max_context=self.engine.max_context,
            request_prompt=pending.prompt,
            request_id=pending.request_id,
        )
        rx = Receiver(
            HandoffReceiverConfig(self.key, cfg.hmac_key_id, cfg.minimum_hmac_epoch, layout=self.layout, expectations=expectations),
            sink,
            gate,
            now_unix_ms=pending.t0_ms,
            held_token_ids=pending.held_tokens,
            hash_executor=self._hash_pool,
        )
        stamps: dict[str, int | str] = {"connected_unix_ns": t_conn, "tls_verified_unix_ns": time.time_ns()}
        perf: dict[str, float] = {"begin_wait0": time.perf_counter()}
        admitted = False
        committed: Optional[Committed] = None
        try:
            chan.settimeout(max(0.05, pending.deadline - time.monotonic()))
            recv_into = chan.recv_into
            while True:
                # Fill the whole wanted() view (the rest of a preamble or header, or the next
                # hash range of a payload), one recv_into per TLS record and nothing else per
                # record, then advance once. Before admission every recv_into runs under what
                # is left of the accept deadline; after it, under timeout_ms (errata H3).
                buf = rx.wanted()
                want = len(buf)
                if not want:
                    break
                if not admitted:
                    # the accept deadline bounds the whole wait, not each read: a peer that
                    # trickles bytes must not hold the connection past it
                    left = pending.deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("accept deadline passed before admission")
                    chan.settimeout(left)
                got = recv_into(buf)
                while got and got < want:
                    if not admitted:
                        left = pending.deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError("accept deadline passed before admission")
                        chan.settimeout(left)
                    n = recv_into(buf[got:])
                    if n == 0:
                        break
                    got += n
                t_recv = time.perf_counter()
                effects = rx.advance(got) if got else []
                if got < want:
                    rx.eof()  # raises: the stream ended before the seal
                for e in effects:
                    if isinstance(e, Admitted):
                        admitted = pending.admitted = True
                        perf["admitted"] = t_recv
                        stamps["admitted_unix_ns"] = time.time_ns()
                        chan.settimeout(cfg.timeout_ms / 1000.0)  # errata H3: long gaps are normal
                    elif isinstance(e, SegmentStored) and "first_segment" not in perf:
                        perf["first_segment"] = t_recv
                        stamps["first_segment_unix_ns"] = time.time_ns()
                    elif isinstance(e, Committed):
                        committed = e
                        perf["seal"] = t_recv
                        stamps["committed_unix_ns"] = time.time_ns()
                if committed is not None:
                    break
        except BaseException as exc:  # noqa: BLE001 - every failure is a refusal with a receipt
            # The state machine raised its own typed refusal (and aborted the sink); anything
            # else (TLS record failure, reset, timeout) is a local abort of the transfer.
            err = exc
            if isinstance(exc, TimeoutError):  # socket.timeout is TimeoutError
                err = ProtocolError("aborted", "read timed out", remote=False)
            if rx.error is None:
                rx.abort(f"{type(exc).__name__}: {exc}")
            reason, detail = verdict_of(err)
            info = self._transfer_info(rx, sink, gate, perf, stamps, pending)
            self._refuse(reason, detail, phase="admitted" if admitted else "begin", peer=peer, peer_leaf_sha256=chan.peer.leaf_sha256, **info)
            pending.refusals.append((reason, detail))
            if admitted:
                pending.finish(error=err)  # after admission a failure fails the request
            return  # before admission: drop this connection, keep waiting (errata M8)
        # Committed (steps 7-9 done inside the state machine): the ACK, then close (H4).
        assert committed is not None  # the loop above ends on Committed or raises
        try:
            chan.sendall(committed.ack)
            stamps["ack_unix_ns"] = time.time_ns()
        except (OSError, KvpackError) as exc:  # C.8 step 6: only logged; a retry is a replay
            stamps["ack_error"] = str(exc)[:200]
        info = self._transfer_info(rx, sink, gate, perf, stamps, pending)
        self.metrics.transfer("committed", committed.total_bytes)
        self.metrics.phases({k: v for k, v in info["durations_s"].items()})
        info.update(role="receiver", verdict="committed", peer=peer, peer_leaf_sha256=chan.peer.leaf_sha256)
        info["receipt_path"] = self.receipts.write(info)
        pending.finish(outcome=info)

    def _transfer_info(self, rx: Receiver, sink: EngineSink, gate: _TimedLedger, perf: dict, stamps: dict, pending: Pending) -> dict:
        m = rx.manifest
        core = rx.seal_core()
        d: dict[str, float] = {}
        if "admitted" in perf:
            d["wait_begin"] = perf["admitted"] - perf["begin_wait0"]
        if "seal" in perf and "admitted" in perf:
            d["wire"] = perf["seal"] - perf["admitted"]
        if "prepare0" in sink.t and "seal" in perf:
            d["verify"] = sink.t["prepare0"] - perf["seal"]
        if "prepare1" in sink.t:
            d["prepare"] = sink.t["prepare1"] - sink.t["prepare0"]
        if "reserve1" in gate.t:
            d["reserve"] = gate.t["reserve1"] - gate.t["reserve0"]
        if "commit1" in sink.t:
            d["commit"] = sink.t["commit1"] - sink.t["commit0"]
        if "prefix_copy_s" in sink.t:
            d["prefix_copy"] = sink.t["prefix_copy_s"]
        return {
            "request_id": pending.request_id,
            "transfer_id": None if m is None else m.transfer_id,
            "generation": None if m is None else m.generation,
            "position": None if m is None else m.position,
            "prefix_cut": rx.prefix_cut,
            "held_tokens": 0 if pending.held_tokens is None else len(pending.held_tokens),
            "held_prefix_sha256": None if pending.held_tokens is None else held_digest(pending.held_tokens),
            "segments": rx.segments_received,
            "payload_bytes": rx.bytes_received,
            "prefix_bytes_copied": sink.copied_bytes,
            "digests": None if core is None else {k: getattr(core, k) for k in ("begin_sha256", "descriptor_sha256", "payload_sha256")},
            "timestamps": stamps,
            "durations_s": {k: round(v, 6) for k, v in d.items()},
        }

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
    ) -> Pending:
        """Register the one outstanding request the next admitted begin must match."""
        prompt = tuple(int(t) for t in prompt)
        wait = accept_wait_s(self.config, len(prompt)) if wait_s is None else wait_s
        p = Pending(
            request_id, prompt, now_ms() if t0_ms is None else t0_ms, time.monotonic() + wait, None if held is None else tuple(held.tokens), held_source
        )
        with self._state_lock:
            if self._pending is not None and not self._pending.done:
                raise ProtocolError("state", "a request is already outstanding", remote=False)
            self._pending = p
        return p

    def wait(self, pending: Pending, control=None) -> dict:
        """Block until ``pending`` commits or fails; watch the control channel meanwhile (a
        producer's ``failed`` answer ends the wait early). Returns the committed outcome."""
        early_response = None
        try:
            while not pending.event.wait(0.05):
                if control is not None and early_response is None and readable(control.sock):
                    resp = ControlResponse.from_json(read_control(control, time.monotonic() + 5.0))
                    resp.validate_for(pending.request_id)
                    if resp.status == "failed":
                        last = pending.refusals[-1] if pending.refusals else None
                        why = f"producer failed: {resp.error}" + (f" (receiver refused: {last[0]}: {last[1][:200]})" if last else "")
                        raise ProtocolError(last[0] if last and last[0] in ProtocolError.CATEGORIES else "aborted", why)
                    early_response = resp  # "committed" racing our own event: keep it
                if not pending.admitted and time.monotonic() > pending.deadline:
                    last = pending.refusals[-1] if pending.refusals else None
                    why = "no admissible transfer before the accept deadline"
                    if last:
                        why += f" (last refusal {last[0]}: {last[1][:200]})"
                    raise ProtocolError(last[0] if last and last[0] in ProtocolError.CATEGORIES else "aborted", why)
        except BaseException as exc:
            pending.finish(error=exc)
            with pending.lock:  # a connection still streaming finishes (and aborts) first
                pass
            raise
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None  # finish() sets an outcome or an error
        out = dict(pending.outcome)
        if early_response is not None:
            out["_early_response"] = early_response
        return out

    def receive(self, request_id: str, prompt: Sequence[int], **kw) -> dict:
        """Wait for one transfer without the control plane (C.15 "unsolicited producer" mode,
        bound to ``request_id`` and ``prompt`` all the same)."""
        return self.wait(self.expect(request_id, prompt, **kw))

    def _new_request_id(self, t0_ms: int) -> str:
        # upstream's form "muser-<unix_ms>-<counter>": inside the muser- namespace the
        # transfer id must start with "<request_id>-" (errata M8), so the binding is strict
        return f"muser-{t0_ms}-{next(self._counter)}"

    def _remote(self, tokens: list[int], plan: Plan, t0_ms: int) -> dict:
        cfg = self.config
        if cfg.producer_control is None:
            raise SecurityError("config", f"{cfg.path}: no producer_control: this receiver cannot request prefill")
        cut = plan.prefix_cut
        assert not cut or plan.held is not None  # an armed delta always names its held prefix
        held_source = self.ladder.materialize(plan.held) if cut and plan.held is not None else None
        rid = self._new_request_id(t0_ms)
        pending = self.expect(rid, tokens, t0_ms=t0_ms, held=plan.held if cut else None, held_source=held_source)
        frames = []
        t_c0 = time.perf_counter()
        try:
            ctl = connect(self._ctl_ep, cfg.producer_control.host, cfg.producer_control.port, context=self._ctl_ctx)
        except BaseException as exc:
            pending.finish(error=exc)
            raise
        try:
            req = ControlRequestV1(rid, t0_ms + cfg.timeout_ms, tuple(tokens), cfg.advertised_receiver_host or "127.0.0.1", self.advertised_port)
            body = req.to_json()
            if cut:
                body[EXT_PREFIX_CUT] = cut
            frame = encode_control(body)
            ctl.sendall(frame)
            frames.append({"dir": "sent", "type": "request", "bytes": len(frame)})
            raw = read_control(ctl, time.monotonic() + 30.0)
            resp = ControlResponse.from_json(raw)
            if resp.status == "failed" and resp.request_id != rid:
                # a producer that could not parse the request cannot echo its id; on this
                # connection (one request) the answer is still the refusal of our request
                refused = ProtocolError("aborted", f"producer answered failed: {resp.error}")
                refused.request_refused = True  # type: ignore[attr-defined]
                raise refused
            resp.validate_for(rid)
            frames.append({"dir": "received", "type": resp.status, "bytes": len(encode_control(raw))})
            if resp.status != "accepted":
                refused = ProtocolError("aborted", f"producer answered {resp.status}: {resp.error}")
                refused.request_refused = True  # type: ignore[attr-defined]  # nothing was sent or installed
                raise refused
            control_s = time.perf_counter() - t_c0
            out = self.wait(pending, control=ctl)
            early = out.pop("_early_response", None)
            final = early
            if final is None:  # telemetry only: a short wait, then close (errata H2)
                try:
                    raw = read_control(ctl, time.monotonic() + self.committed_wait_s)
                    final = ControlResponse.from_json(raw)
                    final.validate_for(rid)
                    frames.append({"dir": "received", "type": final.status, "bytes": len(encode_control(raw))})
                except (KvpackError, TimeoutError, OSError):
                    final = None
            else:
                frames.append({"dir": "received", "type": final.status, "bytes": len(encode_control(final.to_json()))})
        except BaseException as exc:
            pending.finish(error=exc)
            raise
        finally:
            ctl.close()
        out["control_s"] = control_s
        out["control_frames"] = frames
        out["producer_receipt"] = None if final is None or final.receipt is None else final.receipt.to_json()
        return out

    def generate(self, tokens: Sequence[int], max_new_tokens: int = 32, *, save: bool = False, stop_token_ids: Sequence[int] = ()) -> dict:
        """Serve one prompt: ladder, handoff (or local reuse), boundary token, greedy decode."""
        tokens = [int(t) for t in tokens]
        if len(tokens) < 2:
            raise ProtocolError("manifest", "a prompt needs at least 2 tokens (one is the held boundary)", remote=False)
        with self._request_lock:
            t_start = time.perf_counter()
            t0_ms = now_ms()
            before = self.session.position
            plan = self.ladder.plan(tokens, self.session, self.live_prefilled)
            result: dict = {"prompt_tokens": len(tokens), "plan": plan.to_json(), "transfer": None}
            try:
                plan = self._settle_durable(plan, tokens, result)
                if plan.action is ReuseAction.SERVE_LOCAL:
                    self._serve_local(plan, tokens)
                else:
                    try:
                        result["transfer"] = self._remote(tokens, plan, t0_ms)
                    except ProtocolError as exc:
                        # A producer that refuses the delta request before accepting it (an
                        # upstream prefilld denies the extension key) still serves the prompt
                        # with a full transfer; anything after "accepted" is a real failure.
                        if not (plan.prefix_cut and getattr(exc, "request_refused", False)):
                            raise
                        result["delta_fallback"] = str(exc)[:500]
                        plan = Plan(ReuseAction.FULL_TRANSFER, "none", 0, None, plan.lookup_s)
                        result["plan"] = plan.to_json()
                        result["transfer"] = self._remote(tokens, plan, now_ms())
            except BaseException:
                self.metrics.phases({"request_failed": time.perf_counter() - t_start})
                raise
            self.metrics.reused.labels("receiver", plan.tier if plan.action is not ReuseAction.FULL_TRANSFER else "none").inc(
                plan.matched if plan.action is not ReuseAction.FULL_TRANSFER else 0
            )
            t_b = time.perf_counter()
            local_prefill = 0
            if self.session.position < len(tokens):
                # the held-back boundary token (and nothing else) is computed here
                local_prefill = len(tokens) - self.session.position
                self.session.prefill(tokens[self.session.position :])
            boundary_s = time.perf_counter() - t_b
            ttft_s = time.perf_counter() - t_start
            self.metrics.prefilled.labels("receiver").inc(local_prefill)
            # The saved cut ends with the boundary row computed by a one-token forward; at an
            # aligned length it would be found as an aligned prefix and armed as a delta base,
            # where the producer's rows come from a chunked prefill. Never publish that one.
            saveable = save and self.store is not None and not is_token_aligned(len(tokens))
            logits_at_prompt = bytes(self.session.export_logits()) if saveable else None
            t_d = time.perf_counter()
            out_tokens, rows = greedy(self.session, max_new_tokens, stop_token_ids)
            decode_s = time.perf_counter() - t_d
            self.live_prefilled = len(tokens) - 1
            self.metrics.phases({"ttft": ttft_s, "boundary": boundary_s, "decode": decode_s})
            # Resident tier: the prefill-computed rows [0, P-1) of this prompt, off the TTFT path.
            self.resident.insert(self.ladder.identity, RowsSource.capture(self.session, len(tokens) - 1))
            saved = None
            if logits_at_prompt is not None:
                rep = self.store.save(self.session, cut=len(tokens), logits=logits_at_prompt)
                saved = {"manifest_id": rep.manifest_id, "cut": rep.cut, "kind": rep.kind, "seconds": round(rep.seconds, 4)}
            result.update(
                tokens=out_tokens,
                logits_sha256=__import__("hashlib").sha256(logits_bytes(rows)).hexdigest(),
                tokens_sha256=__import__("hashlib").sha256(json.dumps(out_tokens).encode()).hexdigest(),
                ttft_s=round(ttft_s, 6),
                boundary_s=round(boundary_s, 6),
                decode_s=round(decode_s, 6),
                local_prefill_tokens=local_prefill,
                session_before=before,
                saved=saved,
            )
            self._last_logit_rows = rows
            return result

    def _settle_durable(self, plan: Plan, tokens: list[int], result: dict) -> Plan:
        """Restore a durable plan's cut up front: a cut failing verification is quarantined
        and is a miss, so the ladder plans again (the store heals; the request still serves)."""
        for _attempt in range(4):
            if plan.held is None or plan.held.tier != "durable" or plan.action is ReuseAction.FULL_TRANSFER:
                return plan
            try:
                if plan.action is ReuseAction.SERVE_LOCAL and plan.held.matched == len(tokens):
                    assert isinstance(plan.held.source, tuple)  # a durable hit's source is (hit, tokens)
                    hit, hit_tokens = plan.held.source
                    self.ladder.restore_durable(hit, self.session, list(hit_tokens))  # verified, with its logits
                    plan.held.source = ("restored", self.session)
                else:
                    plan.held.source = ("restored", self.ladder.materialize(plan.held))
                return plan
            except DurableMiss as miss:
                result.setdefault("quarantined", []).append(miss.receipt)
                plan = self.ladder.plan(tokens, self.session, self.live_prefilled)
                result["plan"] = plan.to_json()
        return plan

    def _serve_local(self, plan: Plan, tokens: list[int]) -> None:
        held = plan.held
        assert held is not None  # SERVE_LOCAL is only planned from a held prefix
        if held.tier == "durable" and held.matched == len(tokens):
            return  # restored into the live session by _settle_durable
        source = self.ladder.materialize(held)
        cut = len(tokens) - 1
        install = self.session.begin_install(cut, tokens[:cut], self.engine.identity)
        try:
            copy_prefix(source, install, self.geometry, cut)
            install.commit(require_logits=False)
        except BaseException:
            install.abort()
            raise

    # -- local API (a Unix socket: filesystem permissions, never the network) --------------

    def _start_local_api(self, path: str) -> None:
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(8)
        self._unix = sock
        self._spawn(self._local_loop, "kvpack-receiver-api")

    def _local_loop(self) -> None:
        unix = self._unix
        assert unix is not None  # bound before this loop is spawned
        while not self._stopping.is_set():
            try:
                conn, _ = unix.accept()
            except OSError:
                return
            self._spawn(self._local_request, "kvpack-receiver-api-conn", conn)

    def _local_request(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(1 << 20)
                if not chunk:
                    return
                data += chunk
            try:
                req = json.loads(data)
                if not isinstance(req, dict):
                    raise UsageError("usage", "a local API request is one JSON object")
                if "tokens" in req:
                    tokens = req["tokens"]
                    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 2**31 for t in tokens):
                        raise UsageError("usage", "tokens must be a JSON list of token ids (integers in 0..2^31-1)")
                else:
                    from ..generate import chat_tokens

                    tokens = chat_tokens(self.engine, str(req["prompt"]), chat=bool(req.get("chat", True)))
                eos = getattr(getattr(self.engine, "tokenizer", None), "eos_token_id", None)
                res = self.generate(
                    tokens,
                    int(req.get("max_new_tokens", 32)),
                    save=bool(req.get("save", False)),
                    stop_token_ids=[eos] if eos is not None and req.get("stop_at_eos", True) else (),
                )
                if getattr(self.engine, "tokenizer", None) is not None:
                    res["text"] = self.engine.decode(res["tokens"])
                reply = {"ok": True, "result": res}
            except BaseException as exc:  # noqa: BLE001 - reported to the client
                reason, detail = verdict_of(exc)
                reply = {"ok": False, "error": {"reason": reason, "detail": detail}}
            log_request(reply)
            conn.sendall(json.dumps(reply, default=str).encode() + b"\n")


def request_local(socket_path: str, payload: dict, timeout: float = 900.0) -> dict:
    """Client side of the receiver's local API (``kvpack request``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    return json.loads(data)
