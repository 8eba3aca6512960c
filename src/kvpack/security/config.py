"""Receiver and producer configuration loaders (INTEROP.md C.15, INTEROP-C-ERRATA L10).

The receiver config is the enrollment artifact made concrete: every identity a seal will be
checked against, held *by path*, never inlined. The loader is deliberately unforgiving:

* strict JSON: duplicate keys, NaN/Infinity, floats or booleans where integers belong are refused;
* ``deny_unknown_fields`` at every level, and every bound of C.15 / errata L10;
* relative paths resolve against the directory of the config file;
* the files it names must exist; the private key and the HMAC key must satisfy the key-file
  contract (:mod:`kvpack.security.secret_files`); the peer CA must parse as one or more
  certificates and nothing else.

The producer config is kvpack's own (upstream's is a Python CLI's flags); its shape is documented
in docs/security.md and on :class:`ProducerConfig`.

All refusals are ``SecurityError('config', ...)`` naming the file and the field, except key-file
violations, which keep their ``secret_file`` category.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Any

from ..errors import SecurityError
from ..vocab import StrictJsonError, is_hex64
from ..vocab import strict_json_loads as vocab_strict_json_loads
from .secret_files import load_hmac_key, load_private_key_pem
from .tls import CONTROL_ALPN, DATA_ALPN, TlsEndpoint, validate_pins

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
CONFIG_MAX_BYTES = 1 << 20

_HOST_CHARS = re.compile(r"^[A-Za-z0-9.:_-]{1,253}$")  # advertised_receiver_host (L10)
_SERVER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,253}$")  # producer_control.server_name (L10)

IDENTITY_HEX_FIELDS = (
    "adapter_sha256",
    "chat_template_sha256",
    "context_policy_sha256",
    "model_sha256",
    "tokenizer_sha256",
)
IDENTITY_FIELDS = frozenset(IDENTITY_HEX_FIELDS + ("model_revision", "tokenizer_revision"))


# -- strict JSON -----------------------------------------------------------------------------------


def strict_json_loads(data: bytes, *, source: str) -> Any:
    """Parse JSON strictly (kvpack.vocab: duplicate keys, NaN/Infinity and invalid UTF-8 are
    refused); a refusal is a ``config`` error naming ``source``."""
    try:
        return vocab_strict_json_loads(data)
    except StrictJsonError as exc:
        raise SecurityError("config", f"{source}: not valid JSON: {exc}") from None


def read_config_file(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """Read and parse a config file; return (absolute path, object)."""
    p = os.path.abspath(os.fspath(path))
    try:
        with open(p, "rb") as fh:
            data = fh.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise SecurityError("config", f"cannot read config {p!r}: {exc.strerror}") from None
    if len(data) > CONFIG_MAX_BYTES:
        raise SecurityError("config", f"config {p!r} is larger than {CONFIG_MAX_BYTES} bytes")
    obj = strict_json_loads(data, source=f"config {p!r}")
    if not isinstance(obj, dict):
        raise SecurityError("config", f"config {p!r} must be a JSON object")
    return p, obj


# -- field checkers ------------------------------------------------------------------------------------


class _Fields:
    """Typed access to one JSON object with allow-lists and required fields."""

    def __init__(self, obj: Any, where: str, *, required: set[str], optional: set[str] | frozenset[str] = frozenset()):
        if not isinstance(obj, dict):
            raise SecurityError("config", f"{where} must be an object")
        unknown = set(obj) - required - optional
        if unknown:
            raise SecurityError("config", f"{where}: unknown field(s) {sorted(unknown)}")
        missing = required - set(obj)
        if missing:
            raise SecurityError("config", f"{where}: missing field(s) {sorted(missing)}")
        self.obj = obj
        self.where = where

    def has(self, name: str) -> bool:
        return name in self.obj and self.obj[name] is not None

    def refuse(self, name: str, why: str) -> SecurityError:
        return SecurityError("config", f"{self.where}.{name} {why}")

    def integer(self, name: str, lo: int, hi: int) -> int:
        value = self.obj[name]
        if type(value) is not int:  # bool is a subclass of int: refuse it explicitly
            raise self.refuse(name, f"must be an integer, got {value!r}")
        if not lo <= value <= hi:
            raise self.refuse(name, f"must be in {lo}..{hi}, got {value}")
        return value

    def string(self, name: str, *, lo: int = 1, hi: int = 4096, pattern: re.Pattern[str] | None = None, byte_length: bool = False) -> str:
        value = self.obj[name]
        if not isinstance(value, str):
            raise self.refuse(name, f"must be a string, got {value!r}")
        n = len(value.encode("utf-8")) if byte_length else len(value)
        if not lo <= n <= hi:
            raise self.refuse(name, f"must be {lo}..{hi} {'bytes' if byte_length else 'characters'} long")
        if pattern is not None and not pattern.fullmatch(value):  # fullmatch: `$` alone admits a trailing newline
            raise self.refuse(name, f"has characters outside {pattern.pattern}: {value!r}")
        return value

    def hex64(self, name: str) -> str:
        value = self.obj[name]
        if not is_hex64(value):
            raise self.refuse(name, f"must be 64 lowercase hex digits, got {value!r}")
        return value


def parse_socket_address(text: Any, where: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """``ip:port`` or ``[ipv6]:port`` (a Rust SocketAddr): an IP literal, not a host name."""
    if not isinstance(text, str):
        raise SecurityError("config", f"{where} must be a string 'ip:port'")
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:
            sep = ""  # a bare IPv6 address needs brackets
    if not sep or not port.isdigit():
        raise SecurityError("config", f"{where} must be 'ip:port' or '[ipv6]:port', got {text!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise SecurityError("config", f"{where} host {host!r} is not an IP address") from None
    number = int(port)
    if number > 65535 or (number == 0 and not allow_port_zero):
        raise SecurityError("config", f"{where} port {number} is out of range")
    return host, number


def parse_host_port(text: Any, where: str) -> tuple[str, int]:
    """``host:port`` where host may be a name (producer_control.address)."""
    if not isinstance(text, str):
        raise SecurityError("config", f"{where} must be a string 'host:port'")
    if text.startswith("["):
        return parse_socket_address(text, where, allow_port_zero=False)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise SecurityError("config", f"{where} must be 'host:port' with a port 1..65535, got {text!r}")
    if not _HOST_CHARS.fullmatch(host):
        raise SecurityError("config", f"{where} host {host!r} has invalid characters")
    return host, int(port)


def _resolve(base_dir: str, value: str) -> str:
    return os.path.normpath(value if os.path.isabs(value) else os.path.join(base_dir, value))


def _require_file(path: str, where: str) -> None:
    if not os.path.isfile(path):
        raise SecurityError("config", f"{where} names {path!r}, which is not an existing file")


def check_ca_file(path: str, where: str) -> None:
    """Errata L10: the peer CA must parse as at least one certificate and nothing unparsable."""
    from cryptography import x509

    try:
        with open(path, "rb") as fh:
            data = fh.read(CONFIG_MAX_BYTES + 1)
    except OSError as exc:
        raise SecurityError("config", f"{where}: cannot read {path!r}: {exc.strerror}") from None
    if data.count(b"-----BEGIN") != data.count(b"-----BEGIN CERTIFICATE-----"):
        raise SecurityError("config", f"{where}: {path!r} contains PEM blocks that are not certificates")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise SecurityError("config", f"{where}: {path!r} has an unparsable certificate: {exc}") from None
    if not certs:
        raise SecurityError("config", f"{where}: {path!r} holds no certificate")


def parse_identity(obj: Any, where: str) -> dict[str, str]:
    """ExactIdentityV1: five lowercase-hex digests and two free revision strings."""
    f = _Fields(obj, where, required=set(IDENTITY_FIELDS))
    out = {name: f.hex64(name) for name in IDENTITY_HEX_FIELDS}
    for name in ("model_revision", "tokenizer_revision"):
        value = obj[name]
        if not isinstance(value, str):
            raise f.refuse(name, "must be a string")
        out[name] = value
    return out


@dataclass(frozen=True)
class DflashGeometry:
    layers: int
    elements_per_token: int
    sink_size: int
    window_size: int


# -- receiver config (C.15) --------------------------------------------------------------------------

_RECEIVER_REQUIRED = {
    "schema_version",
    "listen",
    "certificate_chain",
    "private_key",
    "peer_ca",
    "peer_leaf_sha256",
    "hmac_key_file",
    "hmac_key_id",
    "minimum_hmac_epoch",
    "replay_ledger",
    "timeout_ms",
    "wait_for_producer_ms",
    "identity",
    "target_cache_identity_sha256",
}
_RECEIVER_OPTIONAL = {
    "advertised_receiver_host",
    "producer_control",
    "producer_mode",
    "dflash_identity_sha256",
    "dflash_context_geometry",
}


@dataclass(frozen=True)
class ProducerControl:
    address: str
    host: str
    port: int
    server_name: str


@dataclass(frozen=True)
class ReceiverConfig:
    """A loaded, validated C.15 receiver config (paths absolute)."""

    path: str
    listen_host: str
    listen_port: int
    certificate_chain: str
    private_key: str
    peer_ca: str
    peer_leaf_sha256: frozenset[str]
    hmac_key_file: str
    hmac_key_id: str
    minimum_hmac_epoch: int
    replay_ledger: str
    timeout_ms: int
    wait_for_producer_ms: int
    advertised_receiver_host: str | None
    producer_control: ProducerControl | None
    producer_mode: str
    identity: dict[str, str]
    target_cache_identity_sha256: str
    dflash_identity_sha256: str | None
    dflash_context_geometry: DflashGeometry | None

    def data_endpoint(self) -> TlsEndpoint:
        """The Handoff V2 listener's TLS endpoint (server side, ALPN muser-kvpack-v2)."""
        return TlsEndpoint(self.certificate_chain, self.private_key, self.peer_ca, self.peer_leaf_sha256, DATA_ALPN)

    def control_endpoint(self) -> TlsEndpoint:
        """The control-plane client endpoint (errata L8: same leaf, same pins, SNI server_name)."""
        if self.producer_control is None:
            raise SecurityError("config", f"{self.path}: no producer_control configured")
        return TlsEndpoint(self.certificate_chain, self.private_key, self.peer_ca, self.peer_leaf_sha256, CONTROL_ALPN, self.producer_control.server_name)

    def load_hmac_key(self) -> bytes:
        return load_hmac_key(self.hmac_key_file)


