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

Nodes onboarded over SSH (``kvpack node add``, :mod:`kvpack.onboard`) are *remote*: their
registry entry carries ``remote`` (user, host, port, pinned host key, node directory) and
nothing of theirs lives under ``nodes/``. The CA signs their CSR through
:meth:`Cluster.sign_node_csr` (key type, subject and SANs checked first) and they join the
registry only when qualified (:meth:`Cluster.commit_onboarded`). Offline enrollment never
writes a file for a remote node: it pairs new offline nodes with offline nodes only, and
refuses to rotate anything a remote node would have to follow (the wizard owns that path).
Removed pairs leave their last epoch in ``retired_epochs``, so a pair that comes back starts a
disjoint counter space too.
"""

from __future__ import annotations

import datetime as _dt
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
from ..vocab import FileLock, is_hex64, sha256_hex
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

    return sha256_hex(cert.public_bytes(serialization.Encoding.DER))


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


def make_csr(key, common_name: str, sans: Iterable[str] = ()):
    """A CSR for ``CN=common_name``, requesting ``sans`` when given (the SSH wizard checks them)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    builder = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
    names = list(sans)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_san_entries(names)), critical=False)
    return builder.sign(key, hashes.SHA256())


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
        remote = sorted(n for n, e in self.registry["nodes"].items() if is_remote(e))
        if remote:
            raise SecurityError(
                "enrollment",
                f"cannot rotate the CA offline: nodes {remote} were onboarded over SSH and hold their own keys "
                "(remove them with 'kvpack node remove', rotate, then add them again)",
            )
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
            if not NAME_RE.fullmatch(name or ""):
                raise SecurityError("enrollment", f"node name {name!r} must be 1..60 of [a-z0-9-], starting and ending alphanumeric (it is a DNS SAN)")
            if rotate:
                if name not in nodes:
                    raise SecurityError("enrollment", f"node {name!r} is not enrolled; nothing to rotate")
                if role is not None and role != nodes[name]["role"]:
                    raise SecurityError("enrollment", f"node {name!r} is a {nodes[name]['role']}; rotation keeps the role")
                self._refuse_offline_rotation(name)
                return self._rotate_node(name, days)
            if name in nodes:
                raise SecurityError("enrollment", f"node {name!r} is already enrolled; use --rotate to re-key it")
            if role not in ROLES:
                raise SecurityError("enrollment", f"role must be one of {ROLES}, got {role!r}")
            entry: dict[str, Any] = {"role": role, "pki_generation": 0, "days": days, "sans": node_sans(name, extra_sans)}
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
            counterpart = COUNTERPART.get(role)
            if counterpart:
                # Offline enrollment pairs offline nodes only: a remote node's key file and
                # configs live on its machine, which only the SSH wizard reaches.
                for other in sorted(n for n, e in nodes.items() if e["role"] == counterpart and not is_remote(e)):
                    producer, receiver = (name, other) if role == "producer" else (other, name)
                    pair = {
                        "producer": producer,
                        "receiver": receiver,
                        "key_id": key_id_for(producer, receiver),
                        "epoch": self.next_pair_epoch(producer, receiver),
                    }
                    self.registry["pairs"].append(pair)
                    self._write_pair_key(pair)
            self._save()
            self._write_all_configs()
            return nodes[name]

    def _refuse_offline_rotation(self, name: str) -> None:
        """Offline rotation rewrites keys and configs on both ends of every pair of ``name``;
        it cannot reach a remote node, so it refuses rather than leave one end behind."""
        nodes = self.registry["nodes"]
        if is_remote(nodes[name]):
            raise SecurityError("enrollment", f"node {name!r} was onboarded over SSH: its key lives on the node (remove it and 'kvpack node add' it again)")
        remote_peers = sorted(
            {p["producer"] if p["receiver"] == name else p["receiver"] for p in self.registry["pairs"] if name in (p["producer"], p["receiver"])}
            & {n for n, e in nodes.items() if is_remote(e)}
        )
        if remote_peers:
            raise SecurityError("enrollment", f"node {name!r} is paired with SSH-onboarded nodes {remote_peers}; offline rotation cannot re-key their ends")

    def next_pair_epoch(self, producer: str, receiver: str) -> int:
        """1 for a pair never seen before; one past its last epoch for a pair that was removed
        (the receiver's ledger may still hold that pair's counters: never reuse them)."""
        return int(self.registry.get("retired_epochs", {}).get(key_id_for(producer, receiver), 0)) + 1

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
            if is_remote(self.registry["nodes"][node]):
                raise SecurityError("enrollment", f"refusing to write a key for SSH-onboarded node {node!r} on the admin machine")
            path = os.path.join(self.node_dir(node), "hmac", f"{pair['key_id']}.key")
            atomic_write(path, material, mode=0o600)

    # -- configs -----------------------------------------------------------------------------------------
    def _write_all_configs(self) -> None:
        """(Re)write every config of every *offline* node from the registry (remote nodes'
        configs are pushed by the SSH wizard, never written here)."""
        nodes = self.registry["nodes"]
        for pair in self.registry["pairs"]:
            if not is_remote(nodes[pair["receiver"]]):
                self._write_receiver_config(pair)
        for name, entry in nodes.items():
            if entry["role"] == "producer" and not is_remote(entry):
                self._write_producer_config(name)

    def receiver_config_path(self, receiver: str, producer: str) -> str:
        return os.path.join(self.node_dir(receiver), f"receiver.{producer}.json")

    def producer_config_path(self, producer: str) -> str:
        return os.path.join(self.node_dir(producer), "producer.json")

    def _write_receiver_config(self, pair: dict[str, Any]) -> None:
        cfg = receiver_config_json(self.registry["nodes"], pair)
        body = json.dumps(cfg, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write(self.receiver_config_path(pair["receiver"], pair["producer"]), body, mode=0o600)

    def _write_producer_config(self, name: str) -> None:
        cfg = producer_config_json(self.registry["nodes"], self.registry["pairs"], name)
        if cfg is None:
            return  # nothing to hand off to yet; written when the first receiver enrolls
        atomic_write(self.producer_config_path(name), json.dumps(cfg, indent=2, sort_keys=True).encode() + b"\n", mode=0o600)

    # -- SSH onboarding (kvpack.onboard): CSR signing, commit, removal ----------------------------------
    def sign_node_csr(self, name: str, csr_pem: bytes, sans: Iterable[str], *, days: int = DEFAULT_LEAF_DAYS):
        """Check a CSR produced on the node and sign it. Returns ``(cert, ca_cert)``.

        The checks come first and each refusal names what was wrong: the CSR must parse, its
        signature must verify (its holder owns the key), the key must be ECDSA P-256, the
        subject exactly ``CN=<name>``, and the requested SANs exactly ``sans``. The leaf's
        SANs are then taken from ``sans`` (the admin's record), never from the CSR.
        """
        from cryptography import x509

        check_node_csr(csr_pem, name, sans)
        csr = x509.load_pem_x509_csr(csr_pem)
        ca_key, ca_cert = self._load_ca()
        return issue_leaf(ca_key, ca_cert, csr, sans, days=days), ca_cert

    def ca_certificate_pem(self) -> bytes:
        with open(os.path.join(self.ca_dir, "ca.crt"), "rb") as fh:
            return fh.read()

    def commit_onboarded(self, name: str, entry: dict[str, Any], pairs: list[dict[str, Any]]) -> None:
        """Make a qualified remote node trusted: its entry and pairs enter the registry, and the
        configs of offline peers are rewritten from it. Idempotent (a re-run after a crash
        between this and the healthy record finds the same entry)."""
        with _EnrollLock(self.root):
            self.registry = Cluster.open(self.root).registry  # another run may have saved since
            nodes = self.registry["nodes"]
            if name in nodes and nodes[name] != entry:
                raise SecurityError("enrollment", f"node {name!r} is already enrolled with another record")
            nodes[name] = entry
            keep = [p for p in self.registry["pairs"] if p["key_id"] not in {q["key_id"] for q in pairs}]
            self.registry["pairs"] = keep + [dict(p) for p in pairs]
            self._save()
            self._write_all_configs()

    def remove_node(self, name: str, *, also_retire: Iterable[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """Drop ``name`` and its pairs from the registry; remember each pair's last epoch in
        ``retired_epochs`` (also for ``also_retire``: pairs provisioned but never committed).
        Offline peers' configs are rewritten and their files for the removed pairs deleted.
        Returns the removed pairs."""
        with _EnrollLock(self.root):
            self.registry = Cluster.open(self.root).registry
            removed = [p for p in self.registry["pairs"] if name in (p["producer"], p["receiver"])]
            retired = self.registry.setdefault("retired_epochs", {})
            for pair in [*removed, *also_retire]:
                retired[pair["key_id"]] = max(int(retired.get(pair["key_id"], 0)), int(pair["epoch"]))
            self.registry["pairs"] = [p for p in self.registry["pairs"] if p not in removed]
            self.registry["nodes"].pop(name, None)
            self._save()
            self._write_all_configs()
            self.delete_offline_pair_files([*removed, *also_retire])
            return removed

    def delete_offline_pair_files(self, pairs: Iterable[dict[str, Any]]) -> None:
        """Delete the key files and receiver configs of pairs that are no longer in the
        registry, on the offline nodes that held them (nothing remote is touched)."""
        from ..durable import durable_unlink

        nodes = self.registry["nodes"]
        live = {p["key_id"] for p in self.registry["pairs"]}
        for pair in pairs:
            if pair["key_id"] in live:
                continue
            for node in (pair["producer"], pair["receiver"]):
                entry = nodes.get(node)
                if entry is None or is_remote(entry):
                    continue
                durable_unlink(os.path.join(self.node_dir(node), "hmac", f"{pair['key_id']}.key"))
                if node == pair["receiver"]:
                    durable_unlink(self.receiver_config_path(node, pair["producer"]))
            producer = nodes.get(pair["producer"])
            if producer is not None and not is_remote(producer) and producer_config_json(nodes, self.registry["pairs"], pair["producer"]) is None:
                durable_unlink(self.producer_config_path(pair["producer"]))

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
                    "dir": None if is_remote(entry) else os.path.relpath(self.node_dir(name), self.root),
                    "remote": _remote_summary(entry),
                }
            )
        pairs = [{"producer": p["producer"], "receiver": p["receiver"], "key_id": p["key_id"], "epoch": p["epoch"]} for p in self.registry["pairs"]]
        return {"cluster": self.root, "ca": self.registry["ca"], "nodes": nodes, "pairs": pairs}


COUNTERPART = {"receiver": "producer", "producer": "receiver"}


def is_remote(entry: dict[str, Any]) -> bool:
    """True for a node onboarded over SSH: its files live on its machine, not under nodes/."""
    return isinstance(entry.get("remote"), dict)


def _remote_summary(entry: dict[str, Any]) -> str | None:
    r = entry.get("remote")
    return None if not isinstance(r, dict) else f"{r['user']}@{r['host']}:{r['port']}"


def node_sans(name: str, extra: Iterable[str] = ()) -> list[str]:
    """The SANs every leaf carries: its node name, the loopback names, then any extras."""
    return list(dict.fromkeys([name, *LOOPBACK_SANS, *extra]))


def receiver_config_json(nodes: dict[str, Any], pair: dict[str, Any]) -> dict[str, Any]:
    """The C.15 config of ``pair``'s receiver for its producer, from registry entries (pure).

    Every path is relative to the config file, so a node directory moves as a unit and the
    same object is valid on an offline node and on an SSH-onboarded one."""
    r, p = pair["receiver"], pair["producer"]
    rentry, pentry = nodes[r], nodes[p]
    ident = rentry["identity"]
    listen = rentry["listen"]
    advertised = listen.rsplit(":", 1)[0].strip("[]")
    cfg: dict[str, Any] = {
        "schema_version": 1,
        "listen": listen,
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
    return cfg


def producer_config_json(nodes: dict[str, Any], pairs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """The producer config of ``name`` (all its paired receivers), or None with no receiver."""
    receivers = []
    for pair in sorted(pairs, key=lambda x: x["receiver"]):
        if pair["producer"] != name:
            continue
        r = pair["receiver"]
        entry: dict[str, Any] = {
            "name": r,
            "server_name": r,
            "leaf_sha256": [nodes[r]["leaf_sha256"]],
            "hmac_key_file": f"hmac/{pair['key_id']}.key",
            "hmac_key_id": pair["key_id"],
            "hmac_epoch": pair["epoch"],
        }
        ident = nodes[r].get("identity")
        if ident:  # what this receiver admits: the producer refuses to start with another engine
            entry["identity"] = ident["identity"]
            entry["target_cache_identity_sha256"] = ident["target_cache_identity_sha256"]
        receivers.append(entry)
    if not receivers:
        return None
    return {
        "schema_version": 1,
        "node_name": name,
        "certificate_chain": "tls/node.crt",
        "private_key": "tls/node.key",
        "peer_ca": "tls/ca.crt",
        "control_listen": nodes[name]["control_listen"],
        "generation_ledger": "state/generation-ledger.json",
        "receivers": receivers,
    }


def check_node_csr(csr_pem: bytes, name: str, sans: Iterable[str]) -> None:
    """Refuse a node CSR unless it is exactly what the node was asked to produce."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if not isinstance(csr_pem, bytes) or len(csr_pem) > 16384 or b"-----BEGIN CERTIFICATE REQUEST-----" not in csr_pem:
        raise SecurityError("enrollment", "CSR must be one PEM certificate request (at most 16 KiB)")
    from cryptography.exceptions import UnsupportedAlgorithm

    # cryptography parses lazily: a damaged request can surface at load (bad version: not a
    # ValueError), at the key (unknown curve, bad point), at the signature or at the subject
    unparsable = (ValueError, TypeError, KeyError, UnsupportedAlgorithm, x509.InvalidVersion)
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
        key = csr.public_key()
        valid = csr.is_signature_valid
        subject = csr.subject
    except unparsable as exc:
        raise SecurityError("enrollment", f"CSR does not parse: {type(exc).__name__}: {exc}") from None
    if not valid:
        raise SecurityError("enrollment", "CSR signature is invalid: its holder does not own the key")
    if not _signature_is_whole_octets(csr.public_bytes(_der())):
        # cryptography verifies the signature's bytes and ignores the BIT STRING's unused-bit
        # count, so without this one request would have many accepted encodings
        raise SecurityError("enrollment", "CSR signature BIT STRING declares unused bits: not DER")
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise SecurityError("enrollment", f"CSR key must be ECDSA P-256, got {type(key).__name__} {getattr(getattr(key, 'curve', None), 'name', '')}".rstrip())
    want_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    if subject != want_subject:
        raise SecurityError("enrollment", f"CSR subject must be exactly CN={name}, got {subject.rfc4514_string()}")
    try:
        extensions = csr.extensions
        requested = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise SecurityError("enrollment", "CSR requests no subjectAltName") from None
    except unparsable as exc:  # duplicate or malformed extensions
        raise SecurityError("enrollment", f"CSR extensions do not parse: {exc}") from None
    got = {str(v) for v in requested.get_values_for_type(x509.DNSName)} | {str(v) for v in requested.get_values_for_type(x509.IPAddress)}
    want = {str(ipaddress.ip_address(n)) if _is_ip(n) else n for n in sans}
    if got != want or len(list(requested)) != len(got):
        raise SecurityError("enrollment", f"CSR requests SANs {sorted(got)}, expected exactly {sorted(want)}")
    other = [e.oid.dotted_string for e in extensions if not isinstance(e.value, x509.SubjectAlternativeName)]
    if other:
        raise SecurityError("enrollment", f"CSR requests extensions the CA does not grant: {other}")


def _der_element(der: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of contents, end of contents) of the DER element at ``at``; ValueError if cut."""
    if at + 2 > len(der):
        raise ValueError("truncated DER header")
    tag, first = der[at], der[at + 1]
    at += 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if count == 0 or count > 4 or at + count > len(der):
            raise ValueError("bad DER length")
        length = int.from_bytes(der[at : at + count], "big")
        at += count
    if at + length > len(der):
        raise ValueError("DER element runs past its container")
    return tag, at, at + length


def _signature_is_whole_octets(der: bytes) -> bool:
    """A CSR is SEQUENCE {info, algorithm, BIT STRING signature}: the signature must be all of
    the rest and declare zero unused bits."""
    try:
        tag, start, end = _der_element(der, 0)
        if tag != 0x30 or end != len(der):
            return False
        _, _, after_info = _der_element(der, start)
        _, _, after_algorithm = _der_element(der, after_info)
        tag, bits_start, bits_end = _der_element(der, after_algorithm)
    except ValueError:
        return False
    return tag == 0x03 and bits_end == end and bits_end > bits_start and der[bits_start] == 0


def _der():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.DER


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _pem():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM


def load_identity_file(path: str) -> dict[str, Any]:
    """An identity file: ``{"identity": ExactIdentityV1, "target_cache_identity_sha256": hex, ...}``.

    Optional: ``producer_mode``, ``dflash_identity_sha256`` with ``dflash_context_geometry``, and
    ``qualification`` (the identity's onboarding recipe, :mod:`kvpack.onboard.recipe`).
    Validated with the same rules as the receiver config, so enrollment never writes a config the
    receiver would refuse.
    """
    try:
        with open(path, "rb") as fh:
            obj = strict_json_loads(fh.read(), source=path)
    except OSError as exc:
        raise SecurityError("enrollment", f"cannot read identity file {path!r}: {exc.strerror}") from None
    allowed = {"identity", "target_cache_identity_sha256", "producer_mode", "dflash_identity_sha256", "dflash_context_geometry", "qualification"}
    if not isinstance(obj, dict) or not {"identity", "target_cache_identity_sha256"} <= set(obj) or set(obj) - allowed:
        raise SecurityError("enrollment", f"identity file {path!r} must hold identity and target_cache_identity_sha256 (optional: {sorted(allowed)})")
    parse_identity(obj["identity"], f"{path}.identity")
    if "qualification" in obj:
        from ..errors import OnboardError
        from ..onboard.recipe import parse_recipe

        try:
            parse_recipe(obj["qualification"], f"{path}.qualification")
        except OnboardError as exc:
            raise SecurityError("enrollment", exc.message) from None
    for name in ("target_cache_identity_sha256", "dflash_identity_sha256"):
        value = obj.get(name)
        if name in obj and not is_hex64(value):
            raise SecurityError("enrollment", f"identity file {path!r}: {name} must be 64 lowercase hex")
    return obj


class _EnrollLock:
    """Serialise enrollment runs on one cluster directory (two would clobber the registry)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = FileLock(os.path.join(root, ".enroll.lock"))

    _held: dict[str, int] = {}

    def __enter__(self) -> "_EnrollLock":
        if _EnrollLock._held.get(self.root):
            _EnrollLock._held[self.root] += 1  # re-entrant within one call chain
            return self
        ensure_dir(self.root)
        try:
            self._lock.acquire()
        except OSError:
            raise SecurityError("locked", f"another enrollment is running on {self.root!r}") from None
        _EnrollLock._held[self.root] = 1
        return self

    def __exit__(self, *exc: object) -> None:
        _EnrollLock._held[self.root] -= 1
        if _EnrollLock._held[self.root] == 0:
            del _EnrollLock._held[self.root]
            self._lock.release()
