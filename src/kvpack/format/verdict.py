"""One strict decode per object kind, against an explicit decode context.

Why it exists: the conformance tests (check-order cases), ``kvpack verdict`` and ``kvpack
transcode`` must judge an object exactly the same way, from the same inputs the reference
tool takes: the object's bytes plus a *decode context* (INTEROP-A-ERRATA-2: ``tenant``,
``root``, ``epoch`` for packs; for a chunk also ``family``, ``state_key``, ``ref`` and
``span``). A kind without a context is judged by its structural decode plus validation.

What it must never do: guess. A context field the kind needs and the caller did not give is
a usage error (:class:`ContextError`), never a default key, tenant or span; unknown context
fields are refused too. Pure: bytes and values in, objects, bytes or a verdict out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from .chunk import ChunkHeader, decode_chunk, encode_chunk
from . import constants as C
from .keys import KeySchedule
from .objects import ChunkRef, Family, Manifest, Schema, Span, StateDeclaration, StateKey
from .pack import MAX_STORED_MANIFEST, PackHeader, decode_pack, encode_pack

#: Every object kind the verbs take, in the reference tool's spelling.
KINDS = ("pack", "chunk", "manifest", "family", "schema", "state_declaration")

_CONTEXT_FIELDS = ("tenant", "root", "epoch", "family", "state_key", "ref", "span")


def max_object_bytes(kind: str) -> int:
    """The largest object of ``kind`` any decoder accepts: a reader bounds its input by this
    before allocating it (anything longer is refused without being read)."""
    _check_kind(kind)
    if kind == "chunk":
        return C.MAX_CHUNK_OBJECT_BYTES
    if kind == "pack":
        return 2 * C.HEADER_BYTES + MAX_STORED_MANIFEST
    return C.MAX_MANIFEST_BYTES


class ContextError(ValueError):
    """The decode context is malformed or lacks a field the kind needs (a usage error, not a
    refusal of the object)."""


@dataclass(frozen=True)
class DecodeContext:
    """What decoding needs beyond the object's bytes (every field optional until a kind
    needs it)."""

    tenant: bytes | None = None
    root: bytes | None = None
    epoch: int | None = None
    family: Family | None = None
    state_key: StateKey | None = None
    ref: ChunkRef | None = None
    span: Span | None = None

    @classmethod
    def from_json(cls, obj: object) -> "DecodeContext":
        """Parse the check-order TSV's context column (a JSON object; ``-`` is no context)."""
        if not isinstance(obj, dict):
            raise ContextError("decode context must be a JSON object")
        unknown = sorted(set(obj) - set(_CONTEXT_FIELDS))
        if unknown:
            raise ContextError(f"unknown decode context field(s): {', '.join(unknown)}")
        family = obj.get("family")
        return cls(
            tenant=_hex32(obj, "tenant"),
            root=_hex32(obj, "root"),
            epoch=_uint(obj["epoch"], "epoch") if "epoch" in obj else None,
            family=Family.decode(_hex(family, "family"), validate=False) if family is not None else None,
            state_key=_state_key(obj["state_key"]) if "state_key" in obj else None,
            ref=_ref(obj["ref"]) if "ref" in obj else None,
            span=_span(obj["span"]) if "span" in obj else None,
        )

    @classmethod
    def parse(cls, text: str) -> "DecodeContext":
        """``-`` (or empty) means no context; anything else is the JSON object."""
        if text.strip() in ("", "-"):
            return cls()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ContextError(f"decode context is not JSON: {exc}") from None
        return cls.from_json(obj)

    def keys(self) -> KeySchedule:
        """The key schedule for ``root``/``tenant``/``epoch``. All three must be given: the
        object's own header never chooses its tenant or epoch (the decoder checks them)."""
        root, tenant, epoch = self.root, self.tenant, self.epoch
        if root is None or tenant is None or epoch is None:
            raise ContextError("this object needs root, tenant and epoch in the decode context")
        return KeySchedule.derive(root, tenant, epoch)

    def chunk_binding(self) -> tuple[Family, StateKey, ChunkRef, Span]:
        if self.family is None or self.state_key is None or self.ref is None or self.span is None:
            raise ContextError("a chunk needs family, state_key, ref and span in the decode context")
        return self.family, self.state_key, self.ref, self.span