def load_receiver_config(path: str | os.PathLike[str], *, check_files: bool = True) -> ReceiverConfig:
    """Load and validate a C.15 receiver config."""
    p, obj = read_config_file(path)
    base = os.path.dirname(p)
    f = _Fields(obj, f"receiver config {p!r}", required=_RECEIVER_REQUIRED, optional=_RECEIVER_OPTIONAL)
    if f.integer("schema_version", 0, U32_MAX) != 1:
        raise f.refuse("schema_version", "must be 1")
    listen_host, listen_port = parse_socket_address(obj["listen"], f"{f.where}.listen")
    paths = {name: _resolve(base, f.string(name)) for name in ("certificate_chain", "private_key", "peer_ca", "hmac_key_file", "replay_ledger")}
    pins_raw = obj["peer_leaf_sha256"]
    if not isinstance(pins_raw, list):
        raise f.refuse("peer_leaf_sha256", "must be a list of pins")
    pins = validate_pins(pins_raw, what=f"{f.where}.peer_leaf_sha256")
    key_id = f.string("hmac_key_id", lo=1, hi=128, byte_length=True)
    minimum_epoch = f.integer("minimum_hmac_epoch", 1, U64_MAX)
    timeout_ms = f.integer("timeout_ms", 1, 900_000)
    wait_ms = f.integer("wait_for_producer_ms", 1, timeout_ms)
    advertised = f.string("advertised_receiver_host", hi=253, pattern=_HOST_CHARS) if f.has("advertised_receiver_host") else None
    control = None
    if f.has("producer_control"):
        c = _Fields(obj["producer_control"], f"{f.where}.producer_control", required={"address", "server_name"})
        host, port = parse_host_port(obj["producer_control"]["address"], f"{c.where}.address")
        control = ProducerControl(obj["producer_control"]["address"], host, port, c.string("server_name", hi=253, pattern=_SERVER_NAME))
        if advertised is None:
            raise f.refuse("producer_control", "requires advertised_receiver_host")
    mode = "exact"
    if f.has("producer_mode"):
        mode = obj["producer_mode"]
        if mode not in ("exact", "native"):
            raise f.refuse("producer_mode", f"must be 'exact' or 'native', got {mode!r}")
    identity = parse_identity(obj["identity"], f"{f.where}.identity")
    target = f.hex64("target_cache_identity_sha256")
    dflash_id = f.hex64("dflash_identity_sha256") if f.has("dflash_identity_sha256") else None
    geometry = None
    if f.has("dflash_context_geometry"):
        g = _Fields(obj["dflash_context_geometry"], f"{f.where}.dflash_context_geometry", required={"layers", "elements_per_token", "sink_size", "window_size"})
        geometry = DflashGeometry(
            g.integer("layers", 1, U32_MAX),
            g.integer("elements_per_token", 1, U32_MAX),
            g.integer("sink_size", 0, U32_MAX),
            g.integer("window_size", 1, U32_MAX),
        )
    if (dflash_id is None) != (geometry is None):
        raise SecurityError("config", f"{f.where}: dflash_identity_sha256 and dflash_context_geometry must appear together")
    if mode == "native" and dflash_id is not None:
        raise SecurityError("config", f"{f.where}: producer_mode 'native' forbids DFlash")
    if check_files:
        for name in ("certificate_chain", "private_key", "peer_ca", "hmac_key_file"):
            _require_file(paths[name], f"{f.where}.{name}")
        load_private_key_pem(paths["private_key"])
        load_hmac_key(paths["hmac_key_file"])
        check_ca_file(paths["peer_ca"], f"{f.where}.peer_ca")
    return ReceiverConfig(
        path=p,
        listen_host=listen_host,
        listen_port=listen_port,
        certificate_chain=paths["certificate_chain"],
        private_key=paths["private_key"],
        peer_ca=paths["peer_ca"],
        peer_leaf_sha256=pins,
        hmac_key_file=paths["hmac_key_file"],
        hmac_key_id=key_id,
        minimum_hmac_epoch=minimum_epoch,
        replay_ledger=paths["replay_ledger"],
        timeout_ms=timeout_ms,
        wait_for_producer_ms=wait_ms,
        advertised_receiver_host=advertised,
        producer_control=control,
        producer_mode=mode,
        identity=identity,
        target_cache_identity_sha256=target,
        dflash_identity_sha256=dflash_id,
        dflash_context_geometry=geometry,
    )


