"""The kvpack session bundle (version 1): a whole session as one sealed, verifiable file.

The upstream bundle is a Rust-only serialization (INTEROP.md D.3, not normative); kvpack
defines its own (DESIGN.md "Session bundle"). A bundle has two layers.

**Plain bundle** (what a decode node persists for each session it holds)::

    0   magic  b"KVSBND1\\0"
    8   u16    version = 1
    10  u16    0 (reserved, checked)
    12  u32    record length R
    16  R      session record: canonical JSON (sorted keys, no whitespace, ASCII escapes, no floats)
    ..  u32    file count F
    ..  F x    u16 name length, name (ASCII, [A-Za-z0-9._-] path parts joined by "/"),
               u64 size, bytes

The files are a complete production-v1 pack store (``store.json``, ``root.key``,
``chunks/``, ``packs/``, ``logits/``, ``index/``) holding exactly one cut: the session's KV
state at its position plus its exact final-logits row, written by
:meth:`kvpack.store.PackStore.save` under a fresh random root key. The record lists every file
with its size and SHA-256 (sorted by name, equal to the file table), the token ids, the
sampler and RNG state, the replay messages, the revision, the eight engine identity Id32 and
their digest, the manifest id of the cut and the SHA-256 of the live cache
(``session.cache_digest()``) at export. Decoding consumes the input exactly and re-encodes it:
any other byte sequence is refused (``integrity``).

**Sealed envelope** (what travels and what the storage tier keeps)::

    0   magic  b"KVSENV1\\0"
    8   u16    version = 1
    10  u16    0
    12  u32    segment bytes S (plaintext per segment, 1 MiB..64 MiB)
    16  u64    plaintext length L (>= 1)
    24  8      nonce prefix (random)
    32  ...    ceil(L / S) segments: ChaCha20-Poly1305(key, nonce = prefix || u32 index,
               aad = header[0:32] || u32 index || u8 last) of S plaintext bytes (the last one
               shorter), each followed by its 16-byte tag

The key is a random 32-byte per-transfer key. Segmenting keeps every AEAD call far below the
library's 2 GiB limit and lets the sealed file be produced and checked in bounded pieces; the
index and the ``last`` flag in the AAD refuse reordered, dropped or truncated segments. The
transfer's ``sha256`` is SHA-256 over the whole sealed file.

Adoption (:func:`adopt_bundle`) refuses a foreign engine identity (``identity_mismatch``)
before it allocates anything, restores the cut through the pack store's verified restore
(every chunk and the logits row are checked), and finally compares the adopted session's
``cache_digest()`` with the record: adoption is bit-exact or it does not happen.
"""

from __future__ import annotations

import os
import re
import secrets
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import KvpackError, MigrationError, ProtocolError
from ..vocab import sha256_hex

BUNDLE_MAGIC = b"KVSBND1\0"
ENVELOPE_MAGIC = b"KVSENV1\0"
BUNDLE_VERSION = 1
RECORD_SCHEMA = "kvpack.session-record.v1"
BUNDLE_TENANT = "kvpack-session-bundle"
KEY_BYTES = 32
ENVELOPE_HEADER = 32
TAG_BYTES = 16
DEFAULT_SEGMENT = 4 * 1024 * 1024
MIN_SEGMENT = 1024 * 1024
MAX_SEGMENT = 64 * 1024 * 1024
MAX_RECORD_BYTES = 256 * 1024 * 1024
MAX_FILES = 1 << 20

_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}){0,1}$")
IDENTITY_FIELDS = (
    "weights_config",
    "adapters",
    "tokenizer_template",
    "position_semantics",
    "qualified_math",
    "engine_cache_abi",
    "topology",
    "shard_map",
)


def _integrity(message: str) -> MigrationError:
    return MigrationError("integrity", message)