def _hex(value: object, name: str) -> bytes:
    if not isinstance(value, str):
        raise ContextError(f"{name} must be a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ContextError(f"{name} is not hex") from None


def _hex32(obj: dict[str, Any], name: str) -> bytes | None:
    if name not in obj:
        return None
    raw = _hex(obj[name], name)
    if len(raw) != 32:
        raise ContextError(f"{name} must be 32 bytes (64 hex digits)")
    return raw


def _uint(value: object, name: str) -> int:
    if type(value) is not int or value < 0 or value > (1 << 64) - 1:
        raise ContextError(f"{name} must be an unsigned 64-bit integer")
    return value


def _fields(value: object, name: str, count: int) -> list[Any]:
    if not isinstance(value, list) or len(value) != count:
        raise ContextError(f"{name} must be a list of {count} values")
    return value


def _state_key(value: object) -> StateKey:
    layer, name = _fields(value, "state_key", 2)
    if not isinstance(name, str):
        raise ContextError("state_key name must be a string")
    return StateKey(_uint(layer, "state_key layer"), name)


def _ref(value: object) -> ChunkRef:
    content_id, object_key, object_digest, epoch, plaintext_bytes, object_bytes = _fields(value, "ref", 6)
    return ChunkRef(
        _hex(content_id, "ref content_id"),
        _hex(object_key, "ref object_key"),
        _hex(object_digest, "ref object_digest"),
        _uint(epoch, "ref key_epoch"),
        _uint(plaintext_bytes, "ref plaintext_bytes"),
        _uint(object_bytes, "ref object_bytes"),
    )


def _span(value: object) -> Span:
    token_start, token_count, plaintext_offset, plaintext_bytes = _fields(value, "span", 4)
    return Span(
        _uint(token_start, "span token_start"),
        _uint(token_count, "span token_count"),
        _uint(plaintext_offset, "span plaintext_offset"),
        _uint(plaintext_bytes, "span plaintext_bytes"),
    )


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ContextError(f"unknown object kind {kind!r} (one of {', '.join(KINDS)})")


def canonical_bytes(kind: str, data: bytes, context: DecodeContext | None = None) -> bytes:
    """Decode ``data`` as ``kind`` strictly (raising :class:`FormatError` with its category)
    and re-emit its canonical encoding. Every decoder here consumes its input exactly, so an
    accepted object re-emits byte for byte."""
    _check_kind(kind)
    ctx = context or DecodeContext()
    if kind == "pack":
        return _transcode_pack(data, ctx)
    if kind == "chunk":
        return _transcode_chunk(data, ctx)
    if kind == "manifest":
        return Manifest.decode(data).encode()
    if kind == "family":
        return Family.decode(data).encode()
    if kind == "schema":
        return Schema.decode(data).encode()
    return StateDeclaration.decode(data).encode()


def _transcode_pack(data: bytes, ctx: DecodeContext) -> bytes:
    keys = ctx.keys()
    manifest, plain = decode_pack(data, keys)
    h = PackHeader.parse(data)
    return encode_pack(manifest, keys, encrypted=h.encrypted, salt=h.salt, nonce=h.nonce, manifest_bytes=plain)


def _transcode_chunk(data: bytes, ctx: DecodeContext) -> bytes:
    family, key, ref, span = ctx.chunk_binding()
    keys = ctx.keys()
    plaintext = decode_chunk(data, ref=ref, span=span, tenant=keys.tenant, family=family, key=key, keys=keys)
    h = ChunkHeader.parse(data)
    return encode_chunk(
        keys=keys,
        family_digest=family.digest(),
        key=key,
        span=span,
        plaintext=plaintext,
        codec=h.codec,
        encrypted=h.encrypted,
        salt=h.salt,
        nonce=h.nonce,
        sidecar=h.sidecar or None,
        codec_version=h.codec_version,
    ).obj


@dataclass(frozen=True)
class Verdict:
    """``ok`` or the refusal's category and message (the reference tool's verdict line)."""

    kind: str
    category: str | None
    detail: str

    @property
    def ok(self) -> bool:
        return self.category is None

    def line(self) -> str:
        return f"ok {self.kind}" if self.ok else f"refused {self.category}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "verdict": "ok" if self.ok else "refused", "category": self.category, "detail": self.detail}


def judge(kind: str, data: bytes, context: DecodeContext | None = None) -> Verdict:
    """The verdict of a strict decode (a :class:`ContextError` still propagates: a missing
    context is the caller's mistake, not the object's)."""
    try:
        canonical_bytes(kind, data, context)
    except FormatError as exc:
        return Verdict(kind, exc.category, exc.message)
    return Verdict(kind, None, f"{len(data)} bytes")


__all__ = ["KINDS", "max_object_bytes", "ContextError", "DecodeContext", "Verdict", "canonical_bytes", "judge"]
