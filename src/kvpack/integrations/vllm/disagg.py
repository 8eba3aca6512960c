"""Disaggregated prefill between two vLLM instances: a sealed Handoff V2 transfer over mutual
TLS with the replay ledger, driven by vLLM's P/D flow.

The flow (docs/vllm.md has the proxy side):

1. A proxy sends the prompt to the **producer** instance (``kv_role: kv_producer``) with
   ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode": true}``. When the request
   finishes, the producer's scheduler keeps its blocks (``request_finished`` returns True)
   and answers ``kv_transfer_params: {"do_remote_prefill": true, "kvpack": {"request_id":
   ...}}``; its worker puts the blocks in an *outbox* until a consumer fetched them (or
   ``transfer_wait_s`` passed).
2. The proxy sends the same prompt with those params to the **consumer** instance
   (``kv_role: kv_consumer``). Its scheduler claims the prompt minus its last token as an
   asynchronous external load; its worker asks the enrolled producer over the control plane
   (MUPCTL1 request V1 carrying the producer's request id, the prompt and the consumer's data
   address, ALPN ``muser-prefill-control-v1``) and waits.
3. The producer's :class:`kvpack.node.producer.ProducerNode` (control server, generation
   ledger) runs its usual job on an engine whose "prefill" claims the held blocks of a
   finished vLLM prefill of that prompt and copies their rows out (the blocks are then
   freed); it connects back on the data plane (ALPN ``muser-kvpack-v2``, leaf pins, SAN) and
   streams begin, one 256-row tile per segment (every layer's K then V rows), and the seal.
4. The consumer's :class:`kvpack.node.receiver.ReceiverNode` checks everything of Handoff V2
   (identity, prompt, transfer id, replay ledger admission, per-segment digests, seal HMAC,
   completeness), reserves the generation durably, and only then commits: the staged rows
   are scattered into the request's blocks, the ACK is written, and vLLM is told the load
   finished. vLLM computes the last prompt token and decodes.

Any refusal (tampered bytes, wrong identity, replay, timeout) leaves the blocks unwritten
and reports the load as failed: with ``kv_load_failure_policy: "recompute"`` vLLM computes
the whole prompt itself. A held prefill goes to one consumer at most; unclaimed, its blocks
are freed at ``transfer_wait_s``.

Both instances must be enrolled with ``kvpack enroll`` using the identity file that
``python -m kvpack.integrations.vllm identity`` writes from the same engine arguments.
Receives are served one at a time per consumer (one receive thread).

Both node classes are used as they are (no subclass), with vLLM's blocks behind the engine
contract; this module never writes a block outside a request's block table, and never
writes a block before the node committed the transfer.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ...engine.contract import EngineIdentity, InstallContext
from ...errors import EngineError, ProtocolError
from ...handoff.control import ControlRequestV1
from ...node.common import now_ms
from ...node.producer import ProducerNode
from ...node.receiver import ReceiverNode
from ...security.config import load_producer_config, load_receiver_config
from .meta import KvpackMetadata, RecvSpec, SendSpec
from .paged import PagedKV
from .prefix import refusal_reason
from .settings import Settings
from .stats import KvpackStats

log = logging.getLogger("kvpack.vllm")

PARAMS_KEY = "kvpack"


# ==================================================================================================
# scheduler half


class SchedulerHandoff:
    """Which requests hand their prefix off (producer) or receive it (consumer)."""

    def __init__(self, settings: Settings, identity: EngineIdentity, block_size: int, stats: KvpackStats) -> None:
        self.settings = settings
        self.producer = settings.role == "kv_producer"
        self.block_size = block_size
        self.stats = stats
        self._to_send: list[SendSpec] = []
        self._sending: set[str] = set()
        self._to_recv: list[RecvSpec] = []
        self._recving: set[str] = set()
        self._local: dict[str, int] = {}

    # -- consumer -------------------------------------------------------------------------
    @staticmethod
    def _remote(request: Any) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        info = params.get(PARAMS_KEY)
        return info if isinstance(info, dict) and isinstance(info.get("request_id"), str) else None

    def matched_tokens(self, request: Any, local: int) -> tuple[int, bool] | None:
        """Consumer: the prompt minus its last token arrives asynchronously. None: not ours."""
        if self.producer or self._remote(request) is None or not request.prompt_token_ids:
            return None
        position = len(request.prompt_token_ids) - 1
        self._local[request.request_id] = local
        if position <= local:
            return 0, False
        return position - local, True

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> bool:
        info = None if self.producer else self._remote(request)
        if info is None:
            return False
        request.kv_transfer_params["do_remote_prefill"] = False  # one transfer per request
        if num_external > 0:
            prompt = tuple(int(t) for t in request.prompt_token_ids)
            local = self._local.pop(request.request_id, 0)
            block_ids = tuple(blocks.get_block_ids()[0])
            self._to_recv.append(RecvSpec(request.request_id, prompt, len(prompt) - 1, block_ids, dict(info), local))
        return True

    # -- producer -------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not self.producer or not isinstance(params, dict) or not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted before its prefill completed: nothing to hand off
        blocks = tuple(block_ids[0] if block_ids and isinstance(block_ids[0], (list, tuple)) else block_ids)
        prompt = tuple(int(t) for t in request.prompt_token_ids)
        if not blocks or request.num_computed_tokens < len(prompt):
            return False, None
        self._to_send.append(SendSpec(request.request_id, prompt, blocks, time.time() + self.settings.transfer_wait_s))
        return True, {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: {"request_id": request.request_id, "prompt_tokens": len(prompt)}}

    # -- both -----------------------------------------------------------------------------
    def build(self, meta: KvpackMetadata, so: Any) -> None:
        meta.sends, self._to_send = self._to_send, []
        self._sending.update(s.req_id for s in meta.sends)
        meta.recvs, self._to_recv = self._to_recv, []
        self._recving.update(r.req_id for r in meta.recvs)

    def connector_output(self, output: Any) -> None:
        for req_id in output.finished_sending or ():
            self._sending.discard(req_id)
        for req_id in output.finished_recving or ():
            self._recving.discard(req_id)

    def has_pending_work(self) -> bool:
        return bool(self._to_send or self._sending)


# ==================================================================================================
# worker half: vLLM's blocks as a kvpack engine the node classes drive unchanged


class _HeldSession:
    """Producer: a "session" whose prefill vLLM already ran. ``prefill`` claims the held
    blocks of a finished request with this prompt from the outbox and copies their rows out
    (the blocks are released at once); the node then packs tiles from ``export_rows``. A
    prefix the node installs first (its resident tier) is kept, the rest is gathered."""

    def __init__(self, engine: "_VllmEngine") -> None:
        self.engine = engine
        self.layout = engine.layout
        self.tokens: list[int] = []
        self.planes: list[Any] = []  # per layer: [2, position, row_elements]
        self.last_logits: Any = None

    @property
    def position(self) -> int:
        return len(self.tokens)

    def prefill(self, token_ids: Any, chunk_size: int | None = None, on_chunk: Any = None) -> None:
        import torch

        full = tuple(self.tokens) + tuple(int(t) for t in token_ids)
        rows = self.engine.outbox.take_rows(full, self.position, self.engine.paged, self.engine.settings.transfer_wait_s)
        if self.planes:
            rows = [torch.cat([old, new], dim=1) for old, new in zip(self.planes, rows)]
        self.planes, self.tokens = rows, list(full)
        self.engine.count_sent(sum(int(r.numel()) * int(r.element_size()) for r in rows))
        if on_chunk is not None:
            on_chunk(self)

    def retained_range(self, layer: int) -> tuple[int, int]:
        return 0, self.position

    def export_rows(self, layer: int, role: str, start: int, stop: int) -> memoryview:
        import torch

        if role not in ("k", "v") or not 0 <= start <= stop <= self.position:
            raise EngineError("layout", f"rows [{start}, {stop}) of {role!r} are not held")
        rows = self.planes[layer][0 if role == "k" else 1, start:stop].contiguous()
        return memoryview(rows.view(torch.uint8).numpy()).cast("B")

    def export_logits(self) -> memoryview:
        raise EngineError("install", "vLLM exposes no logits row at a handed-off prefix")

    def decode_greedy(self, n: int, stop_token_ids: Any = ()) -> tuple[list[int], list[Any]]:
        raise EngineError("unsupported", "a vLLM producer session does not decode (vLLM does)")

    def begin_install(self, cut: int, token_ids: Any, identity: Any) -> "_StagedInstall":
        if not self.engine.same_identity(identity):
            raise EngineError("identity", "install for another identity")
        return _StagedInstall(self.engine.paged, self.layout, cut, list(token_ids), on_commit=self._installed)

    def _installed(self, tokens: list[int], planes: list[Any]) -> None:
        self.tokens, self.planes = tokens, planes


class _StagedInstall(InstallContext):
    """Rows ``[0, cut)`` staged per layer; ``commit`` hands them on (consumer: scattered into
    the request's blocks from row ``local``; producer: the session's rows). Nothing reaches
    vLLM's blocks before ``commit``, which the node calls only after the seal verified and the
    generation was reserved."""

    def __init__(self, paged: PagedKV, layout: Any, cut: int, tokens: list[int], *, on_commit: Any) -> None:
        import torch

        self.paged, self.layout, self.cut, self.tokens = paged, layout, cut, tokens
        self.state = "open"
        self.staged = [torch.empty((2, cut, s.row_elements), dtype=paged.torch_dtype) for s in layout.layers]
        self.written = {(s.index, r): 0 for s in layout.layers for r in ("k", "v")}
        self._on_commit = on_commit

    def required_range(self, layer: int) -> tuple[int, int]:
        self.layout.layer(layer)
        return 0, self.cut

    def write_rows(self, layer: int, role: str, start: int, data: Any) -> None:
        import warnings

        import torch

        if self.state != "open":
            raise EngineError("install", f"install is {self.state}")
        spec = self.layout.layer(layer)
        mv = memoryview(data).cast("B")
        n = mv.nbytes // spec.row_bytes
        if role not in ("k", "v") or mv.nbytes % spec.row_bytes or start < 0 or start + n > self.cut:
            raise EngineError("layout", f"rows [{start}, {start + n}) of {role!r} do not fit cut {self.cut}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only source views; only read
            src = torch.frombuffer(mv, dtype=self.paged.torch_dtype).view(n, spec.row_elements)
        self.staged[layer][0 if role == "k" else 1, start : start + n] = src
        self.written[(layer, role)] += n

    def missing(self) -> list[tuple[int, str, int]]:
        return [(layer, role, self.cut - n) for (layer, role), n in self.written.items() if n != self.cut]

    def write_logits(self, data: Any) -> None:
        raise EngineError("install", "a vLLM handoff carries no logits row")

    def commit(self, *, require_logits: bool = True) -> None:
        if self.state != "open":
            raise EngineError("install", f"install is {self.state}")
        if self.missing():
            raise EngineError("install", "incomplete handoff install")
        self._on_commit(self.tokens, self.staged)
        self.staged = []
        self.state = "committed"

    def abort(self) -> None:
        if self.state == "open":
            self.state = "aborted"
        self.staged = []


class _BlockTarget:
    """Consumer: the "session" one Handoff V2 receive installs into, vLLM's blocks of one
    request. Only a transfer for exactly its prompt and position may open an install."""

    def __init__(self, engine: "_VllmEngine", spec: RecvSpec | None) -> None:
        self.engine, self.spec = engine, spec
        self.layout = engine.layout
        self.tokens: list[int] = []
        self.last_logits: Any = None

    @property
    def position(self) -> int:
        return len(self.tokens)

    def begin_install(self, cut: int, token_ids: Any, identity: Any) -> _StagedInstall:
        spec = self.spec
        if spec is None or not self.engine.same_identity(identity) or cut != spec.position or tuple(token_ids) != spec.tokens[:cut]:
            raise EngineError("install", "no outstanding vLLM receive for this transfer")
        return _StagedInstall(self.engine.paged, self.layout, cut, list(token_ids), on_commit=self._scatter)

    def _scatter(self, tokens: list[int], planes: list[Any]) -> None:
        assert self.spec is not None
        lo = self.spec.local  # rows vLLM's own prefix cache already holds stay as they are
        if lo < self.spec.position:
            for layer, rows in enumerate(planes):
                self.engine.paged.scatter(layer, self.spec.block_ids, lo, rows[:, lo:])
        self.tokens = tokens

    def decode_greedy(self, n: int, stop_token_ids: Any = ()) -> tuple[list[int], list[Any]]:
        raise EngineError("unsupported", "a vLLM consumer session does not decode (vLLM does)")


class _VllmEngine:
    """What the node classes need of an engine: identity, layout, context bound, sessions."""

    prefill_chunk_tokens = 256

    def __init__(self, identity: EngineIdentity, paged: PagedKV, max_context: int, settings: Settings, outbox: "_Outbox", count_sent: Any) -> None:
        self.identity = identity
        self.layout = identity.layout
        self.max_context = max_context
        self.paged = paged
        self.settings = settings
        self.outbox = outbox
        self.count_sent = count_sent
        self._ids = identity.ids()

    def ids(self) -> Any:
        return self._ids

    def same_identity(self, identity: Any) -> bool:
        return identity is self.identity or (hasattr(identity, "ids") and identity.ids() == self._ids) or identity == self._ids

    def check_identity(self, expected: Any) -> None:
        if not self.same_identity(expected):
            raise EngineError("identity", "another engine identity")

    def new_session(self) -> Any:
        return _HeldSession(self) if self.settings.role == "kv_producer" else _BlockTarget(self, None)


@dataclass
class _Outbox:
    """Producer: finished requests' blocks, held until a consumer fetched their rows."""

    entries: dict[str, SendSpec] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, spec: SendSpec) -> None:
        with self.cond:
            self.entries[spec.req_id] = spec
            self.cond.notify_all()

    def _match(self, tokens: tuple[int, ...]) -> SendSpec | None:
        # the oldest held prefill whose prompt starts with the requested rows' tokens and
        # has at least one more token (the consumer computes the last one itself)
        for spec in self.entries.values():
            if len(spec.tokens) > len(tokens) and spec.tokens[: len(tokens)] == tokens:
                return spec
        return None

    def take_rows(self, tokens: tuple[int, ...], start: int, paged: PagedKV, wait_s: float) -> list[Any]:
        """Rows ``[start, len(tokens))`` of every layer from the held blocks of a finished
        prefill of this prompt (waiting up to ``wait_s`` for it); the blocks are released."""
        deadline = time.monotonic() + wait_s
        with self.cond:
            while (spec := self._match(tokens)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError("aborted", "no finished vLLM prefill of this prompt is held here", remote=False)
                self.cond.wait(left)
            del self.entries[spec.req_id]  # claimed: no second consumer gets these blocks
        try:
            return [paged.gather(layer, spec.block_ids, start, len(tokens)) for layer in range(len(paged.planes))]
        finally:
            with self.cond:
                self.done.add(spec.req_id)

    def expire(self) -> None:
        now = time.time()
        with self.cond:
            for req_id, spec in list(self.entries.items()):
                if spec.deadline_unix < now:
                    log.warning("kvpack: prefill %s was not fetched before its deadline; its blocks are freed", req_id)
                    self.entries.pop(req_id)
                    self.done.add(req_id)


class WorkerHandoff:
    """The worker half of both roles: a kvpack ProducerNode over the outbox, or a kvpack
    ReceiverNode plus one receive thread."""

    def __init__(self, settings: Settings, vllm_config: Any, worker: Any) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.worker = worker  # WorkerSide: the registered PagedKV and the stats
        self.producer = settings.role == "kv_producer"
        self.outbox = _Outbox()
        self._seen_finished: set[str] = set()
        self._queue: queue.Queue = queue.Queue()
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.node: Any = None
        self.engine: _VllmEngine | None = None

    def _count_sent(self, nbytes: int) -> None:
        with self.worker._stats_lock:
            self.worker.stats.add("transfers_sent")
            self.worker.stats.add("transfer_bytes", nbytes)

    def start(self) -> None:
        from .identity import vllm_identity

        identity = vllm_identity(self.vllm_config)
        max_context = int(self.vllm_config.model_config.max_model_len)
        self.engine = _VllmEngine(identity, self.worker.paged, max_context, self.settings, self.outbox, self._count_sent)
        config_path = str(self.settings.node_config)
        receipts = os.path.join(os.path.dirname(os.path.abspath(config_path)), "receipts")
        if self.producer:
            # no store: vLLM's blocks are the source; the resident tier keeps one prompt at most
            self.node = ProducerNode(load_producer_config(config_path), self.engine, receipts_dir=receipts, metrics_port=None, resident_bytes=0).start()
        else:
            # start() refuses a configured identity that is not this engine's (enroll with
            # the identity file of these engine arguments)
            cfg = load_receiver_config(config_path)
            self.node = ReceiverNode(
                cfg, self.engine, receipts_dir=receipts, metrics_port=None, advertised_port=self.settings.advertised_port, resident_bytes=0
            )
            self.node.start()
            self._thread = threading.Thread(target=self._receive_loop, name="kvpack-vllm-receive", daemon=True)
            self._thread.start()

    # -- per step --------------------------------------------------------------------------
    def step(self, meta: KvpackMetadata) -> None:
        for send in meta.sends:
            self.outbox.add(send)
        for recv in meta.recvs:
            self._queue.put(recv)

    def results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last call.

        A failed receive is in both of the last two sets, taken under one lock: vLLM must
        never see a failed receive as finished without its failure. A send is reported only
        for a request vLLM already listed as finished (the API's rule)."""
        self._seen_finished |= finished_req_ids
        sending: set[str] = set()
        if self.producer:
            self.outbox.expire()
            with self.outbox.cond:
                sending = self.outbox.done & self._seen_finished
                self.outbox.done -= sending
            self._seen_finished -= sending
        with self._lock:
            recving, self._recv_done = self._recv_done, set()
            failed, self._recv_failed = self._recv_failed, set()
        return sending, recving, failed

    def take_invalid_blocks(self) -> set[int]:
        return set()  # failed receives are reported per request (failed_recving)

    # -- consumer ----------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        while True:
            spec = self._queue.get()
            if spec is None:
                return
            t0 = time.perf_counter()
            try:
                info = self._fetch(spec)
            except BaseException as exc:  # noqa: BLE001 - a failed transfer is recomputed by vLLM
                log.warning("kvpack: handoff for %s refused (%s); vLLM recomputes the prompt", spec.req_id, exc)
                with self.worker._stats_lock:
                    self.worker.stats.refusal(refusal_reason(exc))
                with self._lock:
                    self._recv_failed.add(spec.req_id)
                    self._recv_done.add(spec.req_id)  # vLLM needs failures in both sets
                continue
            with self.worker._stats_lock:
                self.worker.stats.add("transfers_received")
                self.worker.stats.add("transfer_bytes", int(info.get("payload_bytes") or 0))
                self.worker.stats.add("loaded_tokens", spec.position - spec.local)
                self.worker.stats.add("verify_s", time.perf_counter() - t0)
            with self._lock:
                self._recv_done.add(spec.req_id)

    def _fetch(self, spec: RecvSpec) -> dict[str, Any]:
        """One Handoff V2 request to the enrolled producer; returns the receiver's outcome."""
        node = self.node
        assert self.engine is not None
        link = next(lk for lk in node.links if not lk.unsolicited)
        cfg = link.config
        rid = str(spec.params["request_id"])
        t0 = now_ms()
        pending = node.expect(rid, spec.tokens, t0_ms=t0, session=_BlockTarget(self.engine, spec), link=link)
        host = self.settings.advertised_host or cfg.advertised_receiver_host or "127.0.0.1"
        req = ControlRequestV1(rid, t0 + cfg.timeout_ms, spec.tokens, host, node.advertised_port)
        try:
            ctl = link.control.request(req, {})
        except BaseException as exc:
            pending.finish(error=exc)
            node.router.remove(pending)
            raise
        try:
            return dict(node.wait(pending, control=ctl))
        finally:
            ctl.close()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
        if self.node is not None:
            self.node.stop()
