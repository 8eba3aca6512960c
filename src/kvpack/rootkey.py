"""Loading the 32-byte production-v1 root key from a file, fail-closed.

The root derives every pack/chunk key of a tenant (INTEROP.md A.1), so its file obeys the same
contract as the Handoff HMAC key files (C.10): a regular file (no symlink), no group/other
permission bits, unchanged between lstat and open, and holding exactly 32 raw bytes or 64
lowercase hex digits (trailing newline allowed).
"""

from __future__ import annotations

import os
import secrets

from .durable import atomic_write
from .security.secret_files import HMAC_KEY_MAX_BYTES, parse_hmac_key, read_protected_file


def load_root_key(path: str | os.PathLike[str]) -> bytes:
    data = read_protected_file(path, what="root key file", max_size=HMAC_KEY_MAX_BYTES)
    return parse_hmac_key(data, source=f"root key file {os.fspath(path)!r}")


def create_root_key(path: str | os.PathLike[str]) -> bytes:
    """Write a fresh random root (64 lowercase hex digits + newline, mode 0600)."""
    root = secrets.token_bytes(32)
    atomic_write(path, root.hex().encode() + b"\n", mode=0o600)
    return root
