"""Enrollment: a cluster CA, node certificates, leaf pins, pairwise HMAC keys and configs.

Identity is decided here, before any transfer exists, and recorded on disk; nothing on the wire
negotiates it (seed 004 §24.6). The workflow works on real files in one cluster directory::

    DIR/
      cluster.json                     registry: nodes, roles, pins, expiry, pair key ids/epochs
                                       (public; no secret material)
      ca/ca.key (0600)  ca/ca.crt      the cluster CA
      nodes/<name>/                    what is shipped to that node (0700)
        tls/node.key (0600)            generated here, never copied anywhere
        tls/node.csr  tls/node.crt  tls/ca.crt
        hmac/<key_id>.key (0600)       one per receiver/producer pair, 64 lowercase hex + "\\n"
        receiver.<producer>.json       receivers: one C.15 config per paired producer
        producer.json                  producers: kvpack producer config (all paired receivers)
        state/                         receivers: replay ledgers (internal disk); producers:
                                       the generation ledger

Rules enforced:

* the node's private key is created inside its own directory; the CA only ever sees the CSR,
  verifies its signature, and takes the names from the registry, not from the CSR;
* leaves are ECDSA P-256 with SANs = node name, ``localhost``, ``127.0.0.1``, ``::1`` (+ extra
  ``--san``), keyUsage digitalSignature, extendedKeyUsage serverAuth *and* clientAuth, because
  every leaf is both a TLS server and a TLS client (INTEROP-C-ERRATA H1);
* the pin recorded is the SHA-256 of the exact leaf just issued, not of the CA;
* rotation (``--rotate``) re-keys and re-issues, and bumps the HMAC epoch of every affected pair
  with fresh key material, so the replay ledger starts a *disjoint* counter space. Ledgers are
  never touched: deleting one would make every captured transfer replayable again. The bumped
  epochs are recorded in the registry *before* any key is rewritten, so a crash mid-rotation can
  only skip an epoch, never reuse one.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..durable import atomic_write, ensure_dir
from ..errors import SecurityError
from .config import parse_identity, strict_json_loads
from .secret_files import load_private_key_pem

ROLES = ("receiver", "producer", "storage")
NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,58}[a-z0-9])?$")
DEFAULT_LEAF_DAYS = 365
DEFAULT_CA_DAYS = 3650
DEFAULT_RECEIVER_LISTEN = "127.0.0.1:29590"
DEFAULT_CONTROL_LISTEN = "127.0.0.1:29591"
LOOPBACK_SANS = ("localhost", "127.0.0.1", "::1")
REGISTRY = "cluster.json"
#: Clock-skew allowance on notBefore so freshly issued certificates verify on peers at once.
BACKDATE = _dt.timedelta(minutes=5)


# -- PKI primitives (pure: keys and certificates in memory) ------------------------------------------


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def generate_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def cert_sha256(cert) -> str:
    from cryptography.hazmat.primitives import serialization

    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def make_ca(common_name: str, *, days: int = DEFAULT_CA_DAYS, key=None):
    """A self-signed CA certificate (pathlen 0: it signs leaves only). Returns (key, cert)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = key or generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvpack"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_csr(key, common_name: str):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    return x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])).sign(key, hashes.SHA256())


