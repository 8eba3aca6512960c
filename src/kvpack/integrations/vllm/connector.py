"""``KvpackConnector``: kvpack as a vLLM KV connector (``KVConnectorBase_V1``).

vLLM builds two instances: one in the scheduler process (``KVConnectorRole.SCHEDULER``) and
one in each worker (``WORKER``). This class only routes vLLM's calls to the half that owns
them (:mod:`.scheduler`, :mod:`.worker`, and for disaggregated prefill :mod:`.disagg`) and
converts vLLM's objects into the plain specs those halves use. Roles (``kv_role``):

* ``kv_both``: the verified prefix store (load the deepest stored prefix cut, save
  new cuts);
* ``kv_producer`` / ``kv_consumer``: disaggregated prefill; the producer hands each finished
  prefill to the consumer as a sealed Handoff V2 transfer over mutual TLS (:mod:`.disagg`).

Start with ``kv_connector_module_path: "kvpack.integrations.vllm"`` and
``kv_connector: "KvpackConnector"`` (docs/vllm.md).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import SecurityError
from .identity import check_kv_cache_config, vllm_identity
from .meta import KvpackMetadata
from .scheduler import SchedulerSide, open_store
from .settings import Settings
from .stats import KvpackPromMetrics, KvpackStats
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger("kvpack.vllm")


class KvpackConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.settings = Settings.from_extra(ktc.kv_role, dict(ktc.kv_connector_extra_config or {}))
        if ktc.kv_load_failure_policy != "recompute":
            log.warning("kvpack: kv_load_failure_policy is %r: a refused load fails its request instead of recomputing it", ktc.kv_load_failure_policy)
        store = open_store(self.settings.store, self.settings.root_key_file) if self.settings.store else None
        if store is not None:
            store.workers = self.settings.threads  # hashing / AEAD / write threads of loads and saves
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._disagg: Any = None
        if role == KVConnectorRole.SCHEDULER:
            if self.settings.role == "kv_producer" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
                # finished prefills reach the worker's outbox in the steps after them, which
                # only vLLM's engine-core loop runs; an in-process offline engine steps only
                # while a caller waits for its own requests
                raise SecurityError("config", "kv_producer needs vLLM's engine-core process (unset VLLM_ENABLE_V1_MULTIPROCESSING=0)")
            identity = vllm_identity(vllm_config)
            check_kv_cache_config(identity, kv_cache_config)
            block_size = int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
            self._scheduler = SchedulerSide(self.settings, identity, block_size, store)
            if self.settings.role != "kv_both":
                from .disagg import SchedulerHandoff

                self._disagg = SchedulerHandoff(self.settings, identity, block_size, self._scheduler.stats)
        else:
            self._worker = WorkerSide(self.settings, vllm_config, store)
            if self.settings.role != "kv_both":
                from .disagg import WorkerHandoff

                self._disagg = WorkerHandoff(self.settings, vllm_config, self._worker)

    # ==============================================================================================
    # worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)
        if self._disagg is not None:
            self._disagg.start()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is None or self._worker is None:
            return
        self._worker.start_load(meta)
        if self._disagg is not None:
            self._disagg.step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves copy whole requests after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._metadata()
        if meta is not None and self._worker is not None:
            self._worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._disagg is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self._disagg.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        out = self._worker.take_invalid_blocks()
        if self._disagg is not None:
            out |= self._disagg.take_invalid_blocks()
        return out

    def build_connector_worker_meta(self) -> Any:
        return None if self._worker is None else self._worker.worker_meta()

    def get_kv_connector_stats(self) -> KvpackStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return None if side is None else side.take_stats()

    def shutdown(self) -> None:
        if self._disagg is not None and self._worker is not None:
            self._disagg.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    def _metadata(self) -> KvpackMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KvpackMetadata) else None

    # ==============================================================================================
    # scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if self._disagg is not None:
            got = self._disagg.matched_tokens(request, num_computed_tokens)
            if got is not None:
                return got
        prompt = request.prompt_token_ids
        return self._scheduler.matched_tokens(request.request_id, list(prompt) if prompt is not None else None, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if self._disagg is not None and self._disagg.after_alloc(request, blocks, num_external_tokens):
            return
        self._scheduler.after_alloc(request.request_id, blocks.get_block_ids()[0] if num_external_tokens else [], num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build(scheduler_output)
        if self._disagg is not None:
            self._disagg.build(meta, scheduler_output)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.worker_output(connector_output.kv_connector_worker_meta)
        if self._disagg is not None:
            self._disagg.connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        if self._disagg is not None:
            return self._disagg.request_finished(request, block_ids)
        return False, None

    def has_pending_push_work(self) -> bool:
        return self._disagg is not None and self._disagg.has_pending_work()

    # ==============================================================================================
    # metrics

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvpackStats | None:
        return KvpackStats(data) if data is not None else KvpackStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return KvpackPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