# -- producer config (kvpack's own) -------------------------------------------------------------------

_PRODUCER_REQUIRED = {
    "schema_version",
    "node_name",
    "certificate_chain",
    "private_key",
    "peer_ca",
    "control_listen",
    "generation_ledger",
    "receivers",
}
_RECEIVER_ENTRY = {"name", "server_name", "leaf_sha256", "hmac_key_file", "hmac_key_id", "hmac_epoch"}
#: what that receiver admits (enrollment writes them; configs written before may lack them):
#: the producer refuses to start with an engine of another identity
_RECEIVER_ENTRY_OPTIONAL = frozenset({"identity", "target_cache_identity_sha256"})


@dataclass(frozen=True)
class ProducerReceiver:
    """One receiver this producer may hand off to, with the pair's HMAC key."""

    name: str
    server_name: str
    leaf_sha256: frozenset[str]
    hmac_key_file: str
    hmac_key_id: str
    hmac_epoch: int
    #: the ExactIdentityV1 and target cache identity this receiver admits (None: a config
    #: written before enrollment recorded them; the receiver still refuses a begin of another)
    identity: dict[str, str] | None = None
    target_cache_identity_sha256: str | None = None


@dataclass(frozen=True)
class ProducerConfig:
    """A loaded producer config::

    {"schema_version": 1, "node_name": "prefill-a",
     "certificate_chain": "tls/node.crt", "private_key": "tls/node.key", "peer_ca": "tls/ca.crt",
     "control_listen": "127.0.0.1:29591",
     "generation_ledger": "state/generation-ledger.json",
     "receivers": [{"name": "decode-a", "server_name": "decode-a", "leaf_sha256": ["<hex>"],
                    "hmac_key_file": "hmac/<key_id>.key", "hmac_key_id": "<key_id>",
                    "hmac_epoch": 1}]}
    """

    path: str
    node_name: str
    certificate_chain: str
    private_key: str
    peer_ca: str
    control_listen_host: str
    control_listen_port: int
    generation_ledger: str
    receivers: tuple[ProducerReceiver, ...]

    def receiver(self, name: str) -> ProducerReceiver:
        for entry in self.receivers:
            if entry.name == name:
                return entry
        raise SecurityError("config", f"{self.path}: no receiver named {name!r}")

    def data_endpoint(self, receiver: str) -> TlsEndpoint:
        """Client endpoint for a Handoff V2 connection to one receiver (its pins and name)."""
        r = self.receiver(receiver)
        return TlsEndpoint(self.certificate_chain, self.private_key, self.peer_ca, r.leaf_sha256, DATA_ALPN, r.server_name)

    def control_endpoint(self) -> TlsEndpoint:
        """Server endpoint of the control listener: any enrolled receiver's leaf is accepted."""
        pins = frozenset().union(*(r.leaf_sha256 for r in self.receivers))
        return TlsEndpoint(self.certificate_chain, self.private_key, self.peer_ca, pins, CONTROL_ALPN)


