"""Chunk objects (KVCHK1, INTEROP.md A.5, errata S2-2/4/5/6/7/12/18/21).

``4096-byte header || payload (frame, or frame ciphertext || tag) || zero pad`` to the next
multiple of 4096. A chunk is content-addressed twice: the *content id* (stable key, over the
plaintext and its position in the state stream) and the *object key* (epoch key, over the
encoding choices). The manifest's chunk ref carries both plus the SHA-256 of the whole object.

It must never return plaintext before every check of the normative order passed, and never
generate salts or nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from . import constants as C
from ..errors import FormatError
from .aead import chunk_data_key, open_sealed, seal
from .codec import decode_frame, encode_frame, frame_header
from .identity import chunk_content_id, chunk_content_prefix, chunk_object_key
from .keys import KeySchedule
from .objects import ChunkRef, Family, Span, StateKey
from .sidecar import StatsSidecar
from .wire import digest_with_zeroed, fail

_FIXED = struct.Struct("<HHIIHHIIIIQ")  # at offset 8
_DIGEST_AT = 204
_ZERO_SALT = bytes(16)
_ZERO_NONCE = bytes(12)


class KeyRing:
    """Key schedules for one (root, tenant), derived per epoch on demand."""

    def __init__(self, root: bytes, tenant: bytes) -> None:
        self._root = root
        self.tenant = tenant
        self._cache: dict[int, KeySchedule] = {}

    def for_epoch(self, epoch: int) -> KeySchedule:
        ks = self._cache.get(epoch)
        if ks is None:
            ks = self._cache[epoch] = KeySchedule.derive(self._root, self.tenant, epoch)
        return ks

    def __repr__(self) -> str:
        return f"KeyRing(tenant={self.tenant.hex()[:16]}…)"


Keys = KeySchedule | KeyRing


def schedule_for(keys: Keys, epoch: int) -> KeySchedule:
    """The key schedule for an object's ``epoch``: a ring derives it (epoch 0 refused), a
    single schedule is used as given (the decoder then checks the epoch binding)."""
    if isinstance(keys, KeyRing):
        if epoch == 0:
            raise fail("semantics", "key epoch 0 is invalid")
        return keys.for_epoch(epoch)
    return keys


@dataclass(frozen=True)
class ChunkHeader:
    version: int
    header_bytes: int
    alignment: int
    flags: int
    codec: int
    codec_version: int
    plaintext_bytes: int
    encoded_bytes: int
    stored_bytes: int
    object_bytes: int
    key_epoch: int
    tenant: bytes
    family_digest: bytes
    content_id: bytes
    object_key: bytes
    salt: bytes
    nonce: bytes
    header_digest: bytes
    sidecar: bytes  # KVSSC1 bytes without the u16 length prefix; b"" when absent

    @property
    def encrypted(self) -> bool:
        return bool(self.flags & 1)

    @classmethod
    def parse(cls, obj: bytes | memoryview) -> "ChunkHeader":
        """Field extraction only (no checks); callers check in the normative order."""
        h = bytes(obj[: C.HEADER_BYTES])
        (version, header_bytes, alignment, flags, codec, codec_version, plaintext_bytes, encoded_bytes, stored_bytes, object_bytes, key_epoch) = (
            _FIXED.unpack_from(h, 8)
        )
        side_len = struct.unpack_from("<H", h, C.SIDECAR_OFFSET)[0]
        return cls(
            version=version,
            header_bytes=header_bytes,
            alignment=alignment,
            flags=flags,
            codec=codec,
            codec_version=codec_version,
            plaintext_bytes=plaintext_bytes,
            encoded_bytes=encoded_bytes,
            stored_bytes=stored_bytes,
            object_bytes=object_bytes,
            key_epoch=key_epoch,
            tenant=h[48:80],
            family_digest=h[80:112],
            content_id=h[112:144],
            object_key=h[144:176],
            salt=h[176:192],
            nonce=h[192:204],
            header_digest=h[204:236],
            sidecar=h[238 : 238 + side_len] if side_len <= C.MAX_SIDECAR_BYTES else b"",
        )


def is_zero(data: bytes | memoryview) -> bool:
    """Whether every byte is zero (reserved fields and padding)."""
    raw = bytes(data)
    return raw.count(0) == len(raw)


def header_digest(header: bytes | bytearray) -> bytes:
    return digest_with_zeroed(header, _DIGEST_AT, C.HEADER_BYTES)


@dataclass(frozen=True)
class ExternalDigests:
    """The two long hashes of a raw unencrypted chunk, computed outside this module.

    ``object_digest`` is SHA-256 of the whole object; ``content_id`` is the content-ID HMAC
    over the plaintext (``identity.chunk_content_prefix`` + plaintext) for the ref's key and
    span. Both must come from the same bytes that are handed to :func:`decode_chunk`."""

    object_digest: bytes
    content_id: bytes


@dataclass(frozen=True)
class EncodedChunk:
    obj: bytes
    ref: ChunkRef
    content_id: bytes
    object_key: bytes


def aligned_object_bytes(payload_bytes: int) -> int:
    return -(-(C.HEADER_BYTES + payload_bytes) // C.ALIGNMENT) * C.ALIGNMENT


def encode_chunk(
    *,
    keys: KeySchedule,
    family_digest: bytes,
    key: StateKey,
    span: Span,
    plaintext: bytes | memoryview,
    codec: int,
    encrypted: bool = False,
    salt: bytes = _ZERO_SALT,
    nonce: bytes = _ZERO_NONCE,
    sidecar: bytes | None = None,
    codec_version: int = C.CODEC_VERSION,
    content_id: bytes | None = None,
) -> EncodedChunk:
    """Build one chunk object. Salt and nonce are inputs (never generated here).

    ``content_id`` may be passed when the caller already computed it (the store does, to
    look up an existing copy before encoding); it must be :func:`chunk_content_id` of the
    same inputs, and every decoder recomputes and compares it.
    """
    parts = encode_chunk_parts(
        keys=keys,
        family_digest=family_digest,
        key=key,
        span=span,
        plaintext=plaintext,
        codec=codec,
        encrypted=encrypted,
        salt=salt,
        nonce=nonce,
        sidecar=sidecar,
        codec_version=codec_version,
        content_id=content_id,
    )
    return EncodedChunk(b"".join(parts.parts), parts.ref, parts.content_id, parts.object_key)


@dataclass(frozen=True)
class ChunkParts:
    """A chunk object as the buffers it is made of, in order (header, payload pieces, zero
    padding): a writer gathers them into the object (``writev``) without joining them into
    one more copy first. ``ref.object_digest`` is the SHA-256 of their concatenation."""

    parts: tuple[bytes | bytearray | memoryview, ...]
    ref: ChunkRef
    content_id: bytes
    object_key: bytes


def encode_chunk_parts(
    *,
    keys: KeySchedule,
    family_digest: bytes,
    key: StateKey,
    span: Span,
    plaintext: bytes | memoryview,
    codec: int,
    encrypted: bool = False,
    salt: bytes = _ZERO_SALT,
    nonce: bytes = _ZERO_NONCE,
    sidecar: bytes | None = None,
    codec_version: int = C.CODEC_VERSION,
    content_id: bytes | None = None,
) -> ChunkParts:
    """:func:`encode_chunk` without the final join: the object as its parts. A raw
    unencrypted chunk's payload part is ``plaintext`` itself (not copied), so the caller
    must keep it unchanged until the parts are written."""
    epoch = keys.epoch
    n = len(plaintext)
    _check_encode_inputs(epoch, span, n, codec_version, encrypted, salt, nonce, sidecar)
    if content_id is None:
        content_id = chunk_content_id(
            keys.chunk_identity, keys.tenant, family_digest, key.layer, key.name, span.token_start, span.token_count, span.plaintext_offset, plaintext
        )
    object_key = chunk_object_key(keys.object_identity, keys.tenant, family_digest, content_id, epoch, codec, codec_version, encrypted, salt, nonce, sidecar)
    # A raw unencrypted frame is its header and the plaintext itself (no copy of the
    # payload); every other frame is built first (encoded or sealed).
    in_place = codec == C.CODEC_RAW and not encrypted
    frame = b"" if in_place else encode_frame(codec, plaintext)
    frame_len = C.CODEC_FRAME_HEADER_BYTES + n if in_place else len(frame)
    stored = frame_len + (C.AEAD_TAG_BYTES if encrypted else 0)
    total = aligned_object_bytes(stored)
    if total > C.MAX_CHUNK_OBJECT_BYTES:
        raise fail("bounds", f"chunk: object {total} bytes exceeds the cap")
    header = bytearray(C.HEADER_BYTES)
    _FIXED.pack_into(header, 8, 1, C.HEADER_BYTES, C.ALIGNMENT, 1 if encrypted else 0, codec, codec_version, n, frame_len, stored, total, epoch)
    _write_header_ids(header, keys.tenant, family_digest, content_id, object_key, salt, nonce, sidecar)
    if encrypted:
        data_key = chunk_data_key(keys.chunk_encryption, salt, content_id, object_key)
        payload: tuple[bytes | bytearray | memoryview, ...] = (seal(data_key, nonce, frame, bytes(header)),)
    elif in_place:
        payload = (frame_header(codec, n), plaintext)
    else:
        payload = (frame,)
    parts = (bytes(header), *payload, bytes(total - C.HEADER_BYTES - stored))
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    ref = ChunkRef(content_id, object_key, digest.digest(), epoch, n, total)
    return ChunkParts(parts, ref, content_id, object_key)


def _check_encode_inputs(epoch: int, span: Span, n: int, codec_version: int, encrypted: bool, salt: bytes, nonce: bytes, sidecar: bytes | None) -> None:
    """What :func:`encode_chunk` refuses before building anything (the decoder's rules)."""
    if epoch == 0:
        raise fail("semantics", "chunk: key epoch 0")
    if span.plaintext_bytes != n:
        raise fail("semantics", f"chunk: span says {span.plaintext_bytes} bytes, plaintext has {n}")
    if codec_version != C.CODEC_VERSION:
        raise fail("codec", f"chunk: codec_version {codec_version}")
    if not 1 <= n <= C.MAX_CHUNK_PLAINTEXT:
        raise fail("bounds", f"chunk: plaintext {n} bytes outside 1..4 MiB")
    if len(salt) != 16 or len(nonce) != 12:
        raise fail("bounds", "chunk: salt must be 16 bytes and nonce 12")
    if not encrypted and (salt != _ZERO_SALT or nonce != _ZERO_NONCE):
        raise fail("reserved", "chunk: salt/nonce given for an unencrypted chunk")
    if sidecar:
        StatsSidecar.decode(sidecar)
    _content_id_precondition(span)


def _write_header_ids(
    obj: bytearray, tenant: bytes, family_digest: bytes, content_id: bytes, object_key: bytes, salt: bytes, nonce: bytes, sidecar: bytes | None
) -> None:
    """Magic, bindings, salt/nonce, optional sidecar and finally the header digest (which
    covers everything before it) into the first 4096 bytes of ``obj``."""
    obj[0:8] = C.MAGIC_CHUNK
    obj[48:80] = tenant
    obj[80:112] = family_digest
    obj[112:144] = content_id
    obj[144:176] = object_key
    obj[176:192] = salt
    obj[192:204] = nonce
    if sidecar:
        struct.pack_into("<H", obj, C.SIDECAR_OFFSET, len(sidecar))
        obj[238 : 238 + len(sidecar)] = sidecar
    obj[_DIGEST_AT : _DIGEST_AT + 32] = header_digest(obj)


def _content_id_precondition(span: Span) -> None:
    """A content id names at least one token (errata E2-3, S2-12 step 11): a zero-token span
    is a ``semantics`` refusal, never an ``authentication`` mismatch. A validated manifest
    never holds one; callers passing a span directly can."""
    if span.token_count == 0:
        raise fail("semantics", "chunk: span of zero tokens (a content id names at least one token)")


def chunk_structure(obj: bytes | memoryview) -> ChunkHeader:
    """Steps 1-5 of the chunk decode order (no keys needed)."""
    length = len(obj)
    if length < C.HEADER_BYTES or length > C.MAX_CHUNK_OBJECT_BYTES or length % C.ALIGNMENT:
        raise fail("bounds", f"chunk: object length {length}")
    if bytes(obj[0:8]) != C.MAGIC_CHUNK:
        raise fail("bad_magic", f"chunk: magic {bytes(obj[0:8])!r}")
    h = ChunkHeader.parse(obj)
    if (h.version, h.header_bytes, h.alignment) != (1, C.HEADER_BYTES, C.ALIGNMENT):
        raise fail("bad_magic", "chunk: version/header size/alignment")
    if h.flags & ~1:
        raise fail("reserved", f"chunk: unknown flag bits {h.flags:#x}")
    if h.codec not in C.CODECS:
        raise fail("unknown_enum", f"chunk: codec {h.codec}")
    if h.codec_version != C.CODEC_VERSION:
        raise fail("codec", f"chunk: codec_version {h.codec_version}")
    if not 1 <= h.plaintext_bytes <= C.MAX_CHUNK_PLAINTEXT:
        raise fail("bounds", f"chunk: plaintext {h.plaintext_bytes}")
    if not C.CODEC_FRAME_HEADER_BYTES <= h.encoded_bytes <= C.MAX_CHUNK_PLAINTEXT + C.MAX_CODEC_OVERHEAD:
        raise fail("bounds", f"chunk: encoded {h.encoded_bytes}")
    if h.object_bytes != length:
        raise fail("bounds", f"chunk: header says {h.object_bytes} bytes, object has {length}")
    if h.stored_bytes != h.encoded_bytes + (C.AEAD_TAG_BYTES if h.encrypted else 0):
        raise fail("bounds", "chunk: stored payload size inconsistent")
    payload_end = C.HEADER_BYTES + h.stored_bytes
    if payload_end > length:
        raise fail("truncated", "chunk: payload runs past the object")
    if not is_zero(obj[payload_end:]):
        raise fail("reserved", "chunk: nonzero padding")
    side_len = struct.unpack_from("<H", obj, C.SIDECAR_OFFSET)[0]
    tail = bytes(obj[C.SIDECAR_OFFSET + 2 : C.HEADER_BYTES])
    if side_len:
        if side_len > C.MAX_SIDECAR_BYTES:
            raise fail("bounds", f"chunk: sidecar length {side_len}")
        StatsSidecar.decode(tail[:side_len])
        if not is_zero(tail[side_len:]):
            raise fail("reserved", "chunk: nonzero bytes after the sidecar")
    elif not is_zero(tail):
        raise fail("reserved", "chunk: nonzero header tail")
    if not h.encrypted and (h.salt != _ZERO_SALT or h.nonce != _ZERO_NONCE):
        raise fail("reserved", "chunk: salt/nonce set on an unencrypted chunk")
    return h


def decode_chunk(
    obj: bytes | memoryview,
    *,
    ref: ChunkRef,
    span: Span,
    tenant: bytes,
    family: Family,
    key: StateKey,
    keys: Keys,
    family_digest: bytes | None = None,
) -> bytes | memoryview:
    """Verify a chunk object against its manifest ref and return the plaintext (a read-only
    view into ``obj`` for raw unencrypted chunks, bytes otherwise).

    Every check of A.5 runs in the normative order; the first failure raises FormatError.
    ``family_digest`` may be passed to avoid recomputing it per chunk.
    """
    h = chunk_structure(obj)
    _check_ref_sizes(h, obj, ref, span)
    if hashlib.sha256(obj).digest() != ref.object_digest:
        raise fail("authentication", "chunk: object digest differs from the ref")
    return _after_object_digest(obj, h, ref, span, tenant, family, key, keys, family_digest, defer_content=False)


def _check_ref_sizes(h: ChunkHeader, obj: bytes | memoryview, ref: ChunkRef, span: Span) -> None:
    if len(obj) != ref.object_bytes or h.plaintext_bytes != ref.plaintext_bytes or h.plaintext_bytes != span.plaintext_bytes:
        raise fail("bounds", "chunk: size differs from its ref/span")


def _after_object_digest(
    obj: bytes | memoryview,
    h: ChunkHeader,
    ref: ChunkRef,
    span: Span,
    tenant: bytes,
    family: Family,
    key: StateKey,
    keys: Keys,
    family_digest: bytes | None,
    *,
    defer_content: bool,
) -> bytes | memoryview:
    if header_digest(bytes(obj[: C.HEADER_BYTES])) != h.header_digest:
        raise fail("authentication", "chunk: header digest mismatch")
    fam_digest = family_digest if family_digest is not None else family.digest()
    state = family.state(key)
    if state is None or state.codec != h.codec or state.codec_version != h.codec_version:
        raise fail("semantics", f"chunk: state {key} absent from the family or codec differs")
    if h.tenant != tenant or h.family_digest != fam_digest or h.key_epoch != ref.key_epoch:
        raise fail("authentication", "chunk: tenant/family/epoch binding mismatch")
    ks = schedule_for(keys, ref.key_epoch)
    return _open_and_check_content(obj, h, ks, fam_digest, ref, None if defer_content else key, span)


@dataclass(frozen=True)
class DeferredChunk:
    """A raw unencrypted chunk whose every A.5 check has run except the two long hashes.

    :meth:`finish` takes those hashes, computed elsewhere over the very bytes that were
    checked here (kvpack.engine.gpu_digest hashes the device copy of this buffer), and
    applies the remaining comparisons so that the first failure is the one
    :func:`decode_chunk` would have raised: object digest (step 7), then any failure held
    from steps 7-10, then the content ID (step 11)."""

    object_digest: bytes
    content_id: bytes
    plaintext: memoryview | None
    held: FormatError | None

    def finish(self, digests: ExternalDigests) -> memoryview:
        if digests.object_digest != self.object_digest:
            raise fail("authentication", "chunk: object digest differs from the ref")
        if self.held is not None:
            raise self.held
        if digests.content_id != self.content_id:
            raise fail("authentication", "chunk: content id does not match the plaintext")
        assert self.plaintext is not None
        return self.plaintext


def deferrable(obj: bytes | memoryview) -> bool:
    """Whether :func:`decode_chunk_deferred` takes ``obj``: its header declares a raw,
    unencrypted payload (anything else, malformed headers included, goes to
    :func:`decode_chunk`)."""
    if len(obj) < C.HEADER_BYTES or bytes(obj[0:8]) != C.MAGIC_CHUNK:
        return False
    try:
        h = ChunkHeader.parse(obj)
    except (FormatError, struct.error):
        return False
    return h.codec == C.CODEC_RAW and not h.encrypted


def decode_chunk_deferred(
    obj: bytes | memoryview,
    *,
    ref: ChunkRef,
    span: Span,
    tenant: bytes,
    family: Family,
    key: StateKey,
    keys: Keys,
    family_digest: bytes | None = None,
) -> DeferredChunk:
    """Run every check of :func:`decode_chunk` on a raw unencrypted chunk except the object
    SHA-256 and the content-ID HMAC. Steps 1-6 raise here; failures of later steps are held
    in the result (they may only be reported after the object digest, step 7). Raises
    ValueError for a chunk :func:`deferrable` refuses."""
    h = chunk_structure(obj)
    _check_ref_sizes(h, obj, ref, span)
    if h.encrypted or h.codec != C.CODEC_RAW:
        raise ValueError("only raw unencrypted chunks can be verified with external digests")
    plaintext: memoryview | None = None
    held: FormatError | None = None
    try:
        checked = _after_object_digest(obj, h, ref, span, tenant, family, key, keys, family_digest, defer_content=True)
        plaintext = checked if isinstance(checked, memoryview) else memoryview(checked)  # raw frames decode to a view
    except FormatError as exc:
        held = exc
    return DeferredChunk(ref.object_digest, h.content_id, plaintext, held)


#: Bytes of the plaintext each of the two hashes of :func:`decode_chunk_one_pass` reads in
#: turn: small enough that the second hash finds them in the core's cache (the pass then
#: costs about 1.45x one hash, not 2x: docs/bench/store_profile.md), large enough that the
#: GIL is released and retaken only every few tens of microseconds (with many threads those
#: handoffs add up: ``RestoreTuning.one_pass_block`` sets it per restore).
ONE_PASS_BLOCK = 64 * 1024


def decode_chunk_one_pass(
    obj: bytes | memoryview,
    *,
    ref: ChunkRef,
    span: Span,
    tenant: bytes,
    family: Family,
    key: StateKey,
    keys: Keys,
    family_digest: bytes | None = None,
    block: int = ONE_PASS_BLOCK,
) -> bytes | memoryview:
    """:func:`decode_chunk` for a host verifier: same checks, same first refusal, same
    result; a raw unencrypted chunk's two long hashes (object SHA-256, content-ID HMAC) are
    computed in one pass over the object, ``block`` bytes at a time (default
    :data:`ONE_PASS_BLOCK`; 0: one pass each, exactly :func:`decode_chunk`), instead of one
    pass each. Anything else is handed to :func:`decode_chunk`."""
    if block <= 0 or not deferrable(obj):
        return decode_chunk(obj, ref=ref, span=span, tenant=tenant, family=family, key=key, keys=keys, family_digest=family_digest)
    try:
        chunk_key = schedule_for(keys, ref.key_epoch).chunk_identity
    except FormatError:
        # refused after the object digest in the normative order: decode_chunk says which
        return decode_chunk(obj, ref=ref, span=span, tenant=tenant, family=family, key=key, keys=keys, family_digest=family_digest)
    deferred = decode_chunk_deferred(obj, ref=ref, span=span, tenant=tenant, family=family, key=key, keys=keys, family_digest=family_digest)
    view = memoryview(obj).cast("B")
    start = C.HEADER_BYTES + C.CODEC_FRAME_HEADER_BYTES
    stop = start + span.plaintext_bytes if deferred.plaintext is not None else start
    obj_hash = hashlib.sha256(view[:start])
    content = None
    if deferred.plaintext is not None:
        fam = family_digest if family_digest is not None else family.digest()
        prefix = chunk_content_prefix(tenant, fam, key.layer, key.name, span.token_start, span.token_count, span.plaintext_offset, span.plaintext_bytes)
        content = hmac.new(chunk_key, prefix, hashlib.sha256)
    for at in range(start, stop, block):
        piece = view[at : min(at + block, stop)]
        obj_hash.update(piece)
        if content is not None:
            content.update(piece)
    obj_hash.update(view[stop:])
    # a held refusal makes finish raise before it reads the content id
    return deferred.finish(ExternalDigests(obj_hash.digest(), content.digest() if content is not None else b""))


def _open_and_check_content(
    obj: bytes | memoryview, h: ChunkHeader, ks: KeySchedule, fam_digest: bytes, ref: ChunkRef, key: StateKey | None, span: Span | None
) -> bytes | memoryview:
    expect_key = chunk_object_key(
        ks.object_identity, h.tenant, fam_digest, h.content_id, ref.key_epoch, h.codec, h.codec_version, h.encrypted, h.salt, h.nonce, h.sidecar or None
    )
    if h.content_id != ref.content_id or h.object_key != ref.object_key or h.object_key != expect_key:
        raise fail("authentication", "chunk: content id / object key mismatch")
    payload = memoryview(obj)[C.HEADER_BYTES : C.HEADER_BYTES + h.stored_bytes]
    if h.encrypted:
        data_key = chunk_data_key(ks.chunk_encryption, h.salt, h.content_id, h.object_key)
        frame: bytes | memoryview = open_sealed(data_key, h.nonce, payload, bytes(obj[: C.HEADER_BYTES]), "chunk")
    else:
        frame = payload
    plaintext = decode_frame(h.codec, frame, h.plaintext_bytes)
    if span is not None:
        _content_id_precondition(span)
    if key is not None and span is not None:
        content = chunk_content_id(
            ks.chunk_identity, h.tenant, fam_digest, key.layer, key.name, span.token_start, span.token_count, span.plaintext_offset, plaintext
        )
        if content != h.content_id:
            raise fail("authentication", "chunk: content id does not match the plaintext")
    return plaintext


def verify_chunk_standalone(obj: bytes | memoryview, keys: Keys) -> tuple[ChunkHeader, bytes | memoryview]:
    """Verify what a chunk can prove without its manifest: structure, header digest, object
    key, AEAD tag and frame. The ref binding (object digest) and the content id need the
    manifest's ref and span; use :func:`decode_chunk` for those."""
    h = chunk_structure(obj)
    if header_digest(bytes(obj[: C.HEADER_BYTES])) != h.header_digest:
        raise fail("authentication", "chunk: header digest mismatch")
    ks = schedule_for(keys, h.key_epoch)
    self_ref = ChunkRef(h.content_id, h.object_key, b"", h.key_epoch, h.plaintext_bytes, len(obj))
    plaintext = _open_and_check_content(obj, h, ks, h.family_digest, self_ref, None, None)
    return h, plaintext
