"""Codec frames (INTEROP.md A.4, errata S2-11, S3-8): raw (KVRAW1) and lossless (KVRLE1).

The lossless codec is PackBits-like but *not* classic PackBits: control ``c`` encodes
``len = (c & 0x7f) + 1``; bit 7 clear = ``len`` literal bytes follow, bit 7 set = one byte
repeated ``len`` times. The canonical encoder is unique, so decoders re-encode and compare.

Both directions are vectorised with numpy: Python loops run per *run of >= 3 equal bytes*
(encoder) or per packet (decoder), never per byte.
"""

from __future__ import annotations

import struct

import numpy as np

from . import constants as C
from .wire import fail

_HDR = struct.Struct("<8sHHI")
_MAGIC_BY_CODEC = {C.CODEC_RAW: C.MAGIC_RAW, C.CODEC_LOSSLESS: C.MAGIC_LOSSLESS}


def frame_header(codec: int, decoded: int) -> bytes:
    """The 16-byte frame header for ``decoded`` plaintext bytes."""
    return _HDR.pack(_MAGIC_BY_CODEC[codec], 1, 0, decoded)


def _literal_packets(seg: np.ndarray) -> np.ndarray:
    """Split a literal stretch into 128-byte literal packets (control byte + bytes)."""
    m = seg.size
    full, rest = divmod(m, 128)
    pieces = []
    if full:
        body = seg[: full * 128].reshape(full, 128)
        ctrl = np.full((full, 1), 127, dtype=np.uint8)
        pieces.append(np.hstack([ctrl, body]).ravel())
    if rest:
        pieces.append(np.concatenate([np.array([rest - 1], dtype=np.uint8), seg[full * 128 :]]))
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def packbits_encode(data: bytes | memoryview) -> bytes:
    """The canonical lossless packet stream of ``data`` (no frame header)."""
    arr = np.frombuffer(data, dtype=np.uint8)
    n = arr.size
    if n == 0:
        return b""
    # maximal runs of equal bytes
    change = np.flatnonzero(arr[1:] != arr[:-1]) + 1
    starts = np.concatenate(([0], change))
    lengths = np.diff(np.concatenate((starts, [n])))
    long_idx = np.flatnonzero(lengths >= 3)
    out: list[np.ndarray | bytes] = []
    lit_start = 0
    for idx in long_idx.tolist():
        s = int(starts[idx])
        length = int(lengths[idx])
        if s > lit_start:
            out.append(_literal_packets(arr[lit_start:s]))
        value = int(arr[s])
        full, rest = divmod(length, 128)
        if full:
            out.append(bytes((0xFF, value)) * full)
        if rest >= 3:
            out.append(bytes((0x80 | (rest - 1), value)))
            lit_start = s + length
        else:
            # a 1- or 2-byte remainder is not a run: it opens the next literal
            lit_start = s + length - rest
    if lit_start < n:
        out.append(_literal_packets(arr[lit_start:]))
    return b"".join(bytes(p) if isinstance(p, np.ndarray) else p for p in out)


def packbits_decode(payload: bytes | memoryview, expected: int) -> bytes:
    """Decode a packet stream to exactly ``expected`` bytes (errata S2-11 categories)."""
    src = bytes(payload)
    out = bytearray()
    pos = 0
    end = len(src)
    while pos < end:
        c = src[pos]
        pos += 1
        length = (c & 0x7F) + 1
        if c & 0x80:
            if pos >= end:
                raise fail("truncated", "lossless frame: repeat packet without its value byte")
            if len(out) + length > expected:
                raise fail("bounds", "lossless frame: output exceeds decoded_bytes")
            out += bytes((src[pos],)) * length
            pos += 1
        else:
            if pos + length > end:
                raise fail("truncated", "lossless frame: literal runs past the end")
            if len(out) + length > expected:
                raise fail("bounds", "lossless frame: output exceeds decoded_bytes")
            out += src[pos : pos + length]
            pos += length
    if len(out) != expected:
        raise fail("bounds", f"lossless frame: decoded {len(out)} bytes, expected {expected}")
    return bytes(out)


def encode_frame(codec: int, plaintext: bytes | memoryview) -> bytes:
    if codec not in _MAGIC_BY_CODEC:
        raise fail("unknown_enum", f"codec {codec}")
    n = len(plaintext)
    if not 1 <= n <= C.MAX_CHUNK_PLAINTEXT:
        raise fail("bounds", f"frame plaintext {n} bytes outside 1..4 MiB")
    body = bytes(plaintext) if codec == C.CODEC_RAW else packbits_encode(plaintext)
    return frame_header(codec, n) + body


def decode_frame(codec: int, frame: bytes | memoryview, expected: int) -> bytes | memoryview:
    """Decode a frame to exactly ``expected`` plaintext bytes, refusing any non-canonical form.

    A raw frame's plaintext is returned as a read-only view into ``frame`` (no copy: the
    restore path hands it straight to the engine's install)."""
    if len(frame) < C.CODEC_FRAME_HEADER_BYTES:
        raise fail("truncated", f"frame: {len(frame)} bytes, shorter than its header")
    magic, version, reserved, decoded = _HDR.unpack_from(frame, 0)
    if magic != _MAGIC_BY_CODEC.get(codec):
        raise fail("bad_magic", f"frame: magic {magic!r} for codec {codec}")
    if version != 1:
        raise fail("bad_magic", f"frame: version {version}")
    if reserved:
        raise fail("reserved", "frame: reserved field set")
    if decoded != expected or not 1 <= expected <= C.MAX_CHUNK_PLAINTEXT:
        raise fail("bounds", f"frame: decoded_bytes {decoded}, expected {expected}")
    body = memoryview(frame)[C.CODEC_FRAME_HEADER_BYTES :]
    if codec == C.CODEC_RAW:
        if len(body) != expected:
            raise fail("bounds", f"raw frame: {len(body)} payload bytes, expected {expected}")
        return body.toreadonly()
    plaintext = packbits_decode(body, expected)
    if packbits_encode(plaintext) != body:
        raise fail("reserved", "lossless frame: not the canonical encoding")
    return plaintext


def reference_packbits_encode(data: bytes) -> bytes:
    """Byte-at-a-time transcription of the A.4 encoder rule, used only as a test oracle for the
    vectorised encoder (small inputs)."""
    out = bytearray()
    i, n = 0, len(data)

    def run_at(j: int) -> int:
        k = j + 1
        while k < n and k - j < 128 and data[k] == data[j]:
            k += 1
        return k - j

    while i < n:
        run = run_at(i)
        if run >= 3:
            out += bytes((0x80 | (run - 1), data[i]))
            i += run
            continue
        start = i
        lit = 0
        while i < n and lit < 128:
            run = run_at(i)
            if run >= 3:
                break
            take = min(run, 128 - lit)
            lit += take
            i += take
        out.append(lit - 1)
        out += data[start : start + lit]
    return bytes(out)
