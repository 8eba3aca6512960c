"""ChaCha20-Poly1305 (RFC 8439) for chunks and pack manifests, through ``cryptography``.

AAD is always the exact final 4096-byte header; the data key is HKDF(epoch encryption key,
header salt, info) with the infos of INTEROP.md A.6.

It must never generate a nonce or salt (they are inputs) nor return plaintext whose tag did not
verify.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from . import constants as C
from .keys import hkdf32
from .wire import fail


def chunk_data_key(chunk_encryption_key: bytes, salt: bytes, content_id: bytes, object_key: bytes) -> bytes:
    return hkdf32(chunk_encryption_key, salt, C.D_CHUNK_AEAD + content_id + object_key)


def manifest_data_key(manifest_encryption_key: bytes, salt: bytes, manifest_id: bytes) -> bytes:
    return hkdf32(manifest_encryption_key, salt, C.D_MANIFEST_AEAD + manifest_id)


def seal(key: bytes, nonce: bytes, plaintext: bytes | memoryview, aad: bytes) -> bytes:
    """Ciphertext with the 16-byte tag appended."""
    return ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, nonce: bytes, sealed: bytes | memoryview, aad: bytes, what: str) -> bytes:
    if len(sealed) < C.AEAD_TAG_BYTES:
        raise fail("truncated", f"{what}: ciphertext shorter than its tag")
    try:
        return ChaCha20Poly1305(key).decrypt(nonce, sealed, aad)
    except InvalidTag:
        raise fail("authentication", f"{what}: AEAD tag mismatch") from None
