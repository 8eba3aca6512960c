"""Production-v1 identities (INTEROP.md A.2): namespace, SemanticModelId, auxiliary-input root,
the keyed 256-token prefix chain, InputCutId, chunk content id and object key.

All HMACs are HMAC-SHA-256 with the domain string as the first bytes of the *message*.
Token ids never leave this module except as HMAC outputs: the prefix chain is how a store
finds a cut without storing raw tokens anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import constants as C
from .wire import Reader, fail, u16, u32, u64


def _hmac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def namespace_id(namespace_key: bytes, tenant_id: bytes) -> bytes:
    """Tenant namespace: HMAC(namespace key, domain || u32 len || tenant id bytes)."""
    return _hmac(namespace_key, C.D_NAMESPACE, u32(len(tenant_id)), tenant_id)


@dataclass(frozen=True)
class SemanticModelId:
    """Five Id32 that pin the meaning of a KV cache: change any, and the cache is unreachable."""

    weights_config: bytes
    adapters: bytes
    tokenizer_template: bytes
    position_semantics: bytes
    qualified_math: bytes

    def fields(self) -> tuple[bytes, ...]:
        return (self.weights_config, self.adapters, self.tokenizer_template, self.position_semantics, self.qualified_math)

    def encode(self) -> bytes:
        return b"".join(self.fields())

    @classmethod
    def read(cls, r: Reader) -> "SemanticModelId":
        return cls(*(r.id32() for _ in range(5)))

    def digest(self) -> bytes:
        return hashlib.sha256(C.D_SEMANTIC + self.encode()).digest()


@dataclass(frozen=True)
class InputCutId:
    """``token_root || aux_root || u64 token_count`` (72 bytes)."""

    token_root: bytes
    aux_root: bytes
    token_count: int

    def encode(self) -> bytes:
        return self.token_root + self.aux_root + u64(self.token_count)

    @classmethod
    def read(cls, r: Reader) -> "InputCutId":
        return cls(r.id32(), r.id32(), r.u64())


def auxiliary_root(prefix_key: bytes, tenant: bytes, aux_inputs: Sequence[tuple[bytes, bytes]]) -> bytes:
    """Root over (type_id, value_id) pairs of auxiliary inputs (images, tools, ...)."""
    parts = [u32(len(aux_inputs))]
    for i, (type_id, value_id) in enumerate(aux_inputs):
        if len(type_id) != 32 or len(value_id) != 32:
            raise fail("bounds", "auxiliary input ids must be 32 bytes")
        if type_id == C.ZERO32 or value_id == C.ZERO32:
            raise fail("semantics", f"auxiliary input {i} has a zero id")
        parts += [u64(i), u32(32), type_id, u32(32), value_id]
    return _hmac(prefix_key, C.D_AUX_ROOT, tenant, *parts)


@dataclass(frozen=True)
class PrefixNode:
    cumulative_count: int
    node_id: bytes
    reusable: bool


def prefix_context(prefix_key: bytes, tenant: bytes, semantic_digest: bytes, family_digest: bytes, aux_root: bytes) -> bytes:
    return _hmac(prefix_key, C.D_PREFIX_CONTEXT, tenant, semantic_digest, family_digest, aux_root)


def _tokens_le(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise fail("bounds", "token ids must be integers")
    if int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF:
        raise fail("bounds", "token id does not fit in u32")
    return arr.astype("<u4", copy=False).tobytes()


class PrefixChain:
    """The keyed chain over 256-token blocks. ``extend`` is incremental, so a session can keep
    its chain as it grows; ``nodes`` lists every node (reusable when the block is full)."""

    def __init__(self, prefix_key: bytes, context: bytes) -> None:
        self._key = prefix_key
        self.context = context
        self.root = _hmac(prefix_key, C.D_PREFIX_ROOT, context)
        self.nodes: list[PrefixNode] = []
        self._parent = self.root
        self._partial: bytes = b""  # tokens (u32 LE) of an open partial block

    @property
    def token_count(self) -> int:
        full = len(self.nodes) - (1 if self._partial else 0)
        return full * C.PREFIX_BLOCK_TOKENS + len(self._partial) // 4

    def _node(self, parent: bytes, index: int, block: bytes) -> bytes:
        n = len(block) // 4
        return _hmac(self._key, C.D_PREFIX_NODE, self.context, parent, u64(index), u64(index * C.PREFIX_BLOCK_TOKENS), u32(n), u32(4 * n), block)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        data = self._partial + _tokens_le(tokens)
        if self._partial:
            # reopen the partial block: its node is recomputed with the longer block
            self.nodes.pop()
        self._partial = b""
        block_bytes = 4 * C.PREFIX_BLOCK_TOKENS
        for off in range(0, len(data), block_bytes):
            block = data[off : off + block_bytes]
            index = len(self.nodes)
            node_id = self._node(self._parent, index, block)
            count = index * C.PREFIX_BLOCK_TOKENS + len(block) // 4
            full = len(block) == block_bytes
            self.nodes.append(PrefixNode(count, node_id, full))
            if full:
                self._parent = node_id
            else:
                self._partial = block

    @property
    def token_root(self) -> bytes:
        return self.nodes[-1].node_id if self.nodes else self.root

    def checkpoints(self) -> list[PrefixNode]:
        """Reusable nodes (block-aligned cuts), shallowest first."""
        return [n for n in self.nodes if n.reusable]


def token_root(prefix_key: bytes, context: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    chain = PrefixChain(prefix_key, context)
    chain.extend(tokens)
    return chain.token_root


def chunk_content_prefix(
    tenant: bytes,
    family_digest: bytes,
    layer: int,
    name: str,
    token_start: int,
    token_count: int,
    plaintext_offset: int,
    plaintext_bytes: int,
) -> bytes:
    """The bytes the chunk content-ID HMAC reads before the plaintext (A.2).

    Split out so that a verifier hashing the plaintext elsewhere (kvpack.engine.gpu_digest,
    on the GPU) feeds exactly the message the CPU path feeds."""
    name_b = name.encode("utf-8")
    return b"".join(
        (
            C.D_CHUNK_CONTENT,
            tenant,
            family_digest,
            u32(layer),
            u16(len(name_b)),
            name_b,
            u64(token_start),
            u64(token_count),
            u64(plaintext_offset),
            u32(plaintext_bytes),
        )
    )


def chunk_content_id(
    chunk_identity_key: bytes,
    tenant: bytes,
    family_digest: bytes,
    layer: int,
    name: str,
    token_start: int,
    token_count: int,
    plaintext_offset: int,
    plaintext: bytes | memoryview,
) -> bytes:
    prefix = chunk_content_prefix(tenant, family_digest, layer, name, token_start, token_count, plaintext_offset, len(plaintext))
    return _hmac(chunk_identity_key, prefix, plaintext)


def hmac_sha256_pads(key: bytes) -> tuple[bytes, bytes]:
    """The 64-byte inner and outer blocks of HMAC-SHA-256 (RFC 2104) for ``key``.

    ``HMAC(key, m) == sha256(outer + sha256(inner + m).digest()).digest()``: the long inner
    hash can then run anywhere that hashes plain SHA-256 (the GPU), and the 96-byte outer
    hash is finished by :func:`hmac_sha256_finish`."""
    if len(key) > 64:
        key = hashlib.sha256(key).digest()
    key = key.ljust(64, b"\0")
    return bytes(b ^ 0x36 for b in key), bytes(b ^ 0x5C for b in key)


def hmac_sha256_finish(outer_pad: bytes, inner_digest: bytes) -> bytes:
    """The HMAC-SHA-256 value from the outer block and the inner hash's digest."""
    return hashlib.sha256(outer_pad + inner_digest).digest()


def chunk_object_key(
    object_identity_key: bytes,
    tenant: bytes,
    family_digest: bytes,
    content_id: bytes,
    epoch: int,
    codec: int,
    codec_version: int,
    encrypted: bool,
    salt: bytes,
    nonce: bytes,
    sidecar: bytes | None = None,
) -> bytes:
    parts = [
        C.D_CHUNK_OBJECT,
        tenant,
        family_digest,
        content_id,
        u64(epoch),
        u16(codec),
        u16(codec_version),
        bytes((1 if encrypted else 0,)),
        salt,
        nonce,
    ]
    if sidecar:
        parts += [C.D_CHUNK_OBJECT_STATS, hashlib.sha256(sidecar).digest()]
    return _hmac(object_identity_key, *parts)
