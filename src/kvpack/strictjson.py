"""Strict JSON parsing: the one loader for JSON that a peer, an operator or a file hands us.

Why it exists: :func:`json.loads` silently keeps the *last* of duplicate keys and accepts
``NaN``/``Infinity``, so two readers of the same bytes (a validating proxy and this process, or
a signer and a verifier) can disagree about what a document says. Every JSON body of the node
API, the replay ledger and its witness are read through :func:`loads`, which refuses both.
What it must never do: coerce, normalise or guess -- it only parses or raises ``ValueError``.
"""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """An object names the same key twice."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse ``data`` (UTF-8 when bytes); refuse duplicate keys and NaN/Infinity (ValueError)."""
    text = bytes(data).decode("utf-8") if not isinstance(data, str) else data
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)
