"""Production-v1 constants: magics, bounds, enums and domain strings (INTEROP.md A.0, PART E).

Values only; never logic, never a second definition of a shared word (the token alignment comes
from :mod:`kvpack.vocab`).
"""

from __future__ import annotations

from ..vocab import TOKEN_ALIGN

WIRE_VERSION = 1
ALIGNMENT = 4096
HEADER_BYTES = 4096
MAX_CHUNK_PLAINTEXT = 4 * 1024 * 1024
CODEC_FRAME_HEADER_BYTES = 16
MAX_CODEC_OVERHEAD = 16 + (MAX_CHUNK_PLAINTEXT + 127) // 128  # 32,784
AEAD_TAG_BYTES = 16
MAX_CHUNK_OBJECT_BYTES = HEADER_BYTES + MAX_CHUNK_PLAINTEXT + MAX_CODEC_OVERHEAD + AEAD_TAG_BYTES + HEADER_BYTES
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_RANK = 8
MAX_STATES = 65_536
MAX_ATOMIC_GROUPS = 65_536
MAX_CHUNKS_PER_STATE = 65_536
MAX_DEPENDENCIES_PER_STATE = 64
MAX_STATE_NAME_BYTES = 255
MAX_DELTA_DEPTH = 7
PREFIX_BLOCK_TOKENS = TOKEN_ALIGN  # the prefix chain's block (kvpack.vocab: one alignment everywhere)
DEFAULT_MAX_RESTORED_BYTES = 4 * 1024**4
MAX_SIDECAR_BYTES = 3858
SIDECAR_OFFSET = 236

MAGIC_PACK = b"KVPKP1\0\0"
MAGIC_COMMIT = b"KVCMT1\0\0"
MAGIC_CHUNK = b"KVCHK1\0\0"
MAGIC_MANIFEST = b"KVMNF1\0\0"
MAGIC_FAMILY = b"KVFAM1\0\0"
MAGIC_SCHEMA = b"KVRCS1\0\0"
MAGIC_STATE = b"KVSTS1\0\0"
MAGIC_RAW = b"KVRAW1\0\0"
MAGIC_LOSSLESS = b"KVRLE1\0\0"
MAGIC_SIDECAR = b"KVSSC1\0\0"

# Legacy / development-era magics: any of them (indeed any non-current magic) is bad_magic.
LEGACY_MAGICS = (
    b"IOKVPK1\0",
    b"IOKVREC\0",
    b"IOKVCM1\0",
    b"IOKVFTR\0",
    b"IOKVLZ1\0",
    b"IOKVQ81\0",
    b"IOKVENC\0",
)

CACHE_KIND_ORDINARY = 1
CODEC_RAW = 1
CODEC_LOSSLESS = 2
CODECS = (CODEC_RAW, CODEC_LOSSLESS)
CODEC_VERSION = 1
LAYOUT_CONTIGUOUS = 1
LAYOUT_STRIDED = 2
MODE_NATIVE = 1
MODE_PORTABLE = 2
AXIS_DIRECT = 1
AXIS_GATHER = 2
# TailWindow (3) exists in the Rust code but the Python reference refuses it: so do we.
KIND_FULL = 0
KIND_DELTA = 1

# dtype wire value -> element width in bytes
DTYPE_WIDTHS = {1: 1, 2: 4, 3: 1, 4: 2, 5: 4, 6: 2, 7: 2, 8: 4, 9: 8}
DTYPE_NAMES = {1: "u8", 2: "u32", 3: "i8", 4: "i16", 5: "i32", 6: "f16", 7: "bf16", 8: "f32", 9: "f64"}
DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}

ZERO32 = bytes(32)

# Message domains (NUL-terminated, prefixed to the hashed/HMACed message).
D_NAMESPACE = b"kvpack/v1/namespace\0"
D_SEMANTIC = b"kvpack/v1/semantic-model\0"
D_FAMILY = b"kvpack/v1/representation-family\0"
D_SCHEMA = b"kvpack/v1/realized-cut-schema\0"
D_MANIFEST = b"kvpack/v1/manifest\0"
D_AUX_ROOT = b"kvpack/v1/auxiliary-input-root\0"
D_PREFIX_CONTEXT = b"kvpack/v1/prefix-context\0"
D_PREFIX_ROOT = b"kvpack/v1/prefix-root\0"
D_PREFIX_NODE = b"kvpack/v1/prefix-node\0"
D_CHUNK_CONTENT = b"kvpack/v1/chunk-content\0"
D_CHUNK_OBJECT = b"kvpack/v1/chunk-object\0"
D_CHUNK_OBJECT_STATS = b"kvpack/v1/chunk-object-stats\0"
D_MANIFEST_AUTH = b"kvpack/v1/manifest-auth\0"
D_MANIFEST_AEAD = b"kvpack/v1/manifest-aead\0"
D_CHUNK_AEAD = b"kvpack/v1/chunk-aead\0"
