"""The prefill node (``kvpack producer``): control plane in, Handoff V2 out.

Figure 30.1 of seed 003, steps 1-6 and the answer, from this side:

1. a control-plane server on its own ALPN (``muser-prefill-control-v1``, mutual TLS, the
   receiver's leaf pinned) reads one MUPCTL1 request V1 (C.14, errata M6 bounds) and answers
   ``accepted``; it serves one control connection at a time (errata H2), and a connection
   that becomes readable mid-job (the receiver went away or spoke) cancels the job;
2. the request's tokens minus the held-back boundary token are prefilled exactly, in the
   engine's absolute 256-token chunks. A prefix this node computed before (in memory, or
   in its pack store) is installed instead of recomputed, so ``prefill_tokens`` in the
   receipt counts only what was really computed;
3. it connects back to ``receiver_host:receiver_port`` on the data ALPN with its own leaf,
   pinning the receiver's leaf and checking its SAN (errata H1);
4. the begin (deferred mode, as upstream's resident producer; ``prefix_cut`` when the
   receiver armed a delta that is valid for this prompt) leaves at once;
5. each tile leaves as soon as the prefill chunk that completes it ran: the chunk callback
   exports the tile and a sender thread hashes and writes it while the next chunk computes;
6. seal, then exactly one ACK is awaited; then ``committed`` with the C.14 receipt.

Cache bytes never ride the control channel: control messages are the request, ``accepted``
and ``committed``/``failed`` (each recorded with its size in the producer receipt).

The generation ledger (``{"next_generation": N}``, C.9) is advanced durably *before* a
generation is used, so a crash can skip a generation but never reuse one.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from ..durable import atomic_write, ensure_dir
from ..errors import KvpackError, ProtocolError, SecurityError
from ..handoff import canonical_json as cj
from ..handoff.control import ControlReceipt, ControlRequestV1, ControlResponse
from ..handoff.manifest import PROTOCOL, BeginManifestV2, ComponentV2, HmacRef
from ..handoff.schedule import schedule_span
from ..handoff.sender import Sender
from ..security.config import ProducerConfig
from ..security.secret_files import load_hmac_key
from ..security.tls import client_context, connect, listen, server_context, wrap_accepted
from ..vocab import FileLock, LockHeld, align_tokens_down, is_token_aligned
from .common import ReceiptWriter, close_listener, chunk_tokens, hash_workers, now_ms, read_control, readable, verdict_of
from .ladder import ResidentRadix, RowsSource
from .metrics import NodeMetrics
from .status import attach_producer
from .receiver import EXT_PREFIX_CUT
from .wire import TileGeometry, copy_prefix, pack_tile, span_layout, wire_identity

EXPIRY_MS = 900_000  # errata H3: prefilld's begin expires 900 s after creation
MAX_ERROR = 1024


class GenerationLedger:
    """The producer's durable generation counter (C.9 ``{"next_generation": N}``).

    :meth:`take` persists ``N + 1`` (temp file, fsync, rename, directory fsync) and only then
    returns ``N``. An exclusive ``flock`` keeps a second producer process off the same file.
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        ensure_dir(os.path.dirname(self.path), mode=0o700)
        self._lock = FileLock(self.path + ".lock")
        try:
            self._lock.acquire()
        except LockHeld:
            raise SecurityError("locked", f"generation ledger {self.path!r} is held by another producer") from None
        if os.path.exists(self.path):
            st = os.lstat(self.path)
            if not os.path.isfile(self.path) or os.path.islink(self.path) or st.st_mode & 0o077:
                raise SecurityError("ledger", f"generation ledger {self.path!r} must be a regular 0600 file")
            with open(self.path, "rb") as fh:
                obj = json.loads(fh.read())
            n = obj.get("next_generation") if isinstance(obj, dict) and set(obj) == {"next_generation"} else None
            if type(n) is not int or n < 1:
                raise SecurityError("ledger", f"generation ledger {self.path!r} is malformed")
            self.next = n
        else:
            self.next = 1
            self._persist(1)
        self._mutex = threading.Lock()

    def _persist(self, n: int) -> None:
        body = json.dumps({"next_generation": n}, sort_keys=True).encode() + b"\n"
        atomic_write(self.path, body, mode=0o600)

    def take(self) -> int:
        with self._mutex:
            gen = self.next
            self._persist(gen + 1)
            self.next = gen + 1
            return gen

    def close(self) -> None:
        self._lock.release()


