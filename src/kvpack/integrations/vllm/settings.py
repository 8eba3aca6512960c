"""The connector's configuration, read once from ``kv_connector_extra_config``.

Every key is documented in docs/vllm.md. Unknown ``kvpack.*`` keys are refused at start-up
(a typo must not silently disable verification), values are type-checked, and nothing here
touches the filesystem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import SecurityError

PREFIX = "kvpack."
_KEYS = {
    "store": str,  # pack store directory (created when missing)
    "root_key_file": str,  # the store's root key, when kept outside the store
    "save": str,  # "async" (default) | "sync" | "off"
    "max_pending_save_bytes": int,  # captured rows waiting to be written, at most
    "save_wait_s": float,  # how long a lookup waits for a pending save of its prefix
    "node_config": str,  # kvpack enrollment config (producer.json / receiver.*.json) for P/D
    "advertised_host": str,  # consumer: data-listener host the producer connects back to
    "advertised_port": int,  # consumer: port advertised instead of the bound one (a relay)
    "transfer_wait_s": float,  # producer: how long finished blocks wait for their consumer
    "threads": int,  # the store's hashing/AEAD/writing threads for loads and saves (default 2)
}


@dataclass(frozen=True)
class Settings:
    role: str  # "kv_both" | "kv_producer" | "kv_consumer"
    store: str | None = None
    root_key_file: str | None = None
    save: str = "async"
    max_pending_save_bytes: int = 1 << 30
    save_wait_s: float = 30.0
    node_config: str | None = None
    advertised_host: str | None = None
    advertised_port: int | None = None
    transfer_wait_s: float = 120.0
    threads: int = 2

    @classmethod
    def from_extra(cls, role: str | None, extra: dict[str, Any]) -> "Settings":
        if role not in ("kv_both", "kv_producer", "kv_consumer"):
            raise SecurityError("config", f"kv_role {role!r}: the kvpack connector takes kv_both, kv_producer or kv_consumer")
        values: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX) :]
            kind = _KEYS.get(name)
            if kind is None:
                raise SecurityError("config", f"unknown kv_connector_extra_config key {key!r} (known: {sorted(PREFIX + k for k in _KEYS)})")
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise SecurityError("config", f"{key} must be a {kind.__name__}, got {type(value).__name__}")
            values[name] = value
        settings = cls(role=role, **values)
        if settings.save not in ("async", "sync", "off"):
            raise SecurityError("config", f"{PREFIX}save must be async, sync or off, got {settings.save!r}")
        if role == "kv_both" and not settings.store:
            raise SecurityError("config", f"kv_both needs {PREFIX}store (a pack store directory)")
        if role in ("kv_producer", "kv_consumer") and not settings.node_config:
            raise SecurityError("config", f"{role} needs {PREFIX}node_config (the node's kvpack enrollment config)")
        if settings.threads < 1 or settings.max_pending_save_bytes < 0 or settings.save_wait_s < 0 or settings.transfer_wait_s <= 0:
            raise SecurityError("config", "threads must be >= 1 and the byte and time limits non-negative")
        return settings
