"""What ``kvpack node-local`` does on the node being onboarded (run over SSH by the wizard).

Layout of a node directory ``D`` (0700), the same as an offline node's::

    D/staging/v<N>/node.key (0600)   the TLS key, generated here and never printed or sent
    D/staging/v<N>/node.csr          its CSR (the only thing about the key that leaves)
    D/tls/node.key                   a hard link to the staged key (one key, one inode)
    D/tls/node.crt  D/tls/ca.crt     installed from the admin's signature
    D/tls/pins.json                  the installed leaf and CA pins, for ``status``
    D/hmac/<key_id>.key (0600)       pair keys, provisioned over the SSH leg
    D/producer.json | D/receiver.<producer>.json   configs (secrets by path)
    D/state/                         ledgers (the probed volume)
    D/run/                           managed daemons (:mod:`.units`)

Every step is idempotent: keygen reuses the staged key of its version, install re-checks
and re-links, secrets and configs are atomic replacements. Every input from the admin is
checked before anything is written: names against fixed patterns, the certificate against
the staged key and the CA, configs by loading them exactly as the daemon will.

This module must never print, log or return private-key bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from ..durable import atomic_write, durable_unlink, ensure_dir, sync_dir
from ..errors import KvpackError, OnboardError
from ..security.enroll import NAME_RE

KEY_ID_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,126}[a-z0-9])?$")
CONFIG_RE = re.compile(r"^(producer|receiver\.[a-z0-9](?:[a-z0-9-]{0,58}[a-z0-9])?)\.json$")
MAX_INPUT_BYTES = 1 << 20
MAX_KEY_VERSION = 1000


def node_dir(path: str) -> str:
    """The absolute node directory (a relative one is relative to the login's home)."""
    if not path or "\n" in path or "\0" in path:
        raise OnboardError("usage", "node directory must be a non-empty path")
    return os.path.abspath(os.path.expanduser(path))


def _version_dir(d: str, version: int) -> str:
    if not 1 <= version <= MAX_KEY_VERSION:
        raise OnboardError("usage", f"key version must be 1..{MAX_KEY_VERSION}")
    return os.path.join(d, "staging", f"v{version}")


def _public_sha256(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def _load_staged_key(path: str):
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from ..security.secret_files import load_private_key_pem

    return load_pem_private_key(load_private_key_pem(path), None)


# -- preflight --------------------------------------------------------------------------------------


def preflight(directory: str) -> dict[str, Any]:
    """Create the node directory and its state volume; report the kvpack version (the engine
    identity comes from ``kvpack identity`` on the node)."""
    import platform

    import kvpack

    d = node_dir(directory)
    ensure_dir(d, mode=0o700)
    os.chmod(d, 0o700)
    ensure_dir(os.path.join(d, "state"), mode=0o700)
    report: dict[str, Any] = {
        "kvpack_version": kvpack.__version__,
        "python": platform.python_version(),
        "uid": os.getuid(),
        "dir": d,
    }
    return report


# -- keygen and install -----------------------------------------------------------------------------


def keygen(directory: str, name: str, version: int, sans: list[str]) -> dict[str, Any]:
    """Generate (or reuse) the key of ``version`` in its 0700 staging directory; return the CSR."""
    from ..security.enroll import generate_key, key_pem, make_csr

    if not NAME_RE.fullmatch(name or ""):
        raise OnboardError("usage", f"node name {name!r} is not a valid node name")
    d = node_dir(directory)
    vdir = _version_dir(d, version)
    for path in (d, os.path.join(d, "staging"), vdir):
        ensure_dir(path, mode=0o700)
        os.chmod(path, 0o700)
    key_path = os.path.join(vdir, "node.key")
    created = not os.path.exists(key_path)
    if created:
        atomic_write(key_path, key_pem(generate_key()), mode=0o600)
    key = _load_staged_key(key_path)
    csr_pem = make_csr(key, name, sans).public_bytes(_pem())
    atomic_write(os.path.join(vdir, "node.csr"), csr_pem, mode=0o644)
    return {
        "version": version,
        "created": created,
        "csr_pem": csr_pem.decode(),
        "public_key_sha256": _public_sha256(key.public_key()),
        "staged_versions": staged_versions(d),
    }


def staged_versions(d: str) -> list[int]:
    staging = os.path.join(d, "staging")
    out = []
    if os.path.isdir(staging):
        for entry in os.listdir(staging):
            if re.fullmatch(r"v[0-9]{1,4}", entry) and os.path.exists(os.path.join(staging, entry, "node.key")):
                out.append(int(entry[1:]))
    return sorted(out)


def install(directory: str, version: int, bundle: dict[str, Any]) -> dict[str, Any]:
    """Install the signed certificate and the CA after checking them against the staged key;
    the staged key becomes ``tls/node.key`` by a hard link (the key is never copied)."""
    from cryptography import x509

    from ..security.enroll import cert_sha256

    d = node_dir(directory)
    key_path = os.path.join(_version_dir(d, version), "node.key")
    if not os.path.exists(key_path):
        raise OnboardError("install", f"no staged key of version {version}: run keygen first")
    if not isinstance(bundle, dict) or set(bundle) != {"certificate_pem", "ca_pem"}:
        raise OnboardError("install", "install bundle must hold exactly certificate_pem and ca_pem")
    try:
        cert = x509.load_pem_x509_certificate(str(bundle["certificate_pem"]).encode())
        ca = x509.load_pem_x509_certificate(str(bundle["ca_pem"]).encode())
    except ValueError as exc:
        raise OnboardError("install", f"certificate does not parse: {exc}") from None
    key = _load_staged_key(key_path)
    if _public_sha256(cert.public_key()) != _public_sha256(key.public_key()):
        raise OnboardError("install", "the certificate is not for this node's staged key")
    from cryptography.exceptions import InvalidSignature

    try:
        is_ca = ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise OnboardError("install", "the CA certificate is not a CA")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise OnboardError("install", f"the certificate is not issued by the CA it came with: {type(exc).__name__}: {exc}") from None
    tls = os.path.join(d, "tls")
    ensure_dir(tls, mode=0o700)
    atomic_write(os.path.join(tls, "ca.crt"), str(bundle["ca_pem"]).encode(), mode=0o644)
    atomic_write(os.path.join(tls, "node.crt"), str(bundle["certificate_pem"]).encode(), mode=0o644)
    _link_key(key_path, os.path.join(tls, "node.key"))
    pins = {"leaf_sha256": cert_sha256(cert), "ca_sha256": cert_sha256(ca), "key_version": version, "not_after": cert.not_valid_after_utc.isoformat()}
    atomic_write(os.path.join(tls, "pins.json"), json.dumps(pins, indent=2, sort_keys=True).encode() + b"\n", mode=0o644)
    return pins


def _link_key(staged: str, live: str) -> None:
    if os.path.exists(live) and os.path.samefile(staged, live):
        return
    tmp = f"{live}.{os.getpid()}.link"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.link(staged, tmp)
    os.rename(tmp, live)
    sync_dir(os.path.dirname(live))


# -- secrets and configs ----------------------------------------------------------------------------


def put_secret(directory: str, key_id: str, data: bytes) -> dict[str, Any]:
    """Write one pair's HMAC key (64 lowercase hex + newline) as ``hmac/<key_id>.key`` 0600."""
    from ..security.secret_files import load_hmac_key, parse_hmac_key

    if not KEY_ID_RE.fullmatch(key_id or ""):
        raise OnboardError("usage", f"key id {key_id!r} is not a valid key id")
    if len(data) != 65 or not data.endswith(b"\n"):
        raise OnboardError("install", "an HMAC key must be sent as 64 lowercase hex digits and a newline")
    try:
        parse_hmac_key(data, source="the HMAC key sent")
    except KvpackError as exc:
        raise OnboardError("install", exc.message) from None
    d = node_dir(directory)
    hdir = os.path.join(d, "hmac")
    ensure_dir(hdir, mode=0o700)
    path = os.path.join(hdir, f"{key_id}.key")
    atomic_write(path, data, mode=0o600)
    load_hmac_key(path)  # the daemon's own loader accepts it
    return {"path": path}


def remove_secret(directory: str, key_id: str) -> dict[str, Any]:
    if not KEY_ID_RE.fullmatch(key_id or ""):
        raise OnboardError("usage", f"key id {key_id!r} is not a valid key id")
    removed = durable_unlink(os.path.join(node_dir(directory), "hmac", f"{key_id}.key"))
    return {"removed": bool(removed)}


def put_config(directory: str, filename: str, body: bytes) -> dict[str, Any]:
    """Validate a config exactly as its daemon will load it (files it names must exist and
    satisfy their contracts), then publish it atomically (0600)."""
    from ..security.config import load_producer_config, load_receiver_config

    if not CONFIG_RE.fullmatch(filename or ""):
        raise OnboardError("usage", f"config name {filename!r} must be producer.json or receiver.<producer>.json")
    if len(body) > MAX_INPUT_BYTES:
        raise OnboardError("install", "config larger than 1 MiB")
    d = node_dir(directory)
    final = os.path.join(d, filename)
    candidate = os.path.join(d, f".{filename}.candidate")
    atomic_write(candidate, body, mode=0o600)
    try:
        (load_producer_config if filename == "producer.json" else load_receiver_config)(candidate)
    except KvpackError as exc:
        durable_unlink(candidate)
        raise OnboardError("install", f"{filename}: {exc.category}: {exc.message}") from None
    os.rename(candidate, final)
    sync_dir(d)
    return {"path": final, "sha256": hashlib.sha256(body).hexdigest()}


def remove_config(directory: str, filename: str) -> dict[str, Any]:
    if not CONFIG_RE.fullmatch(filename or ""):
        raise OnboardError("usage", f"config name {filename!r} must be producer.json or receiver.<producer>.json")
    return {"removed": bool(durable_unlink(os.path.join(node_dir(directory), filename)))}


# -- receipts and status ----------------------------------------------------------------------------


def read_receipt(directory: str, path: str) -> dict[str, Any]:
    """One daemon receipt, only from inside the node directory, bounded."""
    d = os.path.realpath(node_dir(directory))
    real = os.path.realpath(path)
    if os.path.commonpath([d, real]) != d or not real.endswith(".json") or not os.path.isfile(real):
        raise OnboardError("usage", f"{path!r} is not a receipt file inside the node directory")
    with open(real, "rb") as fh:
        data = fh.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise OnboardError("install", f"receipt {path!r} is larger than 1 MiB")
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise OnboardError("install", f"receipt {path!r} is not a JSON object")
    return obj


def status(directory: str) -> dict[str, Any]:
    """What is installed and running on this node (public facts only)."""
    import kvpack

    from . import units

    d = node_dir(directory)
    pins = None
    try:
        with open(os.path.join(d, "tls", "pins.json"), "rb") as fh:
            pins = json.loads(fh.read(65536))
    except (OSError, ValueError):
        pins = None
    configs = sorted(n for n in (os.listdir(d) if os.path.isdir(d) else []) if CONFIG_RE.fullmatch(n))
    return {
        "kvpack_version": kvpack.__version__,
        "dir": d,
        "exists": os.path.isdir(d),
        "pins": pins,
        "staged_versions": staged_versions(d) if os.path.isdir(d) else [],
        "configs": configs,
        "units": units.list_units(d),
    }


def _pem():
    from cryptography.hazmat.primitives import serialization

    return serialization.Encoding.PEM