@dataclass
class _WireProgress:
    """What the send thread reports to the job thread: time in writes, payload bytes, and
    the failure that stopped it (re-raised by the job thread)."""

    ns: int = 0
    bytes: int = 0
    error: BaseException | None = None


class _Cancelled(Exception):
    pass


class ProducerNode:
    """A prefill node: control listener, engine, generation ledger, reuse, metrics."""

    def __init__(
        self,
        config: ProducerConfig,
        engine,
        *,
        receipts_dir: str,
        store=None,
        metrics_port: Optional[int] = 0,
        resident_bytes: int = 1 << 30,
        pacing_bytes_per_s: Optional[float] = None,
        wire_tap=None,
        accept_prefix_cut_extension: bool = True,
    ) -> None:
        self.config = config
        # False behaves like the upstream prefill daemon, whose request V1 denies unknown
        # fields: a delta request (extension key) is answered "failed" before "accepted"
        self.accept_prefix_cut_extension = accept_prefix_cut_extension
        self.engine = engine
        self.store = store
        self.receipts = ReceiptWriter(receipts_dir)
        self.metrics = NodeMetrics("producer")
        self._metrics_port = metrics_port
        self.layout = span_layout(engine.layout)
        self.geometry = TileGeometry.of(engine.layout)
        self.exact, self.target = wire_identity(engine)
        self.resident = ResidentRadix(resident_bytes)
        self.identity_digest = engine.identity.ids().digest()
        self.pacing = pacing_bytes_per_s
        #: diagnostics: called with every buffer written on a data connection, in order
        self.wire_tap = wire_tap
        self.ledger: Optional[GenerationLedger] = None
        self._listener: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self.control_port: Optional[int] = None
        # segment digests of large payloads run here while the job thread feeds the running
        # digest (kvpack.handoff.hashing: the core never starts threads itself)
        self._hash_pool = ThreadPoolExecutor(max_workers=hash_workers(), thread_name_prefix="kvpack-producer-hash")

    def start(self) -> "ProducerNode":
        cfg = self.config
        self.ledger = GenerationLedger(cfg.generation_ledger)
        self._keys = {r.name: load_hmac_key(r.hmac_key_file) for r in cfg.receivers}
        self._by_pin = {pin: r for r in cfg.receivers for pin in r.leaf_sha256}
        self._ctl_ep = cfg.control_endpoint()
        self._ctl_ctx = server_context(self._ctl_ep)
        endpoints = {r.name: cfg.data_endpoint(r.name) for r in cfg.receivers}
        self._data = {name: (ep, client_context(ep)) for name, ep in endpoints.items()}
        self._listener = listen(cfg.control_listen_host, cfg.control_listen_port)
        self.control_port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="kvpack-producer", daemon=True)
        self._thread.start()
        attach_producer(self)  # status page sections and readiness checks
        if self._metrics_port is not None:
            self.metrics.serve(self._metrics_port)
        return self

    def stop(self) -> None:
        self._stopping.set()
        close_listener(self._listener)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._hash_pool.shutdown(wait=False, cancel_futures=True)
        self.metrics.close()
        if self.ledger is not None:
            self.ledger.close()

    # -- control plane --------------------------------------------------------------------

    def _serve(self) -> None:
        # One control connection at a time (errata H2): a second request waits in the backlog.
        listener = self._listener
        assert listener is not None  # start() binds it before starting this thread
        while not self._stopping.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                self._serve_control(raw)
            except Exception as exc:  # noqa: BLE001 - the daemon outlives any one request
                reason, detail = verdict_of(exc)
                self.metrics.refusal(reason)
                self.receipts.write({"role": "producer", "verdict": "failed", "reason": reason, "detail": detail[:2000]})

    def _respond(self, ctl, frames: list, response: ControlResponse) -> None:
        data = response.encode()
        ctl.sendall(data)
        frames.append({"dir": "sent", "type": response.status, "bytes": len(data)})

    def _serve_control(self, raw: socket.socket) -> None:
        peer = "?"
        try:
            peer = "%s:%s" % raw.getpeername()[:2]
        except OSError:
            pass
        try:
            ctl = wrap_accepted(raw, self._ctl_ep, context=self._ctl_ctx)
        except (KvpackError, OSError, ssl.SSLError) as exc:
            reason, detail = verdict_of(exc)
            self.metrics.refusal(reason)
            self.receipts.write({"role": "producer", "verdict": "refused", "phase": "tls", "reason": reason, "detail": detail[:2000], "peer": peer})
            return
        frames: list = []
        receipt: dict = {"role": "producer", "peer": peer, "control_frames": frames}
        rid = "unknown"
        try:
            try:
                raw_msg = read_control(ctl, time.monotonic() + 30.0)
                frames.append({"dir": "received", "type": "request", "bytes": len(cj.canonical_bytes(raw_msg)) + 12})
                hint = 0
                if isinstance(raw_msg, dict) and EXT_PREFIX_CUT in raw_msg and self.accept_prefix_cut_extension:
                    hint = cj.u64(raw_msg.pop(EXT_PREFIX_CUT), EXT_PREFIX_CUT)
                req = ControlRequestV1.from_json(raw_msg)
                rid = req.request_id
                req.validate(now_ms(), self.engine.max_context)
                receiver = self._by_pin.get(ctl.peer.leaf_sha256)
                if receiver is None:  # pinned by the TLS layer, so this is a config bug
                    raise SecurityError("pin", "control peer is not a configured receiver")
            except (KvpackError, TimeoutError) as exc:
                reason, detail = verdict_of(exc)
                self._respond(ctl, frames, ControlResponse(rid, "failed", error=f"{reason}: {detail}"[:MAX_ERROR]))
                receipt.update(verdict="refused", phase="request", reason=reason, detail=detail[:2000], request_id=rid)
                self.metrics.refusal(reason)
                return
            self._respond(ctl, frames, ControlResponse(rid, "accepted"))
            receipt.update(request_id=rid, receiver=receiver.name, prompt_tokens=len(req.prompt_token_ids), hint_prefix_cut=hint)
            try:
                job = self._job(ctl, req, receiver, hint, receipt)
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
            self._respond(ctl, frames, ControlResponse(rid, "committed", receipt=job))
            receipt.update(verdict="committed", receipt=job.to_json())
            self.metrics.transfer("committed", job.payload_bytes)
            # Off the critical path: remember what was computed, for the next request.
            self._remember(receipt)
        finally:
            ctl.close()
            receipt.pop("_session", None)
            receipt.pop("_checkpoints", None)
            receipt["receipt_path"] = self.receipts.write({k: v for k, v in receipt.items() if not k.startswith("_")})

    # -- the job --------------------------------------------------------------------------

    def _reuse(self, session, prompt: list[int]) -> tuple[int, str]:
        """Install the deepest 256-aligned prefix this node already computed, leaving at least
        one token to prefill (the receipt's ``prefill_tokens`` is never zero). Only aligned
        cuts: prefill chunks end at absolute multiples of 256, so a prefix restored there and
        extended by prefill computes exactly what an uninterrupted prefill computes."""
        position = len(prompt) - 1
        limit = align_tokens_down(position - 1)
        if limit <= 0:
            return 0, "none"
        held = self.resident.lookup(self.identity_digest, prompt[: limit + 1])  # 'prompt' of limit rows + 1
        best_res = 0 if held is None else min(held.matched, limit)
        best_res = align_tokens_down(best_res)
        hit = None
        if self.store is not None:
            hit = self.store.find_deepest(prompt[:limit], self.engine.layout, self.engine.identity.ids())
        if hit is not None and is_token_aligned(hit.cut) and hit.cut > best_res:
            # a cut failing verification is quarantined by the store and is a miss here
            if self.store.restore_healing(hit, session, prompt[: hit.cut])[0] is not None:
                return hit.cut, "durable"
        if best_res:
            assert held is not None  # best_res > 0 only from a resident hit
            install = session.begin_install(best_res, prompt[:best_res], self.engine.identity)
            try:
                copy_prefix(held.source, install, self.geometry, best_res)
                install.commit(require_logits=False)
            except BaseException:
                install.abort()
                raise
            return best_res, "resident"
        return 0, "none"

    def _job(self, ctl, req: ControlRequestV1, receiver, hint: int, receipt: dict) -> ControlReceipt:
        prompt = list(req.prompt_token_ids)
        position = len(prompt) - 1  # the receiver holds back the boundary token
        tokens = prompt[:position]
        cut = hint if hint and is_token_aligned(hint) and 0 < hint < position else 0
        assert self.ledger is not None  # opened by start()
        gen = self.ledger.take()  # durable before use: never reused
        transfer_id = f"{req.request_id}-{gen}"
        created = now_ms()
        manifest = BeginManifestV2(
            protocol=PROTOCOL,
            transfer_id=transfer_id,
            generation=gen,
            created_unix_ms=created,
            expires_unix_ms=created + EXPIRY_MS,
            identity=self.exact,
            prompt_token_ids=tuple(tokens),
            multimodal=None,
            hmac=HmacRef(receiver.hmac_key_id, receiver.hmac_epoch),
            components=(ComponentV2("target", "target_kv", True, self.target),),
            segments=(),
            deferred_segments=True,
        )
        sender = Sender(manifest, self._keys[receiver.name], prefix_cut=cut, hash_executor=self._hash_pool)
        schedule = list(schedule_span(self.layout, position, cut))
        receipt.update(transfer_id=transfer_id, generation=gen, position=position, prefix_cut=cut)
        ns: dict[str, int] = {}
        ep, ctx = self._data[receiver.name]
        ns["transfer_start"] = time.time_ns()
        data = connect(ep, req.receiver_host, req.receiver_port, context=ctx)
        out_q: "queue.Queue" = queue.Queue(maxsize=4)  # bounded: prefill never runs far ahead
        wire = _WireProgress()

        def write(buffers) -> None:
            t = time.perf_counter_ns()
            for b in buffers:
                if self.wire_tap is not None:
                    self.wire_tap(bytes(b))
                self._send(data, b)
            wire.ns += time.perf_counter_ns() - t

        def sender_loop() -> None:
            try:
                while True:
                    item = out_q.get()
                    if item is None:
                        return
                    payload, seg = item
                    write(sender.send_segment(payload, seg))
                    wire.bytes += len(payload)
                    if "first_segment_sent" not in ns:
                        ns["first_segment_sent"] = time.time_ns()
            except BaseException as exc:  # noqa: BLE001 - reported by the job thread
                wire.error = exc
                while True:  # unblock the producer side
                    try:
                        if out_q.get_nowait() is None:
                            return
                    except queue.Empty:
                        time.sleep(0.01)

        tx = threading.Thread(target=sender_loop, name="kvpack-producer-send", daemon=True)
        state = {"next": 0}
        session = None
        try:
            write(sender.begin())
            tx.start()
            session = self.engine.new_session()
            ns["prefill_start"] = time.time_ns()
            t_pf = time.perf_counter()
            reused, tier = self._reuse(session, prompt)
            checkpoints: dict[int, bytes] = {}

            def ship_ready(s) -> None:
                if wire.error is not None:
                    raise wire.error
                if readable(ctl.sock):  # errata H2: the receiver spoke or left: cancel
                    raise _Cancelled()
                if is_token_aligned(s.position) and s.position > reused and self.store is not None:
                    checkpoints[s.position] = bytes(s.export_logits())
                while state["next"] < len(schedule):
                    seg = schedule[state["next"]]
                    if seg.logical_start + seg.logical_count > s.position:
                        break
                    out_q.put((pack_tile(s, self.geometry, seg.logical_start, seg.logical_count), seg))
                    state["next"] += 1

            ship_ready(session)  # tiles of an installed prefix beyond the cut leave at once
            session.prefill(tokens[session.position :], chunk_size=chunk_tokens(self.engine), on_chunk=ship_ready)
            ns["prefill_end"] = time.time_ns()
            prefill_s = time.perf_counter() - t_pf
            ship_ready(session)
            ns["state_saved"] = time.time_ns()
            out_q.put(None)
            tx.join()
            if wire.error is not None:
                raise wire.error
            write(sender.seal())
            data.settimeout(60.0)
            ack = None
            while ack is None:
                chunk = data.recv(4096)
                if not chunk:
                    raise ProtocolError("aborted", "receiver closed the data connection without an ack")
                ack = sender.receive_data(chunk)
            ns["transfer_acked"] = time.time_ns()
        except BaseException:
            if tx.is_alive():
                out_q.put(None)
                tx.join(timeout=5)
            try:
                for b in sender.abort():
                    data.sendall(b)
            except (KvpackError, OSError):
                pass
            raise
        finally:
            data.close()
        prefilled = position - reused
        self.metrics.prefilled.labels("producer").inc(prefilled)
        self.metrics.reused.labels("producer", tier).inc(reused)
        self.metrics.phases({"prefill": prefill_s, "wire": wire.ns / 1e9})
        receipt.update(
            reused_tokens=reused,
            reuse_tier=tier,
            prefilled_tokens=prefilled,
            segments=sender.segments_sent,
            payload_bytes=sender.bytes_sent,
            begin_sha256=manifest.begin_sha256(),
            seal=None if sender.seal_manifest is None else sender.seal_manifest.to_json(),
        )
        receipt["_session"], receipt["_checkpoints"], receipt["_tokens"] = session, checkpoints, tokens
        return ControlReceipt(
            prefill_start_unix_ns=ns["prefill_start"],
            prefill_end_unix_ns=ns["prefill_end"],
            state_saved_unix_ns=ns["state_saved"],
            transfer_start_unix_ns=ns["transfer_start"],
            first_segment_sent_unix_ns=ns["first_segment_sent"],
            transfer_acked_unix_ns=ns["transfer_acked"],
            prefill_tokens=prefilled,
            payload_bytes=sender.bytes_sent,
            payload_wire_ns=max(1, wire.ns),
        )

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

    def _remember(self, receipt: dict) -> None:
        session = receipt.pop("_session", None)
        checkpoints = receipt.pop("_checkpoints", {})
        tokens = receipt.pop("_tokens", None)
        if session is None or not tokens:
            return
        t0 = time.perf_counter()
        self.resident.insert(self.identity_digest, RowsSource.capture(session, len(tokens)))
        saved = []
        if self.store is not None:
            # aligned checkpoints only (see _reuse)
            for c in sorted(checkpoints):
                self.store.save(session, cut=c, logits=checkpoints[c])
                saved.append(c)
        receipt["remembered"] = {"resident_tokens": len(tokens), "saved_cuts": saved, "seconds": round(time.perf_counter() - t0, 4)}


def digest_tokens(tokens) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()
