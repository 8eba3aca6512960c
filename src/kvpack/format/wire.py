"""Little-endian wire primitives with exact-consumption readers.

A :class:`Reader` raises ``FormatError("truncated")`` on any read past the end and
``FormatError("reserved")`` when bytes are left over; range checks on counts are done by the
callers the moment a count is read (INTEROP-A-ERRATA S2-10), via :meth:`Reader.count`.

It must never read past the end or leave bytes unconsumed without refusing.
"""

from __future__ import annotations

import hashlib
import struct

from ..errors import FormatError

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
U64_MAX = (1 << 64) - 1


def fail(category: str, message: str) -> FormatError:
    return FormatError(category, message)


def u8(v: int) -> bytes:
    return bytes((v,))


def u16(v: int) -> bytes:
    return _U16.pack(v)


def u32(v: int) -> bytes:
    return _U32.pack(v)


def u64(v: int) -> bytes:
    return _U64.pack(v)


class Reader:
    __slots__ = ("_buf", "_pos", "_end", "what")

    def __init__(self, data: bytes | bytearray | memoryview, what: str = "object") -> None:
        self._buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        self._pos = 0
        self._end = len(data)
        self.what = what

    @property
    def pos(self) -> int:
        return self._pos

    def remaining(self) -> int:
        return self._end - self._pos

    def take(self, n: int) -> bytes:
        if n > self._end - self._pos:
            raise fail("truncated", f"{self.what}: need {n} bytes at offset {self._pos}, have {self._end - self._pos}")
        start = self._pos
        self._pos += n
        return bytes(self._buf[start : self._pos])

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "little")

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")

    def id32(self) -> bytes:
        return self.take(32)

    def count(self, width: int, lo: int, hi: int, name: str) -> int:
        """Read a u8/u16/u32 count and range-check it immediately (bounds)."""
        value = {1: self.u8, 2: self.u16, 4: self.u32}[width]()
        if not lo <= value <= hi:
            raise fail("bounds", f"{self.what}: {name} {value} outside {lo}..{hi}")
        return value

    def zero(self, width: int, name: str) -> None:
        value = {1: self.u8, 2: self.u16, 4: self.u32, 8: self.u64}[width]()
        if value:
            raise fail("reserved", f"{self.what}: reserved field {name} is {value}")

    def end(self) -> None:
        if self._pos != self._end:
            raise fail("reserved", f"{self.what}: {self._end - self._pos} trailing bytes")


def check_header(r: Reader, magic: bytes, what: str) -> None:
    """Standalone-object preamble: magic, u16 version 1, u16 reserved 0 (errata 4.1)."""
    if r.remaining() < 8:
        raise fail("truncated", f"{what}: {r.remaining()} bytes, shorter than the magic")
    got = r.take(8)
    if got != magic:
        raise fail("bad_magic", f"{what}: magic {got!r}")
    version = r.u16()
    if version != 1:
        raise fail("bad_magic", f"{what}: version {version}")
    r.zero(2, "header")


def header(magic: bytes) -> bytes:
    return magic + u16(1) + u16(0)


def checked_mul(*factors: int) -> int:
    """Product with u64 overflow refused as bounds."""
    out = 1
    for f in factors:
        out *= f
        if out > U64_MAX:
            raise fail("bounds", "u64 overflow")
    return out


def checked_add(a: int, b: int) -> int:
    out = a + b
    if out > U64_MAX:
        raise fail("bounds", "u64 overflow")
    return out


def digest_with_zeroed(header: bytes | bytearray | memoryview, at: int, length: int = 4096) -> bytes:
    """SHA-256 of ``header[:length]`` with its own 32-byte digest field at ``at`` zeroed (the
    chunk and pack headers both carry a self-digest)."""
    view = memoryview(header)
    h = hashlib.sha256()
    h.update(view[:at])
    h.update(bytes(32))
    h.update(view[at + 32 : length])
    return h.digest()