def load_producer_config(path: str | os.PathLike[str], *, check_files: bool = True) -> ProducerConfig:
    p, obj = read_config_file(path)
    base = os.path.dirname(p)
    f = _Fields(obj, f"producer config {p!r}", required=_PRODUCER_REQUIRED)
    if f.integer("schema_version", 0, U32_MAX) != 1:
        raise f.refuse("schema_version", "must be 1")
    node_name = f.string("node_name", hi=253, pattern=_SERVER_NAME)
    paths = {name: _resolve(base, f.string(name)) for name in ("certificate_chain", "private_key", "peer_ca", "generation_ledger")}
    host, port = parse_socket_address(obj["control_listen"], f"{f.where}.control_listen")
    entries = obj["receivers"]
    if not isinstance(entries, list) or not entries:
        raise f.refuse("receivers", "must be a non-empty list")
    receivers = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        e = _Fields(entry, f"{f.where}.receivers[{i}]", required=set(_RECEIVER_ENTRY), optional=_RECEIVER_ENTRY_OPTIONAL)
        if e.has("identity") != e.has("target_cache_identity_sha256"):
            raise SecurityError("config", f"{e.where}: identity and target_cache_identity_sha256 must appear together")
        name = e.string("name", hi=253, pattern=_SERVER_NAME)
        if name in names:
            raise e.refuse("name", f"duplicates receiver {name!r}")
        names.add(name)
        if not isinstance(entry["leaf_sha256"], list):
            raise e.refuse("leaf_sha256", "must be a list of pins")
        receivers.append(
            ProducerReceiver(
                name=name,
                server_name=e.string("server_name", hi=253, pattern=_SERVER_NAME),
                leaf_sha256=validate_pins(entry["leaf_sha256"], what=f"{e.where}.leaf_sha256"),
                hmac_key_file=_resolve(base, e.string("hmac_key_file")),
                hmac_key_id=e.string("hmac_key_id", lo=1, hi=128, byte_length=True),
                hmac_epoch=e.integer("hmac_epoch", 1, U64_MAX),
                identity=parse_identity(entry["identity"], f"{e.where}.identity") if e.has("identity") else None,
                target_cache_identity_sha256=e.hex64("target_cache_identity_sha256") if e.has("target_cache_identity_sha256") else None,
            )
        )
    if check_files:
        for name in ("certificate_chain", "private_key", "peer_ca"):
            _require_file(paths[name], f"{f.where}.{name}")
        load_private_key_pem(paths["private_key"])
        check_ca_file(paths["peer_ca"], f"{f.where}.peer_ca")
        for r in receivers:
            load_hmac_key(r.hmac_key_file)
    return ProducerConfig(
        path=p,
        node_name=node_name,
        certificate_chain=paths["certificate_chain"],
        private_key=paths["private_key"],
        peer_ca=paths["peer_ca"],
        control_listen_host=host,
        control_listen_port=port,
        generation_ledger=paths["generation_ledger"],
        receivers=tuple(receivers),
    )
