"""Pack files (KVPKP1 header + manifest + KVCMT1 commit footer, INTEROP.md A.6, errata
S1-4, S2-3, S2-6, S2-7, S2-13).

A pack is exactly ``4096 + stored manifest + 4096`` bytes (never padded). The footer HMAC
(epoch manifest-auth key) covers the whole header, the stored body and the three lengths, so
a pack is authentic as a unit; the manifest may additionally be sealed with ChaCha20-Poly1305
whose AAD is the final header.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

from . import constants as C
from .aead import manifest_data_key, open_sealed, seal
from .chunk import KeyRing, Keys, is_zero, schedule_for
from .keys import KeySchedule
from .objects import Manifest
from .validate import validate_manifest
from .wire import digest_with_zeroed, fail, u64

_HDR_FIXED = struct.Struct("<HHIIIQQQ")  # at 8
_FTR_FIXED = struct.Struct("<HHIQQQQ")  # at 8
_HDR_DIGEST_AT = 148
_ZERO_SALT = bytes(16)
_ZERO_NONCE = bytes(12)
MAX_STORED_MANIFEST = C.MAX_MANIFEST_BYTES + C.AEAD_TAG_BYTES


@dataclass(frozen=True)
class PackHeader:
    version: int
    header_bytes: int
    alignment: int
    flags: int
    reserved: int
    stored_bytes: int
    plaintext_bytes: int
    key_epoch: int
    catalog_epoch: int
    tenant: bytes
    manifest_id: bytes
    salt: bytes
    nonce: bytes
    header_digest: bytes

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & 1)

    @classmethod
    def parse(cls, data: bytes | memoryview) -> "PackHeader":
        h = bytes(data[: C.HEADER_BYTES])
        (version, header_bytes, alignment, flags, reserved, stored_bytes, plaintext_bytes, key_epoch) = _HDR_FIXED.unpack_from(h, 8)
        return cls(
            version=version,
            header_bytes=header_bytes,
            alignment=alignment,
            flags=flags,
            reserved=reserved,
            stored_bytes=stored_bytes,
            plaintext_bytes=plaintext_bytes,
            key_epoch=key_epoch,
            catalog_epoch=struct.unpack_from("<Q", h, 48)[0],
            tenant=h[56:88],
            manifest_id=h[88:120],
            salt=h[120:136],
            nonce=h[136:148],
            header_digest=h[148:180],
        )


@dataclass(frozen=True)
class PackFooter:
    version: int
    footer_bytes: int
    reserved: int
    stored_bytes: int
    key_epoch: int
    reserved64: int
    file_bytes: int
    manifest_id: bytes
    mac: bytes

    @classmethod
    def parse(cls, data: bytes | memoryview) -> "PackFooter":
        f = bytes(data[-C.HEADER_BYTES :])
        (version, footer_bytes, reserved, stored_bytes, key_epoch, reserved64, file_bytes) = _FTR_FIXED.unpack_from(f, 8)
        return cls(
            version=version,
            footer_bytes=footer_bytes,
            reserved=reserved,
            stored_bytes=stored_bytes,
            key_epoch=key_epoch,
            reserved64=reserved64,
            file_bytes=file_bytes,
            manifest_id=f[48:80],
            mac=f[80:112],
        )


def _header_digest(header: bytes | bytearray) -> bytes:
    return digest_with_zeroed(header, _HDR_DIGEST_AT, C.HEADER_BYTES)


def _footer_mac(auth_key: bytes, header: bytes, body: bytes | memoryview, stored: int, epoch: int, file_len: int) -> bytes:
    mac = hmac.new(auth_key, C.D_MANIFEST_AUTH, hashlib.sha256)
    mac.update(header)
    mac.update(body)
    mac.update(u64(stored) + u64(epoch) + u64(file_len))
    return mac.digest()


def encode_pack(
    manifest: Manifest,
    keys: KeySchedule,
    *,
    encrypted: bool = False,
    salt: bytes = _ZERO_SALT,
    nonce: bytes = _ZERO_NONCE,
    manifest_bytes: bytes | None = None,
) -> bytes:
    """Seal ``manifest`` into a pack. The manifest is validated first (errata S2-21)."""
    validate_manifest(manifest)
    plain = manifest_bytes if manifest_bytes is not None else manifest.encode()
    if len(plain) > C.MAX_MANIFEST_BYTES:
        raise fail("bounds", "pack: manifest exceeds 256 MiB")
    if len(salt) != 16 or len(nonce) != 12:
        raise fail("bounds", "pack: salt must be 16 bytes and nonce 12")
    if not encrypted and (salt != _ZERO_SALT or nonce != _ZERO_NONCE):
        raise fail("reserved", "pack: salt/nonce given for a plain manifest")
    if manifest.tenant != keys.tenant or manifest.key_epoch != keys.epoch:
        raise fail("authentication", "pack: manifest tenant/epoch differ from the key schedule")
    epoch = keys.epoch
    manifest_id = manifest.manifest_id(plain)
    stored = len(plain) + (C.AEAD_TAG_BYTES if encrypted else 0)
    file_len = 2 * C.HEADER_BYTES + stored
    hdr = bytearray(C.HEADER_BYTES)
    hdr[0:8] = C.MAGIC_PACK
    _HDR_FIXED.pack_into(hdr, 8, 1, C.HEADER_BYTES, C.ALIGNMENT, 1 if encrypted else 0, 0, stored, len(plain), epoch)
    hdr[56:88] = manifest.tenant
    hdr[88:120] = manifest_id
    hdr[120:136] = salt
    hdr[136:148] = nonce
    hdr[_HDR_DIGEST_AT : _HDR_DIGEST_AT + 32] = _header_digest(hdr)
    header = bytes(hdr)
    if encrypted:
        body = seal(manifest_data_key(keys.manifest_encryption, salt, manifest_id), nonce, plain, header)
    else:
        body = plain
    ftr = bytearray(C.HEADER_BYTES)
    ftr[0:8] = C.MAGIC_COMMIT
    _FTR_FIXED.pack_into(ftr, 8, 1, C.HEADER_BYTES, 0, stored, epoch, 0, file_len)
    ftr[48:80] = manifest_id
    ftr[80:112] = _footer_mac(keys.manifest_auth, header, body, stored, epoch, file_len)
    return header + body + bytes(ftr)


def pack_structure(data: bytes | memoryview) -> tuple[PackHeader, PackFooter]:
    """Steps 1-3 of the pack decode order: everything that needs no key."""
    length = len(data)
    if length < 2 * C.HEADER_BYTES:
        raise fail("truncated", f"pack: {length} bytes, shorter than header + footer")
    if bytes(data[0:8]) != C.MAGIC_PACK:
        raise fail("bad_magic", f"pack: magic {bytes(data[0:8])!r}")
    h = PackHeader.parse(data)
    if (h.version, h.header_bytes, h.alignment) != (1, C.HEADER_BYTES, C.ALIGNMENT):
        raise fail("bad_magic", "pack: version/header size/alignment")
    if h.flags & ~1:
        raise fail("reserved", f"pack: unknown flag bits {h.flags:#x}")
    if h.reserved or h.catalog_epoch or not is_zero(data[180 : C.HEADER_BYTES]):
        raise fail("reserved", "pack: reserved header bytes set")
    if not h.encrypted and (h.salt != _ZERO_SALT or h.nonce != _ZERO_NONCE):
        raise fail("reserved", "pack: salt/nonce set on a plain pack")
    if h.stored_bytes > MAX_STORED_MANIFEST or h.plaintext_bytes > C.MAX_MANIFEST_BYTES:
        raise fail("bounds", "pack: manifest size exceeds 256 MiB")
    if bytes(data[length - C.HEADER_BYTES : length - C.HEADER_BYTES + 8]) != C.MAGIC_COMMIT:
        raise fail("bad_magic", "pack: commit footer magic")
    f = PackFooter.parse(data)
    if (f.version, f.footer_bytes, f.reserved, f.reserved64) != (1, C.HEADER_BYTES, 0, 0) or not is_zero(data[length - C.HEADER_BYTES + 112 :]):
        raise fail("reserved", "pack: commit footer reserved fields")
    body_len = length - 2 * C.HEADER_BYTES
    if body_len != h.stored_bytes or f.stored_bytes != h.stored_bytes or f.key_epoch != h.key_epoch or f.file_bytes != length or f.manifest_id != h.manifest_id:
        raise fail("bounds", "pack: header/footer/body linkage mismatch")
    return h, f


class ManifestCache:
    """Parsed and validated manifests by manifest id (bounded, least recently used first
    out; thread-safe): what :func:`decode_pack` may reuse instead of parsing again.

    Only the *parsing* is memoised. The manifest id is the SHA-256 of the canonical
    manifest bytes (``D_MANIFEST || plaintext``), and parsing plus validation is a pure
    function of those bytes and the size bound, so a plaintext whose id matches an entry is
    byte for byte the one that entry was parsed from. Every other check of a pack (its
    structure, header digest, footer HMAC under the caller's keys, AEAD, the id itself, the
    header's tenant and epoch) runs on every decode: a damaged or replaced pack file is
    refused exactly as without a cache, and an entry never vouches for bytes it was not
    parsed from. The vLLM connector decodes a cut's chain in its lookup and again in the
    load (several packs of ~60 states each, milliseconds apiece in Python); with a cache the
    second decode is a dictionary look-up."""

    def __init__(self, capacity: int = 128) -> None:
        if capacity < 1:
            raise ValueError("a manifest cache holds at least one manifest")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[bytes, int], Manifest] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, manifest_id: bytes, max_restored_bytes: int) -> Manifest | None:
        with self._lock:
            manifest = self._entries.get((manifest_id, max_restored_bytes))
            if manifest is None:
                self.misses += 1
                return None
            self._entries.move_to_end((manifest_id, max_restored_bytes))
            self.hits += 1
            return manifest

    def put(self, manifest_id: bytes, max_restored_bytes: int, manifest: Manifest) -> None:
        with self._lock:
            self._entries[(manifest_id, max_restored_bytes)] = manifest
            self._entries.move_to_end((manifest_id, max_restored_bytes))
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def decode_pack(
    data: bytes | memoryview, keys: Keys, *, max_restored_bytes: int = C.DEFAULT_MAX_RESTORED_BYTES, manifests: ManifestCache | None = None
) -> tuple[Manifest, bytes]:
    """Verify a pack and return (validated manifest, canonical manifest bytes).

    ``keys`` is the caller's key schedule (or a KeyRing, from which the schedule for the
    header's epoch is taken): the header epoch only selects among keys the caller holds.
    ``manifests`` (optional) reuses the parse of a manifest already validated from the very
    same plaintext (:class:`ManifestCache`); every check of the pack itself still runs.
    """
    h, f = pack_structure(data)
    length = len(data)
    header = bytes(data[: C.HEADER_BYTES])
    if _header_digest(header) != h.header_digest:
        raise fail("checksum", "pack: header digest mismatch")
    ks = schedule_for(keys, h.key_epoch)
    body = memoryview(data)[C.HEADER_BYTES : length - C.HEADER_BYTES]
    if not hmac.compare_digest(_footer_mac(ks.manifest_auth, header, body, h.stored_bytes, h.key_epoch, length), f.mac):
        raise fail("authentication", "pack: commit footer HMAC mismatch")
    if h.encrypted:
        plain = open_sealed(manifest_data_key(ks.manifest_encryption, h.salt, h.manifest_id), h.nonce, body, header, "pack")
    else:
        plain = bytes(body)
    if len(plain) != h.plaintext_bytes or hashlib.sha256(C.D_MANIFEST + plain).digest() != h.manifest_id:
        raise fail("authentication", "pack: manifest length or id differs from the header")
    # the plaintext is authentic and its SHA-256 is h.manifest_id: a cached parse of that id
    # is a parse of these very bytes
    cached = manifests.get(h.manifest_id, max_restored_bytes) if manifests is not None else None
    manifest = cached if cached is not None else Manifest.decode(plain, validate=False)
    if manifest.tenant != h.tenant or manifest.key_epoch != h.key_epoch:
        raise fail("authentication", "pack: manifest tenant/epoch differ from the header")
    if cached is None:
        validate_manifest(manifest, max_restored_bytes=max_restored_bytes)
        if manifests is not None:
            manifests.put(h.manifest_id, max_restored_bytes, manifest)
    return manifest, plain


__all__ = ["encode_pack", "decode_pack", "ManifestCache", "pack_structure", "PackHeader", "PackFooter", "KeyRing"]
