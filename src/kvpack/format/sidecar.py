"""Stats sidecar (KVSSC1, INTEROP.md A.7, errata S2-17, S3-10, S3-11).

An optional summary carried in the chunk header tail: per-channel f16 min/max, per-token f16
L2 norms, and the top-m "sink" tokens by norm. Its SHA-256 (without the u16 length prefix)
is bound into the chunk's object key.

It must never accept a sidecar that would not re-encode to the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import constants as C
from .wire import Reader, check_header, fail, header, u16, u32


def _half(bits: int) -> float:
    return float(np.array([bits], dtype="<u2").view("<f2")[0])


@dataclass(frozen=True)
class StatsSidecar:
    channel_ranges: tuple[tuple[int, int], ...]  # (min bits, max bits) per channel
    token_norms: tuple[int, ...]  # f16 bits per token
    sinks: tuple[tuple[int, int], ...]  # (token index, score bits)

    def encode(self) -> bytes:
        parts = [header(C.MAGIC_SIDECAR), u32(len(self.channel_ranges))]
        parts += [u16(lo) + u16(hi) for lo, hi in self.channel_ranges]
        parts += [u32(len(self.token_norms))]
        parts += [u16(v) for v in self.token_norms]
        parts += [u16(len(self.sinks))]
        parts += [u32(i) + u16(s) + u16(0) for i, s in self.sinks]
        return b"".join(parts)

    @staticmethod
    def top_sinks(norms: tuple[int, ...], m: int) -> tuple[tuple[int, int], ...]:
        # order by descending *value* (so -0.0 ties +0.0), then ascending index
        order = sorted(range(len(norms)), key=lambda i: (-_half(norms[i]), i))
        return tuple((i, norms[i]) for i in order[:m])

    @classmethod
    def decode(cls, data: bytes | memoryview) -> "StatsSidecar":
        if len(data) > C.MAX_SIDECAR_BYTES:
            raise fail("bounds", f"sidecar: {len(data)} bytes exceeds {C.MAX_SIDECAR_BYTES}")
        r = Reader(bytes(data), "sidecar")
        check_header(r, C.MAGIC_SIDECAR, "sidecar")
        nch = r.count(4, 1, 512, "channel count")
        ranges = []
        for ch in range(nch):
            lo, hi = r.u16(), r.u16()
            a, b = _half(lo), _half(hi)
            if not (math.isfinite(a) and math.isfinite(b) and a <= b):
                raise fail("semantics", f"sidecar: channel {ch} range invalid")
            ranges.append((lo, hi))
        ntok = r.count(4, 1, 768, "token count")
        norms = []
        for t in range(ntok):
            v = r.u16()
            f = _half(v)
            if not math.isfinite(f) or f < 0:
                raise fail("semantics", f"sidecar: token {t} norm invalid")
            norms.append(v)
        nsink = r.count(2, 1, 8, "sink count")
        sinks = []
        for _ in range(nsink):
            idx, score = r.u32(), r.u16()
            r.zero(2, "sink reserved")
            sinks.append((idx, score))
        r.end()
        norms_t = tuple(norms)
        if nsink > ntok or tuple(sinks) != cls.top_sinks(norms_t, nsink):
            raise fail("semantics", "sidecar: sinks are not the top-m norms")
        out = cls(tuple(ranges), norms_t, tuple(sinks))
        if out.encode() != bytes(data):
            raise fail("reserved", "sidecar: re-encoding differs")
        return out

    @classmethod
    def from_f16(cls, plaintext: bytes, channels: int, sinks: int) -> "StatsSidecar":
        """Build a sidecar from token-major f16 rows (errata S3-11 arithmetic)."""
        values = np.frombuffer(plaintext, dtype="<f2").reshape(-1, channels)
        lo = values.min(axis=0).astype("<f2").view("<u2")
        hi = values.max(axis=0).astype("<f2").view("<u2")
        norms64 = np.sqrt((values.astype(np.float64) ** 2).sum(axis=1))
        norms = norms64.astype(np.float32).astype("<f2").view("<u2")
        norm_bits = tuple(int(v) for v in norms)
        return cls(
            tuple((int(a), int(b)) for a, b in zip(lo, hi)),
            norm_bits,
            cls.top_sinks(norm_bits, min(sinks, len(norm_bits))),
        )
