"""kvpack inside vLLM: a KV connector for verified prefix reuse and disaggregated prefill.

Load it with ``kv_connector_module_path="kvpack.integrations.vllm"`` and
``kv_connector="KvpackConnector"`` (docs/vllm.md). The connector class is imported lazily:
``import kvpack.integrations.vllm`` works without vLLM installed; only naming the class
needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpackConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvpackConnector":
        from .connector import KvpackConnector

        return KvpackConnector
    raise AttributeError(name)