def _san_entries(names: Iterable[str]):
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # ordered de-duplication
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def issue_leaf(
    ca_key, ca_cert, csr, sans: Iterable[str], *, days: int = DEFAULT_LEAF_DAYS, not_before: _dt.datetime | None = None, not_after: _dt.datetime | None = None
):
    """Sign a node CSR: SANs from the caller (the registry), EKU serverAuth+clientAuth (errata H1)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if not csr.is_signature_valid:
        raise SecurityError("enrollment", "CSR signature is invalid: its holder does not own the key")
    now = _now()
    start = not_before or (now - BACKDATE)
    end = not_after or (now + _dt.timedelta(days=days))
    return (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(ca_cert.subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(_san_entries(sans)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(csr.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


# -- registry ----------------------------------------------------------------------------------------


def key_id_for(producer: str, receiver: str) -> str:
    return f"{producer}-to-{receiver}"


@dataclass
class Cluster:
    """An enrolled cluster directory. Use :meth:`init` or :meth:`open`."""

    root: str
    registry: dict[str, Any]

    # -- paths ------------------------------------------------------------------------------------
    @property
    def ca_dir(self) -> str:
        return os.path.join(self.root, "ca")

    def node_dir(self, name: str) -> str:
        return os.path.join(self.root, "nodes", name)

    # -- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    def init(cls, root: str, *, identity: dict[str, Any] | None = None, rotate: bool = False, ca_days: int = DEFAULT_CA_DAYS) -> "Cluster":
        """Create the cluster CA (or, with ``rotate``, replace it and re-issue every node)."""
        root = os.path.abspath(root)
        registry_path = os.path.join(root, REGISTRY)
        with _EnrollLock(root):
            if os.path.exists(registry_path):
                if not rotate:
                    raise SecurityError("enrollment", f"{root!r} is already an enrolled cluster; use --rotate to replace its CA")
                cluster = cls.open(root)
                if identity is not None:
                    cluster.registry["default_identity"] = identity
                cluster._rotate_ca(ca_days)
                return cluster
            if rotate:
                raise SecurityError("enrollment", f"{root!r} is not an enrolled cluster; nothing to rotate")
            ensure_dir(root)
            cluster = cls(root, {"schema_version": 1, "ca": {}, "default_identity": identity, "nodes": {}, "pairs": []})
            cluster._new_ca(ca_days, generation=1)
            cluster._save()
            return cluster

    @classmethod
    def open(cls, root: str) -> "Cluster":
        root = os.path.abspath(root)
        path = os.path.join(root, REGISTRY)
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            raise SecurityError("enrollment", f"{root!r} is not an enrolled cluster (no {REGISTRY}); run kvpack enroll init first") from None
        registry = strict_json_loads(data, source=path)
        if not isinstance(registry, dict) or registry.get("schema_version") != 1:
            raise SecurityError("enrollment", f"{path}: unsupported registry")
        return cls(root, registry)

    def _save(self) -> None:
        body = json.dumps(self.registry, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write(os.path.join(self.root, REGISTRY), body, mode=0o644)

    # -- CA ------------------------------------------------------------------------------------------
    def _new_ca(self, days: int, *, generation: int) -> None:
        ensure_dir(self.ca_dir, mode=0o700)
        key, cert = make_ca(f"kvpack cluster CA {secrets.token_hex(4)}", days=days)
        atomic_write(os.path.join(self.ca_dir, "ca.key"), key_pem(key), mode=0o600)
        atomic_write(os.path.join(self.ca_dir, "ca.crt"), cert_pem(cert), mode=0o644)
        self.registry["ca"] = {
            "sha256": cert_sha256(cert),
            "subject": cert.subject.rfc4514_string(),
            "not_after": cert.not_valid_after_utc.isoformat(),
            "generation": generation,
        }

    def _load_ca(self):
        from cryptography import x509
        from cryptography.hazmat.primitives.serialization import load_pem_private_key

        key = load_pem_private_key(load_private_key_pem(os.path.join(self.ca_dir, "ca.key")), None)
        with open(os.path.join(self.ca_dir, "ca.crt"), "rb") as fh:
            cert = x509.load_pem_x509_certificate(fh.read())
        return key, cert

    def _rotate_ca(self, days: int) -> None:
        # Record the epoch bump first: a crash after this point skips epochs, never reuses one.
        for pair in self.registry["pairs"]:
            pair["epoch"] += 1
        self._save()
        self._new_ca(days, generation=self.registry["ca"].get("generation", 0) + 1)
        for name in sorted(self.registry["nodes"]):
            self._issue_node(name)
        for pair in self.registry["pairs"]:
            self._write_pair_key(pair)
        self._save()
        self._write_all_configs()

    # -- nodes ----------------------------------------------------------------------------------------
    def enroll_node(
        self,
        name: str,
        role: str | None,
        *,
        rotate: bool = False,
        listen: str | None = None,
        control_listen: str | None = None,
        identity: dict[str, Any] | None = None,
        extra_sans: Iterable[str] = (),
        days: int = DEFAULT_LEAF_DAYS,
    ) -> dict[str, Any]:
        with _EnrollLock(self.root):
            nodes = self.registry["nodes"]
            if not NAME_RE.match(name or ""):
                raise SecurityError("enrollment", f"node name {name!r} must be 1..60 of [a-z0-9-], starting and ending alphanumeric (it is a DNS SAN)")
            if rotate:
                if name not in nodes:
                    raise SecurityError("enrollment", f"node {name!r} is not enrolled; nothing to rotate")
                if role is not None and role != nodes[name]["role"]:
                    raise SecurityError("enrollment", f"node {name!r} is a {nodes[name]['role']}; rotation keeps the role")
                return self._rotate_node(name, days)
            if name in nodes:
                raise SecurityError("enrollment", f"node {name!r} is already enrolled; use --rotate to re-key it")
            if role not in ROLES:
                raise SecurityError("enrollment", f"role must be one of {ROLES}, got {role!r}")
            entry: dict[str, Any] = {"role": role, "pki_generation": 0, "days": days, "sans": list(dict.fromkeys([name, *LOOPBACK_SANS, *extra_sans]))}
            if role == "receiver":
                entry["listen"] = listen or DEFAULT_RECEIVER_LISTEN
                ident = identity or self.registry.get("default_identity")
                if ident is None:
                    raise SecurityError(
                        "enrollment", f"receiver {name!r} needs the model identity it will admit: pass --identity FILE here or to 'enroll init'"
                    )
                entry["identity"] = ident
            elif role == "producer":
                entry["control_listen"] = control_listen or DEFAULT_CONTROL_LISTEN
            nodes[name] = entry
            self._issue_node(name)
            counterpart = {"receiver": "producer", "producer": "receiver"}.get(role)
            if counterpart:
                for other in sorted(n for n, e in nodes.items() if e["role"] == counterpart):
                    producer, receiver = (name, other) if role == "producer" else (other, name)
                    pair = {"producer": producer, "receiver": receiver, "key_id": key_id_for(producer, receiver), "epoch": 1}
                    self.registry["pairs"].append(pair)
                    self._write_pair_key(pair)
            self._save()
            self._write_all_configs()
            return nodes[name]

    def _rotate_node(self, name: str, days: int) -> dict[str, Any]:
        affected = [p for p in self.registry["pairs"] if name in (p["producer"], p["receiver"])]
        for pair in affected:
            pair["epoch"] += 1
        self.registry["nodes"][name]["days"] = days
        self._save()  # epochs first (see module docstring)
        self._issue_node(name)
        for pair in affected:
            self._write_pair_key(pair)
        self._save()
        self._write_all_configs()
        return self.registry["nodes"][name]

    def _issue_node(self, name: str) -> None:
        """Generate the node key *in the node's directory*, send only the CSR to the CA."""
        from cryptography import x509

        entry = self.registry["nodes"][name]
        node = self.node_dir(name)
        ensure_dir(node, mode=0o700)
        for sub in ("tls", "hmac", "state"):
            ensure_dir(os.path.join(node, sub), mode=0o700)
        # --- on the node ---
        key = generate_key()
        atomic_write(os.path.join(node, "tls", "node.key"), key_pem(key), mode=0o600)
        csr_pem = make_csr(key, name).public_bytes(_pem())
        atomic_write(os.path.join(node, "tls", "node.csr"), csr_pem, mode=0o644)
        del key
        # --- at the CA: only the CSR crosses over ---
        ca_key, ca_cert = self._load_ca()
        csr = x509.load_pem_x509_csr(csr_pem)
        cert = issue_leaf(ca_key, ca_cert, csr, entry["sans"], days=entry.get("days", DEFAULT_LEAF_DAYS))
        # --- back to the node: public material only ---
        atomic_write(os.path.join(node, "tls", "node.crt"), cert_pem(cert), mode=0o644)
        atomic_write(os.path.join(node, "tls", "ca.crt"), cert_pem(ca_cert), mode=0o644)
        entry["leaf_sha256"] = cert_sha256(cert)
        entry["not_after"] = cert.not_valid_after_utc.isoformat()
        entry["pki_generation"] = entry.get("pki_generation", 0) + 1

    def _write_pair_key(self, pair: dict[str, Any]) -> None:
        """Fresh 32-byte key material for this pair's current epoch, on both ends (0600)."""
        material = (secrets.token_bytes(32).hex() + "\n").encode()
        for node in (pair["producer"], pair["receiver"]):
            path = os.path.join(self.node_dir(node), "hmac", f"{pair['key_id']}.key")
            atomic_write(path, material, mode=0o600)

    # -- configs -----------------------------------------------------------------------------------------
    def _write_all_configs(self) -> None:
        nodes = self.registry["nodes"]
        for pair in self.registry["pairs"]:
            self._write_receiver_config(pair)
        for name, entry in nodes.items():
            if entry["role"] == "producer":
                self._write_producer_config(name)

    def receiver_config_path(self, receiver: str, producer: str) -> str:
        return os.path.join(self.node_dir(receiver), f"receiver.{producer}.json")

    def producer_config_path(self, producer: str) -> str:
        return os.path.join(self.node_dir(producer), "producer.json")

    def _write_receiver_config(self, pair: dict[str, Any]) -> None:
        nodes = self.registry["nodes"]
        r, p = pair["receiver"], pair["producer"]
        rentry, pentry = nodes[r], nodes[p]
        ident = rentry["identity"]
        listen = rentry["listen"]
        advertised = listen.rsplit(":", 1)[0].strip("[]")
        cfg: dict[str, Any] = {
            "schema_version": 1,
            "listen": listen,
            # Relative to this file: the node directory can be moved as a unit.
            "certificate_chain": "tls/node.crt",
            "private_key": "tls/node.key",
            "peer_ca": "tls/ca.crt",
            "peer_leaf_sha256": [pentry["leaf_sha256"]],
            "hmac_key_file": f"hmac/{pair['key_id']}.key",
            "hmac_key_id": pair["key_id"],
            # The floor follows the epoch: after a rotation, seals of older epochs are refused.
            "minimum_hmac_epoch": pair["epoch"],
            # Stable across rotations: the ledger is never reset, epochs give fresh counters.
            "replay_ledger": f"state/replay-ledger.{p}.json",
            "timeout_ms": 900_000,
            "wait_for_producer_ms": 60_000,
            "advertised_receiver_host": advertised,
            "producer_control": {"address": pentry["control_listen"], "server_name": p},
            "identity": ident["identity"],
            "target_cache_identity_sha256": ident["target_cache_identity_sha256"],
        }
        for opt in ("producer_mode", "dflash_identity_sha256", "dflash_context_geometry"):
            if ident.get(opt) is not None:
                cfg[opt] = ident[opt]
        body = json.dumps(cfg, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write(self.receiver_config_path(r, p), body, mode=0o600)

    def _write_producer_config(self, name: str) -> None:
        nodes = self.registry["nodes"]
        receivers = []
        for pair in sorted(self.registry["pairs"], key=lambda x: x["receiver"]):
            if pair["producer"] != name:
                continue
            r = pair["receiver"]
            receivers.append(
                {
                    "name": r,
                    "server_name": r,
                    "leaf_sha256": [nodes[r]["leaf_sha256"]],
                    "hmac_key_file": f"hmac/{pair['key_id']}.key",
                    "hmac_key_id": pair["key_id"],
                    "hmac_epoch": pair["epoch"],
                }
            )
        path = self.producer_config_path(name)
        if not receivers:
            return  # nothing to hand off to yet; written when the first receiver enrolls
        cfg = {
            "schema_version": 1,
            "node_name": name,
            "certificate_chain": "tls/node.crt",
            "private_key": "tls/node.key",
            "peer_ca": "tls/ca.crt",
            "control_listen": nodes[name]["control_listen"],
            "generation_ledger": "state/generation-ledger.json",
            "receivers": receivers,
        }
        atomic_write(path, json.dumps(cfg, indent=2, sort_keys=True).encode() + b"\n", mode=0o600)

    # -- storage nodes: SSH pin (session migration, docs/migration.md) -----------------------------------
    def set_storage_ssh(self, name: str, *, address: str, user: str, host_key: str, lane_dir: str) -> dict[str, Any]:
        """Record how a storage node is reached over OpenSSH: address, user, the exact host key
        (pinned: the only key ssh will accept for it) with its SHA256 fingerprint, and the lane
        directory. Public material only; the registry stays secret-free."""
        import base64

        with _EnrollLock(self.root):
            entry = self.registry["nodes"].get(name)
            if entry is None or entry["role"] != "storage":
                raise SecurityError("enrollment", f"node {name!r} is not an enrolled storage node")
            parts = host_key.strip().split()
            if (
                len(parts) < 2
                or not re.fullmatch(r"(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa)", parts[0])
                or not re.fullmatch(r"[A-Za-z0-9+/]+={0,3}", parts[1])
            ):
                raise SecurityError("enrollment", "host key must be an OpenSSH public key line")
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise SecurityError("enrollment", f"address {address!r} must be HOST:PORT")
            if not user or not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
                raise SecurityError("enrollment", f"user {user!r} is not a valid login name")
            if not os.path.isabs(lane_dir) or "\n" in lane_dir:
                raise SecurityError("enrollment", "lane dir must be an absolute path")
            fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(base64.b64decode(parts[1])).digest()).decode().rstrip("=")
            entry["ssh"] = {"address": address, "user": user, "host_key": f"{parts[0]} {parts[1]}", "host_key_sha256": fingerprint, "lane_dir": lane_dir}
            self._save()
            return entry

    # -- reporting -----------------------------------------------------------------------------------------
    def show(self) -> dict[str, Any]:
        nodes = []
        for name, entry in sorted(self.registry["nodes"].items()):
            nodes.append(
                {
                    "name": name,
                    "role": entry["role"],
                    "leaf_sha256": entry["leaf_sha256"],
                    "not_after": entry["not_after"],
                    "pki_generation": entry["pki_generation"],
                    "sans": entry["sans"],
                    "dir": os.path.relpath(self.node_dir(name), self.root),
                }
            )
        pairs = [{"producer": p["producer"], "receiver": p["receiver"], "key_id": p["key_id"], "epoch": p["epoch"]} for p in self.registry["pairs"]]
        return {"cluster": self.root, "ca": self.registry["ca"], "nodes": nodes, "pairs": pairs}