def canonical_record(record: dict[str, Any]) -> bytes:
    from ..handoff.canonical_json import canonical_bytes

    try:
        data = canonical_bytes(record)
    except ProtocolError as exc:
        raise MigrationError("usage", f"session record is not canonical JSON: {exc.message}") from None
    # ASCII only: canonical_bytes keeps UTF-8; the record escapes non-ASCII so it is 7-bit clean.
    import json

    return json.dumps(json.loads(data), sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def identity_record(ids) -> dict[str, str]:
    """The eight Id32 of an engine identity (hex) plus their binding digest."""
    out = {name: getattr(ids, name).hex() for name in IDENTITY_FIELDS}
    out["digest"] = ids.digest().hex()
    return out


# -- plain bundle ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bundle:
    record: dict[str, Any]
    files: dict[str, bytes]

    @property
    def session_id(self) -> str:
        return self.record["session_id"]

    @property
    def tokens(self) -> list[int]:
        return list(self.record["tokens"])


def encode_bundle(record: dict[str, Any], files: dict[str, bytes]) -> bytes:
    names = sorted(files)
    for name in names:
        if not _NAME_RE.fullmatch(name) or ".." in name.split("/"):
            raise MigrationError("usage", f"bundle file name {name!r} is not allowed")
    listed = [{"name": n, "bytes": len(files[n]), "sha256": sha256_hex(files[n])} for n in names]
    record = dict(record)
    record["files"] = listed
    rec = canonical_record(record)
    out = bytearray()
    out += BUNDLE_MAGIC + struct.pack("<HHI", BUNDLE_VERSION, 0, len(rec)) + rec
    out += struct.pack("<I", len(names))
    for n in names:
        nb = n.encode("ascii")
        out += struct.pack("<H", len(nb)) + nb + struct.pack("<Q", len(files[n])) + files[n]
    return bytes(out)


def decode_bundle(data: bytes | memoryview) -> Bundle:
    """Parse a plain bundle exactly (every length checked, re-encoded and compared)."""
    import json

    mv = memoryview(data)
    if len(mv) < 16 or bytes(mv[:8]) != BUNDLE_MAGIC:
        raise _integrity("not a kvpack session bundle (magic)")
    version, reserved, rlen = struct.unpack_from("<HHI", mv, 8)
    if version != BUNDLE_VERSION:
        raise _integrity(f"bundle version {version} is not supported")
    if reserved:
        raise _integrity("reserved bundle field is not zero")
    if rlen > MAX_RECORD_BYTES or 16 + rlen + 4 > len(mv):
        raise _integrity("bundle record length out of bounds")
    rec_bytes = bytes(mv[16 : 16 + rlen])
    try:
        record = json.loads(rec_bytes)
    except ValueError:
        raise _integrity("bundle record is not JSON") from None
    if not isinstance(record, dict) or canonical_record(record) != rec_bytes:
        raise _integrity("bundle record is not canonical JSON")
    off = 16 + rlen
    (count,) = struct.unpack_from("<I", mv, off)
    off += 4
    if count > MAX_FILES:
        raise _integrity("too many files in bundle")
    files: dict[str, bytes] = {}
    for _ in range(count):
        if off + 2 > len(mv):
            raise _integrity("bundle truncated in file table")
        (nlen,) = struct.unpack_from("<H", mv, off)
        off += 2
        if off + nlen + 8 > len(mv):
            raise _integrity("bundle truncated in file name")
        try:
            name = bytes(mv[off : off + nlen]).decode("ascii")
        except UnicodeDecodeError:
            raise _integrity("bundle file name is not ASCII") from None
        off += nlen
        (size,) = struct.unpack_from("<Q", mv, off)
        off += 8
        if off + size > len(mv):
            raise _integrity(f"bundle truncated in file {name!r}")
        if name in files:
            raise _integrity(f"file {name!r} listed twice")
        files[name] = bytes(mv[off : off + size])
        off += size
    if off != len(mv):
        raise _integrity("trailing bytes after the bundle")
    _check_record(record)
    listed = record["files"]
    if [f["name"] for f in listed] != list(files) or list(files) != sorted(files):
        raise _integrity("file table and record disagree (names or order)")
    for entry in listed:
        body = files[entry["name"]]
        if entry["bytes"] != len(body) or entry["sha256"] != sha256_hex(body):
            raise _integrity(f"file {entry['name']!r}: size or SHA-256 differs from the record")
    if encode_bundle({k: v for k, v in record.items() if k != "files"}, files) != bytes(mv):
        raise _integrity("bundle is not in canonical form")
    return Bundle(record, files)


_RECORD_KEYS = {
    "schema",
    "session_id",
    "revision",
    "tokens",
    "cut",
    "sampler",
    "rng",
    "messages",
    "identity",
    "cache_sha256",
    "pack",
    "files",
}


def _check_record(record: dict[str, Any]) -> None:
    if set(record) != _RECORD_KEYS:
        raise _integrity(f"record fields {sorted(record)} are not the v1 set")
    if record["schema"] != RECORD_SCHEMA:
        raise _integrity(f"record schema {record['schema']!r} is not {RECORD_SCHEMA!r}")
    tokens = record["tokens"]
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise _integrity("record tokens must be a non-empty list of u32")
    if record["cut"] != len(tokens):
        raise _integrity("record cut differs from the token count")
    if not isinstance(record["revision"], int) or record["revision"] < 0:
        raise _integrity("record revision must be a non-negative integer")
    ident = record["identity"]
    if not isinstance(ident, dict) or set(ident) != set(IDENTITY_FIELDS) | {"digest"}:
        raise _integrity("record identity must hold the eight Id32 and their digest")
    if not isinstance(record["files"], list) or not all(isinstance(f, dict) and set(f) == {"name", "bytes", "sha256"} for f in record["files"]):
        raise _integrity("record file list malformed")


# -- export and adoption ----------------------------------------------------------------------------


def export_bundle(
    session,
    *,
    session_id: str,
    revision: int,
    sampler: dict[str, Any],
    rng: dict[str, Any],
    messages: Sequence[Any],
) -> bytes:
    """The plain bundle of a live session at its current position (the cut)."""
    from ..store.packstore import PackStore

    if session.position <= 0:
        raise MigrationError("state", "an empty session has no state to export")
    ids = session.engine.identity.ids()
    with tempfile.TemporaryDirectory(prefix="kvpack-bundle-") as tmp:
        root = os.path.join(tmp, "store")
        store = PackStore.init(root, tenant=BUNDLE_TENANT, encrypted=False)
        report = store.save(session)
        files: dict[str, bytes] = {}
        for sub, _dirs, names in os.walk(root):
            for name in names:
                rel = os.path.relpath(os.path.join(sub, name), root)
                if rel == "lock":
                    continue  # flock file of the temporary store, no content
                with open(os.path.join(sub, name), "rb") as fh:
                    files[rel] = fh.read()
    record = {
        "schema": RECORD_SCHEMA,
        "session_id": session_id,
        "revision": int(revision),
        "tokens": [int(t) for t in session.tokens],
        "cut": session.position,
        "sampler": sampler,
        "rng": rng,
        "messages": list(messages),
        "identity": identity_record(ids),
        "cache_sha256": session.cache_digest().hex(),
        "pack": {"tenant": BUNDLE_TENANT, "key_epoch": store.epoch, "manifest_id": report.manifest_id},
    }
    return encode_bundle(record, files)


def check_identity(record: dict[str, Any], engine) -> None:
    """Refuse (identity_mismatch) a bundle written under another exact engine identity."""
    mine = identity_record(engine.ids())
    theirs = record["identity"]
    differing = [name for name in (*IDENTITY_FIELDS, "digest") if mine[name] != theirs.get(name)]
    if differing:
        raise MigrationError("identity_mismatch", f"bundle identity differs from this engine in: {', '.join(differing)}")


def adopt_bundle(data: bytes | Bundle, engine):
    """A new live session holding exactly the bundle's state; returns (session, record)."""
    from ..store.packstore import PackStore

    bundle = data if isinstance(data, Bundle) else decode_bundle(data)
    record = bundle.record
    check_identity(record, engine)
    tokens = bundle.tokens
    with tempfile.TemporaryDirectory(prefix="kvpack-adopt-") as tmp:
        root = os.path.join(tmp, "store")
        for name, body in bundle.files.items():
            path = os.path.join(root, *name.split("/"))
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(body)
        try:
            store = PackStore.open(root)
            hit = store.find_deepest(tokens, engine.layout, engine.ids())
            if hit is None or hit.cut != len(tokens):
                raise _integrity("the bundle's pack set holds no cut for its own tokens")
            if hit.manifest_id.hex() != record["pack"].get("manifest_id"):
                raise _integrity("the bundle's cut is not the manifest its record names")
            session = engine.new_session()
            store.restore(hit, session, tokens)
        except MigrationError:
            raise
        except KvpackError as exc:
            raise _integrity(f"bundle pack set refused: {exc}") from None
    if session.cache_digest().hex() != record["cache_sha256"]:
        raise _integrity("adopted cache differs from the exported cache (cache_sha256)")
    return session, record


# -- sealed envelope --------------------------------------------------------------------------------


def new_transport_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _aead(key: bytes):
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    if len(key) != KEY_BYTES:
        raise MigrationError("usage", "transport key must be 32 bytes")
    return ChaCha20Poly1305(key)


def sealed_size(plaintext_len: int, segment: int = DEFAULT_SEGMENT) -> int:
    segments = -(-plaintext_len // segment)
    return ENVELOPE_HEADER + plaintext_len + segments * TAG_BYTES


def seal(plain: bytes | memoryview, key: bytes, *, segment: int = DEFAULT_SEGMENT) -> bytes:
    """Seal a plain bundle under ``key`` (see the module docstring for the layout)."""
    if not MIN_SEGMENT <= segment <= MAX_SEGMENT:
        raise MigrationError("usage", "segment size out of bounds")
    mv = memoryview(plain)
    if len(mv) == 0:
        raise MigrationError("usage", "nothing to seal")
    aead = _aead(key)
    header = ENVELOPE_MAGIC + struct.pack("<HHIQ", BUNDLE_VERSION, 0, segment, len(mv)) + secrets.token_bytes(8)
    out = [header]
    count = -(-len(mv) // segment)
    for i in range(count):
        last = i == count - 1
        nonce = header[24:32] + struct.pack("<I", i)
        out.append(aead.encrypt(nonce, bytes(mv[i * segment : (i + 1) * segment]), header + struct.pack("<IB", i, last)))
    return b"".join(out)


def open_sealed(blob: bytes | memoryview, key: bytes) -> bytes:
    """Authenticate and decrypt a sealed envelope; any change refuses (``integrity``)."""
    from cryptography.exceptions import InvalidTag

    mv = memoryview(blob)
    if len(mv) < ENVELOPE_HEADER or bytes(mv[:8]) != ENVELOPE_MAGIC:
        raise _integrity("not a sealed kvpack session bundle (magic)")
    version, reserved, segment, plen = struct.unpack_from("<HHIQ", mv, 8)
    if version != BUNDLE_VERSION or reserved:
        raise _integrity("sealed bundle version/reserved field refused")
    if not MIN_SEGMENT <= segment <= MAX_SEGMENT or plen == 0:
        raise _integrity("sealed bundle segment size or length out of bounds")
    if len(mv) != sealed_size(plen, segment):
        raise _integrity(f"sealed bundle is {len(mv)} bytes, its header implies {sealed_size(plen, segment)}")
    header = bytes(mv[:ENVELOPE_HEADER])
    aead = _aead(key)
    count = -(-plen // segment)
    out = bytearray()
    off = ENVELOPE_HEADER
    for i in range(count):
        last = i == count - 1
        n = (plen - i * segment if last else segment) + TAG_BYTES
        nonce = header[24:32] + struct.pack("<I", i)
        try:
            out += aead.decrypt(nonce, bytes(mv[off : off + n]), header + struct.pack("<IB", i, last))
        except InvalidTag:
            raise _integrity(f"sealed bundle segment {i} failed authentication (wrong key or altered bytes)") from None
        off += n
    return bytes(out)
