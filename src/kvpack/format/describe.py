"""Describe any production-v1 object as a JSON-able dict (for ``kvpack inspect``).

Detection is by magic. Keyless where the object allows it: a plain pack shows its whole
manifest; an encrypted pack shows its header unless a key ring is given.

Without a key, every check that needs none still runs, so damage is refused wherever the
object can show it: a pack's structure and header digest, and for a plain pack the manifest
id (SHA-256 over the body), its length and the manifest's own validation; a chunk's
structure and header digest. What only a key can prove is listed in ``unverified`` (the
pack's footer HMAC, an encrypted manifest, a chunk's payload) and ``verified`` is false:
``kvpack inspect`` then says "structure ok, not verified" and ``kvpack verify`` (with the
root key) is the command that proves the object.

It must never present an unverified object as verified.
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import constants as C
from .chunk import ChunkHeader, KeyRing, chunk_structure, header_digest
from .validate import validate_manifest
from .codec import decode_frame
from .objects import Family, Manifest, Schema, StateDeclaration
from .pack import _header_digest, decode_pack, pack_structure
from .sidecar import StatsSidecar
from ..vocab import sha256_hex
from .wire import fail

KIND_BY_MAGIC = {
    C.MAGIC_PACK: "pack",
    C.MAGIC_CHUNK: "chunk",
    C.MAGIC_MANIFEST: "manifest",
    C.MAGIC_FAMILY: "family",
    C.MAGIC_SCHEMA: "schema",
    C.MAGIC_STATE: "state_declaration",
    C.MAGIC_RAW: "raw_frame",
    C.MAGIC_LOSSLESS: "lossless_frame",
    C.MAGIC_SIDECAR: "stats_sidecar",
}


def detect_kind(data: bytes) -> str:
    if len(data) < 8:
        raise fail("truncated", f"{len(data)} bytes: too short to hold a magic")
    kind = KIND_BY_MAGIC.get(bytes(data[:8]))
    if kind is None:
        raise fail("bad_magic", f"unknown magic {bytes(data[:8])!r}")
    return kind


def family_json(f: Family) -> dict[str, Any]:
    """A JSON view of a family (for ``inspect`` and ``store show``)."""
    return {
        "digest": f.digest().hex(),
        "mode": {1: "native", 2: "portable"}.get(f.mode, f.mode),
        "page_size_tokens": f.page_size_tokens,
        "engine_cache_abi": f.engine_cache_abi.hex(),
        "states": [
            {
                "key": str(s.key),
                "dtype": C.DTYPE_NAMES.get(s.dtype, s.dtype),
                "codec": {1: "raw", 2: "lossless"}.get(s.codec, s.codec),
                "dims": list(s.dims),
                "token_axis": s.token_axis,
                "bytes_per_token": s.elements_per_token * C.DTYPE_WIDTHS.get(s.dtype, 0),
            }
            for s in f.states
        ],
    }


def schema_json(s: Schema) -> dict[str, Any]:
    """A JSON view of a realized-cut schema."""
    out: dict[str, Any] = {
        "kind": "delta" if s.parent else "full",
        "depth": s.depth,
        "segment_restored_bytes": s.segment_restored_bytes,
        "complete_restored_bytes": s.complete_restored_bytes,
        "states": [
            {
                "key": str(r.key),
                "full_shape": list(r.full_shape),
                "segment_shape": list(r.segment_shape),
                "logical_start": r.logical_start,
                "logical_count": r.logical_count,
                "spans": [[sp.token_start, sp.token_count, sp.plaintext_offset, sp.plaintext_bytes] for sp in r.spans],
            }
            for r in s.states
        ],
        "groups": [{"id": g.group_id, "keys": [str(k) for k in g.keys]} for g in s.groups],
    }
    if s.parent:
        out["parent_manifest_id"] = s.parent.manifest_id.hex()
        out["parent_token_count"] = s.parent.cut.token_count
    return out


def manifest_json(m: Manifest) -> dict[str, Any]:
    """A JSON view of a manifest: ids, family, schema and every chunk ref."""
    return {
        "manifest_id": m.manifest_id().hex(),
        "tenant": m.tenant.hex(),
        "key_epoch": m.key_epoch,
        "semantic_model_digest": m.semantic.digest().hex(),
        "token_count": m.cut.token_count,
        "token_root": m.cut.token_root.hex(),
        "aux_root": m.cut.aux_root.hex(),
        "family": family_json(m.family),
        "schema": schema_json(m.schema),
        "chunks": [
            {
                "state": str(k),
                "token_start": sp.token_start,
                "token_count": sp.token_count,
                "content_id": ref.content_id.hex(),
                "object_key": ref.object_key.hex(),
                "object_digest": ref.object_digest.hex(),
                "plaintext_bytes": ref.plaintext_bytes,
                "object_bytes": ref.object_bytes,
                "key_epoch": ref.key_epoch,
            }
            for k, sp, ref in m.chunk_refs()
        ],
    }


def _keyless_pack(data: bytes, h: Any) -> dict[str, Any]:
    """Every pack check that needs no key (decode_pack's order); what is left is listed."""
    if _header_digest(bytes(data[: C.HEADER_BYTES])) != h.header_digest:
        raise fail("checksum", "pack: header digest mismatch")
    out: dict[str, Any] = {"verified": False, "unverified": ["footer HMAC (needs the root key)"]}
    if h.encrypted:
        out["unverified"].append("manifest (encrypted; needs the root key)")
        return out
    body = bytes(data[C.HEADER_BYTES : len(data) - C.HEADER_BYTES])
    if len(body) != h.plaintext_bytes or hashlib.sha256(C.D_MANIFEST + body).digest() != h.manifest_id:
        raise fail("authentication", "pack: manifest length or id differs from the header")
    manifest = Manifest.decode(body, validate=False)
    if manifest.tenant != h.tenant or manifest.key_epoch != h.key_epoch:
        raise fail("authentication", "pack: manifest tenant/epoch differ from the header")
    validate_manifest(manifest)
    out["manifest"] = manifest_json(manifest)
    return out


def describe(data: bytes, *, root: bytes | None = None) -> dict[str, Any]:
    """A JSON view of any object, detected by its magic (``root``: verify a pack with it)."""
    kind = detect_kind(data)
    out: dict[str, Any] = {"kind": kind, "bytes": len(data), "sha256": sha256_hex(data)}
    if kind == "pack":
        out.update(_pack_view(data, root))
    elif kind == "chunk":
        out.update(_chunk_view(data))
    elif kind == "manifest":
        out["manifest"] = manifest_json(Manifest.decode(data))
    elif kind == "family":
        out["family"] = family_json(Family.decode(data))
    elif kind == "schema":
        out["schema"] = schema_json(Schema.decode(data))
    elif kind == "state_declaration":
        out["state_declaration"] = _state_declaration_json(StateDeclaration.decode(data))
    elif kind in ("raw_frame", "lossless_frame"):
        decoded = int.from_bytes(data[12:16], "little")
        decode_frame(C.CODEC_RAW if kind == "raw_frame" else C.CODEC_LOSSLESS, data, decoded)
        out["decoded_bytes"] = decoded
    elif kind == "stats_sidecar":
        s = StatsSidecar.decode(data)
        out["stats_sidecar"] = {"channels": len(s.channel_ranges), "tokens": len(s.token_norms), "sinks": [list(x) for x in s.sinks]}
    return out


def _pack_view(data: bytes, root: bytes | None) -> dict[str, Any]:
    h, _f = pack_structure(data)
    out: dict[str, Any] = {
        "tenant": h.tenant.hex(),
        "key_epoch": h.key_epoch,
        "encrypted": h.encrypted,
        "manifest_id": h.manifest_id.hex(),
        "stored_manifest_bytes": h.stored_bytes,
        "plaintext_manifest_bytes": h.plaintext_bytes,
    }
    if root is not None:
        manifest, _ = decode_pack(data, KeyRing(root, h.tenant))
        out["verified"] = True
        out["manifest"] = manifest_json(manifest)
    else:
        out.update(_keyless_pack(data, h))
    return out


def _chunk_view(data: bytes) -> dict[str, Any]:
    ch = chunk_structure(data)
    if header_digest(bytes(data[: C.HEADER_BYTES])) != ch.header_digest:
        raise fail("authentication", "chunk: header digest mismatch")
    return {
        "verified": False,
        "unverified": ["payload: its object digest is in the manifest ref and its content id is keyed (kvpack verify --pack)"],
        "codec": {1: "raw", 2: "lossless"}[ch.codec],
        "encrypted": ch.encrypted,
        "plaintext_bytes": ch.plaintext_bytes,
        "encoded_bytes": ch.encoded_bytes,
        "stored_bytes": ch.stored_bytes,
        "key_epoch": ch.key_epoch,
        "tenant": ch.tenant.hex(),
        "family_digest": ch.family_digest.hex(),
        "content_id": ch.content_id.hex(),
        "object_key": ch.object_key.hex(),
        "has_stats_sidecar": bool(ch.sidecar),
    }


def _state_declaration_json(d: StateDeclaration) -> dict[str, Any]:
    return {
        "key": str(d.key),
        "full_shape": list(d.full_shape),
        "segment_shape": list(d.segment_shape),
        "strides": list(d.strides),
        "logical_start": d.logical_start,
        "logical_count": d.logical_count,
        "absolute_position": d.absolute_position,
        "window": d.window,
        "atomic_group": d.atomic_group,
    }


__all__ = ["describe", "detect_kind", "ChunkHeader"]
