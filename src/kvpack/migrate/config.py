"""The decode node's migration config: one strict JSON file, paths relative to it.

::

    {
      "node_name": "dec-a",
      "home": "state",                        # journals, payloads, sessions (0700)
      "listen": "127.0.0.1:8443",             # loopback only
      "tls": {"certificate_chain": "tls/node.crt", "private_key": "tls/node.key",
              "ca": "tls/ca.crt"},            # enrolled node certificate; null = plain HTTP
                                              # (then every internal route answers 403)
      "api_key_file": "api.key",              # bearer key this node accepts (0600)
      "peer_api_key_file": "api.key",         # key presented to decode destinations (optional;
                                              # without it migrate answers 409 migration_not_configured)
      "peer_ca": "tls/ca.crt",                # trust anchor for destinations (default: tls.ca)
      "cluster_dir": "../cluster",            # enrollment dir: storage nodes and their SSH pins
      "ssh_identity_file": "ssh/id_ed25519",  # client key for storage nodes (0600)
      "s3_endpoint": "http://127.0.0.1:8333", # S3 endpoint for s3://bucket/prefix storage destinations
      "s3_credentials_file": "s3.json",       # 0600 S3 credentials (default: AWS environment variables)
      "engine": {"kind": "arrays", "layers": 4, "kv_heads": 4, "head_dim": 64, "vocab": 64},
                                              # or {"kind": "smollm2" | "muse-tiny", "threads": 2}
      "checkpoint_bytes": 4194304,            # upload durable-offset checkpoints (resume.py):
      "checkpoint_interval_s": 1.0,           #   every N bytes or every T seconds, first wins
      "api_limits": {"tls_handshake_timeout_s": 10, "header_timeout_s": 10,
                     "body_idle_timeout_s": 30, "json_body_timeout_s": 30,
                     "max_connections": 256, "max_connections_per_client": 32}
                                              # optional, each key optional (node/api_front.py)
    }

Unknown keys are refused, so a typo cannot silently disable a check.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from typing import Any

from ..vocab import strict_json_loads
from ..errors import MigrationError

_KEYS = {
    "node_name",
    "home",
    "listen",
    "tls",
    "api_key_file",
    "peer_api_key_file",
    "peer_ca",
    "cluster_dir",
    "ssh_identity_file",
    "s3_endpoint",
    "s3_credentials_file",
    "engine",
    "upload_chunk_bytes",
    "checkpoint_bytes",
    "checkpoint_interval_s",
    "api_limits",
}


@dataclass(frozen=True)
class ApiLimits:
    """Connection limits of the node API, enforced by :mod:`kvpack.node.api_front`."""

    tls_handshake_timeout_s: float = 10.0
    header_timeout_s: float = 10.0
    body_idle_timeout_s: float = 30.0
    json_body_timeout_s: float = 30.0
    max_connections: int = 256
    max_connections_per_client: int = 32


def _api_limits(raw: Any, path: str) -> ApiLimits:
    if raw is None:
        return ApiLimits()
    names = {f.name: f.type for f in fields(ApiLimits)}
    if not isinstance(raw, dict) or set(raw) - set(names):
        raise MigrationError("usage", f"config {path}: api_limits must be an object with keys {sorted(names)}")
    for key, value in raw.items():
        whole = key.startswith("max_")
        ok = type(value) is int if whole else type(value) in (int, float)
        if not ok or not 0 < value <= (1 << 20 if whole else 86400):
            raise MigrationError("usage", f"config {path}: api_limits.{key} must be a positive {'integer' if whole else 'number of seconds'}")
    return ApiLimits(**raw)


@dataclass
class NodeConfig:
    path: str
    node_name: str
    home: str
    host: str
    port: int
    tls: dict[str, str] | None
    api_key_file: str
    peer_api_key_file: str | None
    peer_ca: str | None
    cluster_dir: str | None
    ssh_identity_file: str | None
    engine: dict[str, Any]
    s3_endpoint: str | None = None
    s3_credentials_file: str | None = None
    upload_chunk_bytes: int = 1024 * 1024
    checkpoint_bytes: int = 4 * 1024 * 1024
    checkpoint_interval_s: float = 1.0
    api_limits: ApiLimits = field(default_factory=ApiLimits)

    @property
    def base_url(self) -> str:
        scheme = "https" if self.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"


def load_config(path: str) -> NodeConfig:
    path = os.path.abspath(path)
    try:
        with open(path, "rb") as fh:
            raw = strict_json_loads(fh.read())
    except OSError as exc:
        raise MigrationError("usage", f"cannot read config {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise MigrationError("usage", f"config {path} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise MigrationError("usage", "config must be a JSON object")
    unknown = set(raw) - _KEYS
    if unknown:
        raise MigrationError("usage", f"config {path}: unknown keys {sorted(unknown)}")
    base = os.path.dirname(path)

    def rel_required(value: Any, what: str) -> str:
        if value is None:
            raise MigrationError("usage", f"config {path}: {what} is required")
        if not isinstance(value, str) or not value:
            raise MigrationError("usage", f"config {path}: {what} must be a path")
        return os.path.normpath(os.path.join(base, value))

    def rel(value: Any, what: str, required: bool = False) -> str | None:
        return None if value is None and not required else rel_required(value, what)

    listen = raw.get("listen", "127.0.0.1:0")
    host, _, port = str(listen).rpartition(":")
    host = host.strip("[]")
    try:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError
        port_n = int(port)
    except ValueError:
        raise MigrationError("usage", f"config {path}: listen must be a loopback IP:PORT (got {listen!r})") from None
    tls = raw.get("tls")
    if tls is not None:
        if not isinstance(tls, dict) or set(tls) != {"certificate_chain", "private_key", "ca"}:
            raise MigrationError("usage", f"config {path}: tls needs certificate_chain, private_key, ca")
        tls = {k: rel(v, f"tls.{k}", True) for k, v in tls.items()}
    engine = raw.get("engine") or {"kind": "arrays"}
    if not isinstance(engine, dict) or engine.get("kind") not in ("arrays", "smollm2", "muse-tiny"):
        raise MigrationError("usage", f"config {path}: engine.kind must be arrays, smollm2 or muse-tiny")
    name = raw.get("node_name") or "decode-node"
    return NodeConfig(
        path=path,
        node_name=str(name),
        home=rel_required(raw.get("home"), "home"),
        host=host,
        port=port_n,
        tls=tls,
        api_key_file=rel_required(raw.get("api_key_file"), "api_key_file"),
        peer_api_key_file=rel(raw.get("peer_api_key_file"), "peer_api_key_file"),
        peer_ca=rel(raw.get("peer_ca"), "peer_ca") or (tls or {}).get("ca"),
        cluster_dir=rel(raw.get("cluster_dir"), "cluster_dir"),
        ssh_identity_file=rel(raw.get("ssh_identity_file"), "ssh_identity_file"),
        engine=engine,
        s3_endpoint=str(raw["s3_endpoint"]) if raw.get("s3_endpoint") else None,
        s3_credentials_file=rel(raw.get("s3_credentials_file"), "s3_credentials_file"),
        upload_chunk_bytes=int(raw.get("upload_chunk_bytes", 1024 * 1024)),
        checkpoint_bytes=int(raw.get("checkpoint_bytes", 4 * 1024 * 1024)),
        checkpoint_interval_s=float(raw.get("checkpoint_interval_s", 1.0)),
        api_limits=_api_limits(raw.get("api_limits"), path),
    )


def read_api_key(path: str) -> bytes:
    """An API key file under the secret-file contract (regular file, 0600, bounded); one line."""
    from ..security.secret_files import read_protected_file

    data = read_protected_file(path, what="API key file", max_size=4096)
    key = data.strip()
    if len(key) < 16 or not all(0x21 <= b < 0x7F for b in key):
        raise MigrationError("usage", f"API key file {path!r} must hold one printable token of >= 16 characters")
    return key


def build_engine(spec: dict[str, Any]):
    """The node's engine from its config (the identity every prepare is checked against)."""
    from ..engine.registry import arrays_engine, load_engine

    if spec["kind"] == "arrays":
        return arrays_engine(
            int(spec.get("layers", 4)),
            int(spec.get("kv_heads", 4)),
            int(spec.get("head_dim", 64)),
            vocab=int(spec.get("vocab", 64)),
            name=str(spec.get("name", "arrays")),
        )
    threads = spec.get("threads")  # None: the registry's default for this engine
    return load_engine(spec["kind"], threads=None if threads is None else int(threads))
