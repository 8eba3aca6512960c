"""kvpack production-v1 durable format: pure codecs (bytes in, objects/bytes out).

No files, sockets, clocks or randomness inside: salts, nonces and keys are passed in.
Every decoder consumes its input exactly, re-encodes and compares, and refuses with a
:class:`kvpack.errors.FormatError` carrying one of the ten normative categories.

This package must never do I/O, read a clock or draw randomness, and never return an object it
has not fully verified.
"""

from .chunk import ChunkHeader, EncodedChunk, KeyRing, decode_chunk, encode_chunk, verify_chunk_standalone
from .codec import decode_frame, encode_frame
from .identity import (
    InputCutId,
    PrefixChain,
    SemanticModelId,
    auxiliary_root,
    chunk_content_id,
    chunk_object_key,
    namespace_id,
    prefix_context,
)
from .keys import KeySchedule
from .objects import (
    AtomicGroup,
    ChunkRef,
    DeltaParent,
    Family,
    FamilyState,
    Manifest,
    PayloadState,
    RealizedState,
    Schema,
    Span,
    StateDeclaration,
    StateKey,
)
from .pack import decode_pack, encode_pack, pack_structure
from .sidecar import StatsSidecar
from .validate import validate_family, validate_manifest

__all__ = [
    "AtomicGroup",
    "ChunkHeader",
    "ChunkRef",
    "DeltaParent",
    "EncodedChunk",
    "Family",
    "FamilyState",
    "InputCutId",
    "KeyRing",
    "KeySchedule",
    "Manifest",
    "PayloadState",
    "PrefixChain",
    "RealizedState",
    "Schema",
    "SemanticModelId",
    "Span",
    "StateDeclaration",
    "StateKey",
    "StatsSidecar",
    "auxiliary_root",
    "chunk_content_id",
    "chunk_object_key",
    "decode_chunk",
    "decode_frame",
    "decode_pack",
    "encode_chunk",
    "encode_frame",
    "encode_pack",
    "namespace_id",
    "pack_structure",
    "prefix_context",
    "validate_family",
    "validate_manifest",
    "verify_chunk_standalone",
]
