"""The connector's worker half: verified loads into vLLM's blocks, saves out of them.

Loads run in ``start_load_kv`` before the forward that needs them: every byte is verified
(:func:`~.prefix.load_prefix`) before any block is written. A refused load writes nothing;
its blocks are reported to vLLM as failed (``get_block_ids_with_load_errors``), and vLLM's
``kv_load_failure_policy: "recompute"`` computes them instead: a miss, the same tokens.

Saves run in ``wait_for_save`` after the forward: the rows are copied out of the blocks at
once (so vLLM may reuse the blocks), and the cuts are published by one background thread
(``kvpack.save: "async"``, the default) or inline (``"sync"``). Captured rows waiting for
the thread are bounded (``max_pending_save_bytes``); beyond that a save is skipped and
counted, never queued without bound. A failing save (full disk, I/O error) costs that save,
never the request or the engine.

At registration the worker proves its reading of vLLM's block interior against vLLM's own
cache-write kernel (:func:`check_block_layout`) and refuses to start otherwise. Before any
load or save, it checks the scheduler's identity against the KV tensors it really holds:
the topology Id32 recomputed from the tensors' geometry and the block size must match, or
every load and save is refused (a miss).

Never: raise into vLLM's model runner; write blocks outside a spec's block table; keep a
view into vLLM's blocks past ``wait_for_save``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from ...engine.contract import CacheLayout, IdentityIds, id32
from ...errors import EngineError
from ...store.packstore import PackStore
from .identity import attention_isa, cache_layout
from .meta import KvpackMetadata, KvpackWorkerMeta
from .paged import PagedKV
from .prefix import CapturedPrefix, capture, load_prefix, publish, refusal_reason
from .settings import Settings
from .stats import KvpackStats

log = logging.getLogger("kvpack.vllm")


def decode_ids(raw: bytes) -> IdentityIds:
    if len(raw) != 8 * 32:
        raise EngineError("identity", "identity ids must be 8 x 32 bytes")
    parts = [raw[i * 32 : (i + 1) * 32] for i in range(8)]
    return IdentityIds(*parts)


def widen_affinity() -> None:
    """Let the calling thread run on every CPU of the process's cpuset.

    vLLM binds its OpenMP threads (and the thread that created them) to the cores it computes
    on and reserves the others for its own processes; kvpack's hashing and writing threads
    belong on the reserved cores, not on the compute core. Best effort: a refusal leaves the
    thread where it is.
    """
    try:
        allowed = set(range(os.cpu_count() or 1))
        os.sched_setaffinity(0, allowed)
    except (AttributeError, OSError, ValueError):
        pass


@contextlib.contextmanager
def widened_affinity() -> Iterator[None]:
    """Run the block on every CPU (:func:`widen_affinity`), then give the calling thread its
    own binding back.

    A load runs on vLLM's compute thread, bound to the compute core; the store's verifying
    threads, created inside the block, inherit the widened mask and so may use the reserved
    core, while the compute thread itself only waits for them. Its binding is restored
    before the forward. Best effort: without ``sched_getaffinity`` the block runs as is."""
    try:
        own = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        yield
        return
    widen_affinity()
    try:
        yield
    finally:
        try:
            os.sched_setaffinity(0, own)
        except OSError:
            pass


def check_block_layout(paged: PagedKV, isa: str, kv_cache_dtype: str) -> None:
    """Prove the block interior :mod:`.paged` assumes against vLLM's own cache-write kernel.

    Random rows are written into a scratch cache of this geometry by
    ``cpu_attn_reshape_and_cache`` (what vLLM's attention does with every computed token),
    1.5 blocks through a shuffled block table; :meth:`PagedKV.gather` must read back exactly
    those rows, and :meth:`PagedKV.scatter` of the same rows must produce exactly the
    kernel's bytes. Anything else refuses (``unsupported``): a connector that misreads the
    layout would store and load wrong KV."""
    import torch
    from vllm import _custom_ops as ops

    g = paged.geometry
    bs, H, D = g.block_size, g.kv_heads, g.head_dim
    n = bs + bs // 2
    gen = torch.Generator().manual_seed(7)
    key = torch.randn((n, H, D), generator=gen).to(paged.torch_dtype)
    val = torch.randn((n, H, D), generator=gen).to(paged.torch_dtype)
    table = [2, 0]
    slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(n)], dtype=torch.long)
    by_kernel = torch.zeros((3, H, bs, 2 * D), dtype=paged.torch_dtype)
    kc, vc = by_kernel.view(3, H, 2 * bs, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
    rows = torch.stack([key.reshape(n, H * D), val.reshape(n, H * D)])
    if not torch.equal(PagedKV({"layers.0.probe": by_kernel}).gather(0, table, 0, n), rows):
        raise EngineError("unsupported", f"vLLM's {isa} cache kernel does not store blocks the way the connector reads them")
    by_us = torch.zeros_like(by_kernel)
    PagedKV({"layers.0.probe": by_us}).scatter(0, table, 0, rows)
    if not torch.equal(by_us, by_kernel):
        raise EngineError("unsupported", f"the connector does not write blocks the way vLLM's {isa} cache kernel does")


class WorkerSide:
    def __init__(self, settings: Settings, vllm_config: Any, store: PackStore | None) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.hf_config = vllm_config.model_config.hf_config
        self.store = store
        self.paged: PagedKV | None = None
        self.layout: CacheLayout | None = None
        self.stats = KvpackStats()
        self._stats_lock = threading.Lock()
        self._invalid: set[int] = set()
        self._failed_loads: set[str] = set()
        self._resave: set[str] = set()
        self._saved: set[str] = set()
        self._saved_lock = threading.Lock()
        self._checked: dict[bytes, str | None] = {}  # ids -> refusal (None: verified)
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._saver: threading.Thread | None = None

    # -- registration and identity -------------------------------------------------------------
    def register(self, kv_caches: dict[str, Any]) -> None:
        paged = PagedKV(kv_caches)
        g = paged.geometry
        mc, cc = self.vllm_config.model_config, self.vllm_config.cache_config
        check_block_layout(paged, attention_isa(mc.dtype, g.block_size, g.head_dim, str(cc.cache_dtype)), str(cc.cache_dtype))
        self.layout = cache_layout(self.hf_config, g.kv_heads, g.head_dim, g.dtype)
        self.paged = paged

    def _identity_refusal(self, meta: KvpackMetadata) -> str | None:
        """None when the scheduler's identity describes the tensors this worker holds."""
        cached = self._checked.get(meta.ids, "")
        if cached != "":
            return cached
        refusal: str | None = None
        if self.paged is None or self.layout is None:
            refusal = "layout: no KV caches registered"
        else:
            ids = decode_ids(meta.ids)
            if ids.topology != id32("topology", self.layout.canonical()):
                refusal = "identity: the scheduler's cache topology is not this worker's KV tensors"
            elif meta.block_size != self.paged.geometry.block_size:
                refusal = f"identity: block size {meta.block_size} != the tensors' {self.paged.geometry.block_size}"
        if refusal is not None:
            log.error("kvpack: %s; every load and save is refused", refusal)
        self._checked[meta.ids] = refusal
        return refusal

    # -- loads ---------------------------------------------------------------------------------
    def start_load(self, meta: KvpackMetadata) -> None:
        self._failed_loads = set()
        if not meta.loads:
            return
        refusal = self._identity_refusal(meta)
        for spec in meta.loads:
            t0 = time.perf_counter()
            try:
                if refusal is not None:
                    raise EngineError("identity", refusal)
                if self.store is None:
                    raise EngineError("install", "no store configured")
                with widened_affinity():  # the verifying threads may use vLLM's reserved core
                    report = load_prefix(self.store, self.paged, self.layout, decode_ids(meta.ids), spec)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - any refusal is a miss: vLLM recomputes these blocks
                bs = meta.block_size
                self._invalid.update(spec.block_ids[spec.lo // bs : -(-spec.hi // bs)])
                self._failed_loads.add(spec.req_id)
                self._resave.add(spec.req_id)  # vLLM recomputes it: the scheduler plans its save again
                with self._stats_lock:
                    self.stats.refusal(refusal_reason(exc))
                log.warning("kvpack: load of %d tokens refused (%s); recomputing", spec.hi - spec.lo, exc)
                continue
            with self._stats_lock:
                self.stats.add("loads")
                self.stats.add("loaded_tokens", spec.hi - spec.lo)
                self.stats.add("loaded_bytes", report.bytes_verified)
                self.stats.add("verify_s", time.perf_counter() - t0)

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # -- saves ---------------------------------------------------------------------------------
    def save(self, meta: KvpackMetadata) -> None:
        if not meta.saves:
            return
        refusal = self._identity_refusal(meta)
        for spec in meta.saves:
            if spec.req_id in self._failed_loads:
                continue  # this step computed over a refused prefix; reported for a save after the recompute
            if refusal is not None or self.store is None or self.paged is None or self.layout is None:
                self._done(spec.req_id)
                continue
            nbytes = spec.cuts[-1] * self.layout.layers[0].row_bytes * 2 * self.layout.num_layers
            if self.settings.save == "async" and self._pending_bytes + nbytes > self.settings.max_pending_save_bytes:
                with self._stats_lock:
                    self.stats.add("saves_dropped")
                self._done(spec.req_id)
                continue
            try:
                captured = capture(self.paged, self.layout, decode_ids(meta.ids), spec)
            except Exception as exc:  # noqa: BLE001 - a failed capture costs this save only
                log.warning("kvpack: capture for a save failed: %s", exc)
                with self._stats_lock:
                    self.stats.add("save_failures")
                self._done(spec.req_id)
                continue
            if self.settings.save == "sync":
                self._publish(spec.req_id, captured, spec.cuts)
            else:
                self._pending_bytes += captured.nbytes
                self._ensure_saver()
                self._queue.put((spec.req_id, captured, spec.cuts))

    def _ensure_saver(self) -> None:
        if self._saver is None or not self._saver.is_alive():
            self._saver = threading.Thread(target=self._save_loop, name="kvpack-vllm-saver", daemon=True)
            self._saver.start()

    def _save_loop(self) -> None:
        widen_affinity()
        while True:
            item = self._queue.get()
            if item is None:
                return
            req_id, captured, cuts = item
            try:
                self._publish(req_id, captured, cuts)
            finally:
                self._pending_bytes -= captured.nbytes

    def _publish(self, req_id: str, captured: CapturedPrefix, cuts: tuple[int, ...]) -> None:
        t0 = time.perf_counter()
        try:
            reports = publish(self.store, captured, cuts)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - a failed save costs that save, never the engine
            log.warning("kvpack: save failed: %s", exc)
            with self._stats_lock:
                self.stats.add("save_failures")
        else:
            with self._stats_lock:
                self.stats.add("saved_cuts", sum(1 for r in reports if r.kind != "existing"))
                self.stats.add("saved_bytes", sum(r.bytes_written for r in reports))
                self.stats.add("save_s", time.perf_counter() - t0)
        finally:
            self._done(req_id)

    def _done(self, req_id: str) -> None:
        with self._saved_lock:
            self._saved.add(req_id)

    def worker_meta(self) -> KvpackWorkerMeta | None:
        with self._saved_lock:
            saved, self._saved = self._saved, set()
        resave, self._resave = self._resave, set()
        meta = KvpackWorkerMeta(saved=saved, resave=resave)
        return None if meta.is_empty() else meta

    def take_stats(self) -> KvpackStats | None:
        with self._stats_lock:
            return self.stats.take()

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Let pending saves finish (bounded), then stop the saver thread."""
        if self._saver is not None and self._saver.is_alive():
            self._queue.put(None)
            self._saver.join(timeout=timeout_s)