def _pem():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM


def load_identity_file(path: str) -> dict[str, Any]:
    """An identity file: ``{"identity": ExactIdentityV1, "target_cache_identity_sha256": hex, ...}``.

    Optional: ``producer_mode``, ``dflash_identity_sha256`` with ``dflash_context_geometry``.
    Validated with the same rules as the receiver config, so enrollment never writes a config the
    receiver would refuse.
    """
    try:
        with open(path, "rb") as fh:
            obj = strict_json_loads(fh.read(), source=path)
    except OSError as exc:
        raise SecurityError("enrollment", f"cannot read identity file {path!r}: {exc.strerror}") from None
    allowed = {"identity", "target_cache_identity_sha256", "producer_mode", "dflash_identity_sha256", "dflash_context_geometry"}
    if not isinstance(obj, dict) or not {"identity", "target_cache_identity_sha256"} <= set(obj) or set(obj) - allowed:
        raise SecurityError("enrollment", f"identity file {path!r} must hold identity and target_cache_identity_sha256 (optional: {sorted(allowed)})")
    parse_identity(obj["identity"], f"{path}.identity")
    for name in ("target_cache_identity_sha256", "dflash_identity_sha256"):
        value = obj.get(name)
        if name in obj and not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value)):
            raise SecurityError("enrollment", f"identity file {path!r}: {name} must be 64 lowercase hex")
    return obj


class _EnrollLock:
    """Serialise enrollment runs on one cluster directory (two would clobber the registry)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fd = -1

    _held: dict[str, int] = {}

    def __enter__(self) -> "_EnrollLock":
        if _EnrollLock._held.get(self.root):
            _EnrollLock._held[self.root] += 1  # re-entrant within one call chain
            return self
        ensure_dir(self.root)
        self.fd = os.open(os.path.join(self.root, ".enroll.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise SecurityError("locked", f"another enrollment is running on {self.root!r}") from None
        _EnrollLock._held[self.root] = 1
        return self

    def __exit__(self, *exc: object) -> None:
        _EnrollLock._held[self.root] -= 1
        if _EnrollLock._held[self.root] == 0:
            del _EnrollLock._held[self.root]
            if self.fd >= 0:
                os.close(self.fd)
