"""The production-v1 key schedule (INTEROP.md A.1): one-block HKDF-SHA-256 from one root.

Stable keys are salted with the tenant Id32; epoch keys with ``tenant || u64 LE epoch``.
Epoch 0 is invalid. Keys are derived once per (root, tenant, epoch) and passed to the pure
codecs; nothing here reads files or clocks.

It must never show key bytes (``repr`` hides them) or accept epoch 0.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from .wire import fail, u64


def hkdf32(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    """RFC 5869 HKDF-SHA-256 with one 32-byte output block."""
    prk = hmac.new(salt, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


STABLE_INFOS = {
    "namespace": b"kvpack/v1/stable/namespace",
    "prefix": b"kvpack/v1/stable/prefix",
    "chunk_identity": b"kvpack/v1/stable/chunk-identity",
}
EPOCH_INFOS = {
    "manifest_auth": b"kvpack/v1/epoch/manifest-auth",
    "manifest_encryption": b"kvpack/v1/epoch/manifest-encryption",
    "object_identity": b"kvpack/v1/epoch/object-identity",
    "chunk_encryption": b"kvpack/v1/epoch/chunk-encryption",
}


@dataclass(frozen=True, repr=False)
class KeySchedule:
    """All seven keys for one tenant and key epoch. ``repr`` never shows key bytes."""

    tenant: bytes
    epoch: int
    namespace: bytes
    prefix: bytes
    chunk_identity: bytes
    manifest_auth: bytes
    manifest_encryption: bytes
    object_identity: bytes
    chunk_encryption: bytes

    @classmethod
    def derive(cls, root: bytes, tenant: bytes, epoch: int) -> "KeySchedule":
        if len(root) != 32:
            raise fail("bounds", f"root key must be 32 bytes, got {len(root)}")
        if len(tenant) != 32:
            raise fail("bounds", f"tenant must be 32 bytes, got {len(tenant)}")
        if epoch == 0:
            raise fail("semantics", "key epoch 0 is invalid")
        if not 0 < epoch < 1 << 64:
            raise fail("bounds", f"key epoch {epoch} out of range")
        stable = {name: hkdf32(root, tenant, info) for name, info in STABLE_INFOS.items()}
        epoch_salt = tenant + u64(epoch)
        per_epoch = {name: hkdf32(root, epoch_salt, info) for name, info in EPOCH_INFOS.items()}
        return cls(tenant=tenant, epoch=epoch, **stable, **per_epoch)

    def named(self) -> dict[str, bytes]:
        """The seven keys by vector name (``key/<name>``)."""
        names = sorted([*STABLE_INFOS, *EPOCH_INFOS])
        return {name: getattr(self, name) for name in names}

    def __repr__(self) -> str:
        return f"KeySchedule(tenant={self.tenant.hex()[:16]}…, epoch={self.epoch})"
