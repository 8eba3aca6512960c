"""Loading files whose contents must not be attacker-influenced: private keys, HMAC keys, the ledger.

The contract (INTEROP.md C.10, INTEROP-C-ERRATA L10/M7) is checked in an order that closes the
validate-then-reopen race:

1. ``lstat`` the path: it must exist, must not be a symlink, must be a regular file, must have no
   group/other permission bits and must not exceed the size bound;
2. open it with ``O_NOFOLLOW`` (so a symlink swapped in after step 1 fails with ELOOP);
3. ``fstat`` the descriptor and require the same device and inode as step 1 (a file *replaced*
   after step 1 is refused), then re-check type, mode and size on what was actually opened;
4. read at most ``max_size + 1`` bytes, so a file that grew after the checks is still refused.

Every violation raises :class:`~kvpack.errors.SecurityError` with its own message, so an operator
reading the refusal knows exactly which rule the file broke and how to fix it. The category is
``secret_file`` for keys; the replay ledger reuses the same reader under category ``ledger``.

HMAC key files (C.10, errata M7, Rust rule): exactly 32 bytes is a raw key; anything else must be
UTF-8 which, after trimming trailing ``\\r``/``\\n`` only, is exactly 64 *lowercase* hex digits.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from ..errors import SecurityError

#: C.10: HMAC key files larger than this are refused.
HMAC_KEY_MAX_BYTES = 4096
#: INTEROP-C-ERRATA L10: the TLS private key follows the key-file rules with a 1 MiB bound.
PRIVATE_KEY_MAX_BYTES = 1 << 20
HMAC_KEY_BYTES = 32

_HEX_LOWER = frozenset("0123456789abcdef")
_HEX_ANY = frozenset("0123456789abcdefABCDEF")

#: Test hook type: called with the path after the lstat checks and before open, so a test can
#: swap the file in that window exactly as an attacker racing the loader would.
BeforeOpenHook = Callable[[str], None]


def read_protected_file(
    path: str | os.PathLike[str],
    *,
    what: str,
    max_size: int,
    category: str = "secret_file",
    before_open: BeforeOpenHook | None = None,
) -> bytes:
    """Read ``path`` under the protected-file contract; return its bytes.

    ``what`` names the file in messages ("HMAC key file", "TLS private key", ...).
    """
    p = os.fspath(path)

    def refuse(reason: str) -> SecurityError:
        return SecurityError(category, f"{what} {p!r} {reason}")

    try:
        before = os.lstat(p)
    except FileNotFoundError:
        raise refuse("does not exist") from None
    except OSError as exc:
        raise refuse(f"cannot be inspected: {exc.strerror}") from None
    _check_stat(before, refuse, max_size, symlink_possible=True)

    if before_open is not None:
        before_open(p)

    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    # O_NONBLOCK: if a FIFO was swapped in, open must not hang waiting for a writer; the fstat
    # below refuses it anyway.
    flags |= getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise refuse("disappeared between lstat and open") from None
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", 40):
            raise refuse("became a symlink between lstat and open (opened with O_NOFOLLOW)") from None
        raise refuse(f"cannot be opened: {exc.strerror}") from None
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise refuse("was replaced between lstat and open (device/inode changed); refusing a file that changes while it is being loaded")
        _check_stat(after, refuse, max_size, symlink_possible=False)
        chunks: list[bytes] = []
        remaining = max_size + 1
        while remaining > 0:
            piece = os.read(fd, min(remaining, 1 << 16))
            if not piece:
                break
            chunks.append(piece)
            remaining -= len(piece)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_size:
        raise refuse(f"grew beyond the {max_size}-byte limit while being read")
    return data


def _check_stat(st: os.stat_result, refuse, max_size: int, *, symlink_possible: bool) -> None:
    mode = st.st_mode
    if symlink_possible and stat.S_ISLNK(mode):
        raise refuse("is a symlink; key and ledger files must be regular files, not links")
    if not stat.S_ISREG(mode):
        raise refuse("is not a regular file")
    if mode & 0o077:
        raise refuse(f"has group/other permission bits (mode {stat.S_IMODE(mode):04o}); it must be readable by its owner only: chmod 600")
    if st.st_size > max_size:
        raise refuse(f"is {st.st_size} bytes, larger than the {max_size}-byte limit")


def parse_hmac_key(data: bytes, *, source: str = "HMAC key file") -> bytes:
    """Apply the C.10 Rust rule to the bytes of a key file; return the 32-byte key."""
    if len(data) == HMAC_KEY_BYTES:
        return bytes(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecurityError(
            "secret_file",
            f"{source} is {len(data)} bytes and not UTF-8: it must hold exactly 32 raw bytes or 64 lowercase hex digits",
        ) from None
    # Only trailing CR/LF is trimmed (Rust trim_end_matches); leading or inner whitespace is an
    # error, so a key file that the receiver accepts is accepted by every producer too (M7).
    text = text.rstrip("\r\n")
    if len(text) != 2 * HMAC_KEY_BYTES:
        raise SecurityError(
            "secret_file",
            f"{source} holds {len(data)} bytes ({len(text)} characters after trimming trailing "
            "newlines): it must hold exactly 32 raw bytes or 64 lowercase hex digits",
        )
    chars = set(text)
    if not chars <= _HEX_ANY:
        raise SecurityError("secret_file", f"{source} has 64 characters but they are not all hex digits")
    if not chars <= _HEX_LOWER:
        raise SecurityError(
            "secret_file",
            f"{source} uses uppercase hex digits; the key must be written in lowercase hex",
        )
    return bytes.fromhex(text)


def load_hmac_key(path: str | os.PathLike[str], *, before_open: BeforeOpenHook | None = None) -> bytes:
    """Load a 32-byte HMAC key from a key file under the full C.10 contract."""
    data = read_protected_file(path, what="HMAC key file", max_size=HMAC_KEY_MAX_BYTES, before_open=before_open)
    return parse_hmac_key(data, source=f"HMAC key file {os.fspath(path)!r}")


def load_private_key_pem(path: str | os.PathLike[str], *, before_open: BeforeOpenHook | None = None) -> bytes:
    """Load a TLS private key file's bytes under the key-file contract (errata L10)."""
    return read_protected_file(path, what="TLS private key", max_size=PRIVATE_KEY_MAX_BYTES, before_open=before_open)
