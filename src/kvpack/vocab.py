"""Shared vocabulary: the few words every kvpack package must say the same way.

Why it exists: the 256-token alignment, SHA-256 hex digests, 64-hex ids, strict JSON and the
flock-based single-writer lock were each written three or four times, and copies drift (a
``^...$`` regex also accepts a trailing newline; one strict loader forgot NaN). Each has one
definition here and every package uses it.

What it must never do: import another kvpack package (everything imports this), raise a
package's typed error (callers turn :class:`StrictJsonError` and :class:`LockHeld` into their
own category, with their own words), or write data (durable writes belong to
:mod:`kvpack.durable`; a lock file holds at most the holder's pid, for messages).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
from typing import Any, NoReturn

# -- token alignment ---------------------------------------------------------------------------

#: The one token alignment of the whole system: production-v1 prefix-chain blocks
#: (``PREFIX_BLOCK_TOKENS``), Handoff V2 delta cuts (upstream ``PREFIX_CUT_ALIGN``), reusable
#: checkpoints and transfer tiles are all multiples of it.
TOKEN_ALIGN = 256


def is_token_aligned(tokens: int) -> bool:
    """Whether ``tokens`` is a multiple of :data:`TOKEN_ALIGN` (0 is aligned)."""
    return tokens % TOKEN_ALIGN == 0


def align_tokens_down(tokens: int) -> int:
    """The largest multiple of :data:`TOKEN_ALIGN` that is at most ``tokens``."""
    return tokens - tokens % TOKEN_ALIGN


# -- digests and ids ---------------------------------------------------------------------------


def sha256_hex(data: bytes | bytearray | memoryview | str) -> str:
    """Lowercase hex SHA-256 of ``data`` (a ``str`` is hashed as its UTF-8 bytes)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


#: 64 lowercase hex digits: a SHA-256 digest, a pin, an identity field. Use it with
#: ``fullmatch`` (``is_hex64``): ``$`` would also accept a trailing newline.
HEX64 = re.compile(r"[0-9a-f]{64}")


def is_hex64(value: object) -> bool:
    """Whether ``value`` is a ``str`` of exactly 64 lowercase hex digits."""
    return isinstance(value, str) and HEX64.fullmatch(value) is not None


# -- strict JSON -------------------------------------------------------------------------------


class StrictJsonError(ValueError):
    """Input that strict JSON refuses (the caller maps it to its own error category)."""


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` refusing a key that appears twice in one object."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise StrictJsonError(f"duplicate key {key!r}")
        out[key] = value
    return out


def reject_constant(name: str) -> NoReturn:
    """``parse_constant`` refusing ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""
    raise StrictJsonError(f"{name} is not JSON")


def strict_json_loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON, refusing invalid UTF-8, duplicate keys and NaN/Infinity.

    Raises :class:`StrictJsonError` (a ``ValueError``) for every refusal -- nesting deeper
    than the interpreter's recursion limit too (``[[[...`` of a few KiB), which ``json.loads``
    reports as ``RecursionError``: callers catch ``ValueError``, and an uncaught one killed
    the local API's request thread without a reply."""
    try:
        text = data if isinstance(data, str) else bytes(data).decode("utf-8")
        return json.loads(text, object_pairs_hook=reject_duplicate_keys, parse_constant=reject_constant)
    except StrictJsonError:
        raise
    except RecursionError:
        raise StrictJsonError("JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise StrictJsonError(str(exc)) from None


# -- single-writer lock ------------------------------------------------------------------------


class LockHeld(OSError):
    """Another open file description holds the lock (``holder_pid`` when it wrote one)."""

    def __init__(self, path: str, holder_pid: int | None) -> None:
        super().__init__(f"{path} is locked by another holder" + (f" (pid {holder_pid})" if holder_pid else ""))
        self.path = path
        self.holder_pid = holder_pid


class FileLock:
    """An ``flock`` on ``path`` (created 0600, never followed through a symlink): exclusive by
    default, shared when ``shared``; a non-blocking acquire raises :class:`LockHeld` at once.

    The lock lives as long as the descriptor: :meth:`release` (or leaving the ``with`` block,
    or process death) frees it. With ``record_pid`` the holder writes its pid into the file so
    that a refused second holder can say who has it (informational: not fsynced).
    """

    def __init__(self, path: str, *, shared: bool = False, blocking: bool = False, record_pid: bool = False) -> None:
        self.path = path
        self.shared = shared
        self.blocking = blocking
        self.record_pid = record_pid
        self.fd = -1

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def acquire(self) -> "FileLock":
        """Take the lock; raises :class:`LockHeld`, or ``OSError`` if the file cannot be opened."""
        if self.held:
            raise RuntimeError(f"lock {self.path} already held by this object")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags, 0o600)
        mode = (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | (0 if self.blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, mode)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise LockHeld(self.path, holder) from None
            raise
        if self.record_pid:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        """Free the lock (closing the descriptor releases the flock); idempotent."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> "FileLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


__all__ = [
    "TOKEN_ALIGN",
    "is_token_aligned",
    "align_tokens_down",
    "sha256_hex",
    "HEX64",
    "is_hex64",
    "StrictJsonError",
    "reject_duplicate_keys",
    "reject_constant",
    "strict_json_loads",
    "LockHeld",
    "FileLock",
]
