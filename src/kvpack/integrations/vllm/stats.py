"""The connector's counters, carried by vLLM's own connector-stats channel.

Both connector halves count into a :class:`KvpackStats` (a plain dict of numbers, so it
crosses vLLM's process boundaries as msgpack); vLLM aggregates the worker's and the
scheduler's per step, logs them (``KV Transfer metrics: ...``) and hands them to
:class:`KvpackPromMetrics`, which exports them as Prometheus counters
(``vllm:kvpack_*_total``, visible in ``vllm serve``'s ``/metrics`` and in
``LLM.get_metrics()``).

Refusals are counted per reason (``refusals.<category>``): a corrupted chunk, a missing file
or a tampered transfer is a miss plus a refusal, and an operator alerts on the refusals.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: counter name -> help text (exported as ``vllm:kvpack_<name>_total``)
COUNTERS = {
    "lookups": "Prompts looked up in the kvpack prefix store.",
    "hits": "Lookups that planned a verified prefix load.",
    "misses": "Lookups with nothing to load (no stored prefix under this exact identity).",
    "loads": "Prefix loads that verified completely and were written into vLLM's blocks.",
    "loaded_tokens": "Tokens whose KV was loaded instead of computed.",
    "loaded_bytes": "Verified stored bytes read by loads.",
    "saved_cuts": "Prefix cuts (each 256-token boundary and the tail cut) published to the store.",
    "saved_bytes": "Bytes written to the store by saves.",
    "save_failures": "Saves that failed (the request was unaffected).",
    "saves_dropped": "Saves skipped because too many were pending.",
    "refusals": "Loads or transfers refused (corrupt, truncated, foreign, tampered): recomputed.",
    "transfers_sent": "Sealed Handoff V2 transfers acknowledged by a consumer.",
    "transfers_received": "Sealed Handoff V2 transfers verified and installed.",
    "transfer_bytes": "Handoff V2 payload bytes sent or received.",
}
#: summed seconds (exported as ``vllm:kvpack_<name>_seconds_total``)
SECONDS = {"verify": "Seconds spent verifying and installing loads.", "save": "Seconds spent publishing saves."}


class KvpackStats(KVConnectorStats):
    """Counters since the last collection: ``{name: number}`` and ``refusals.<reason>``."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data or {}))

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def refusal(self, reason: str) -> None:
        self.add("refusals")
        self.add(f"refusals.{reason}")

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def take(self) -> "KvpackStats | None":
        """The counters so far (None when empty), and start afresh."""
        if self.is_empty():
            return None
        out = KvpackStats(self.data)
        self.reset()
        return out

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvpackPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters per engine for the numbers in :class:`KvpackStats`."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvpack_{name}", documentation=doc, labelnames=labelnames)
            self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)
        for name, doc in SECONDS.items():
            metric = self._counter_cls(name=f"vllm:kvpack_{name}_seconds", documentation=doc, labelnames=labelnames)
            self._counters[f"{name}_s"] = create_metric_per_engine(metric, per_engine_labelvalues)
        self._refusals: Any = self._counter_cls(name="vllm:kvpack_refusals_by_reason", documentation="Refusals by reason.", labelnames=[*labelnames, "reason"])
        self._labels = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not value:
                continue
            if key.startswith("refusals."):
                self._refusals.labels(*self._labels[engine_idx], key.split(".", 1)[1]).inc(value)
            elif key in self._counters:
                self._counters[key][engine_idx].inc(value)
