"""Canonical JSON (INTEROP C.7) and the strict JSON reader Handoff V2 needs (errata M1).

Two jobs, both pure:

* :func:`canonical_bytes` is the one encoder every hash and HMAC input goes through. It is
  Python's ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` encoded
  as UTF-8, which the errata (L2, INFO C.7) confirm equals Rust's serde_json canonical form
  byte for byte. Floats, NaN and lone surrogates are refused rather than emitted, because
  no protocol value is a float and a lone surrogate has no UTF-8 encoding on the Rust side.
* :func:`parse_json` / :func:`decode_canonical` are the reader. Python's ``json.loads`` is
  lax where Rust's typed serde parse is strict (floats that equal ints, ``true`` as 1,
  last-duplicate-key-wins, lone surrogates); the reader closes each of those gaps so that a
  Python receiver accepts exactly what the Rust receiver accepts.

The field helpers (:func:`u32`, :func:`u64`, :func:`boolean`, :func:`string`,
:func:`check_keys`) are what the typed parsers in :mod:`manifest`, :mod:`frames` and
:mod:`control` use to turn a parsed dict into typed values, with "json" refusals named by
the field path.

It must never emit or accept a float, a duplicate key or a lone surrogate.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from ..errors import ProtocolError
from ..vocab import StrictJsonError, reject_constant, reject_duplicate_keys

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_bytes(value: Any) -> bytes:
    """Canonical JSON bytes of ``value`` (C.7): sorted keys, compact, raw UTF-8.

    Refuses floats (no protocol field is a float, and float formatting differs between
    serde_json and Python) and strings that cannot be UTF-8 encoded.
    """
    _reject_floats(value)
    try:
        return _ENCODER.encode(value).encode("utf-8")
    except (UnicodeEncodeError, ValueError, TypeError) as exc:
        raise ProtocolError("json", f"value has no canonical JSON form: {exc}", remote=False) from exc


def _reject_floats(value: Any) -> None:
    # Iterative walk: prompt_token_ids can hold 131,072 entries, recursion depth is small
    # but lists are long, so a stack of containers is enough.
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            raise ProtocolError("json", "floats have no canonical form in this protocol", remote=False)
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            # Fast path: a list of plain ints (token ids) needs no per-item push.
            if v and all(type(x) is int for x in v):
                continue
            stack.extend(v)


def _no_float(text: str) -> Any:
    raise ProtocolError("json", f"number {text!r} is not an integer")


# Duplicate keys and NaN/Infinity are refused by the shared strict-JSON hooks (kvpack.vocab);
# this wire also refuses every non-integer number.
_DECODER = json.JSONDecoder(object_pairs_hook=reject_duplicate_keys, parse_float=_no_float, parse_constant=reject_constant)


def parse_json(data: bytes | bytearray | memoryview, max_len: int) -> Any:
    """Strictly parse JSON bytes of at most ``max_len`` bytes (not required canonical).

    Refuses: empty or oversize input, invalid UTF-8, duplicate keys, floats/exponents,
    NaN/Infinity, unpaired surrogate escapes, integers too long to be any u64.
    """
    n = len(data)
    if n == 0 or n > max_len:
        raise ProtocolError("json", f"JSON length {n} outside 1..={max_len}")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError("json", "JSON is not valid UTF-8") from exc
    try:
        value = _DECODER.decode(text)
    except ProtocolError:
        raise
    except StrictJsonError as exc:
        raise ProtocolError("json", str(exc)) from None
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError and Python's int-digit limit on huge numbers.
        raise ProtocolError("json", f"malformed JSON: {exc}") from exc
    _reject_lone_surrogates(value)
    return value


def _reject_lone_surrogates(value: Any) -> None:
    # json.loads turns "\ud800" into a lone surrogate; serde_json refuses it. A string with
    # a lone surrogate is exactly one that cannot be encoded as UTF-8.
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ProtocolError("json", "unpaired surrogate escape in JSON string") from exc
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            if v and all(type(x) is int for x in v):
                continue
            stack.extend(v)


def decode_canonical(data: bytes | bytearray | memoryview, max_len: int) -> Any:
    """Parse ``data`` and require that it is already canonical (C.7 ``decode_canonical_json``).

    Used by the MUPCTL1 control plane; KVPKV2 frame headers are *not* required canonical.
    """
    value = parse_json(data, max_len)
    if canonical_bytes(value) != bytes(data):
        raise ProtocolError("json", "JSON is not in canonical form")
    return value


# --- typed field helpers ---------------------------------------------------------------


def check_keys(obj: Any, where: str, required: Iterable[str], optional: Iterable[str] = ()) -> Mapping[str, Any]:
    """Require ``obj`` to be an object with all ``required`` keys and nothing outside the
    allow-list (C.3 unknown-field audit)."""
    if not isinstance(obj, dict):
        raise ProtocolError("json", f"{where}: expected a JSON object")
    req = set(required)
    allowed = req | set(optional)
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise ProtocolError("json", f"{where}: unknown field {sorted(unknown)[0]!r}")
    missing = [k for k in req if k not in obj]
    if missing:
        raise ProtocolError("json", f"{where}: missing field {sorted(missing)[0]!r}")
    return obj


def uint(value: Any, where: str, maximum: int) -> int:
    """A JSON unsigned integer in 0..=maximum; bools are refused although Python treats
    ``True`` as an int."""
    if type(value) is not int:
        raise ProtocolError("json", f"{where}: expected an unsigned integer, got {type(value).__name__}")
    if value < 0 or value > maximum:
        raise ProtocolError("json", f"{where}: integer {value} outside 0..={maximum}")
    return value


def u32(value: Any, where: str) -> int:
    return uint(value, where, U32_MAX)


def u64(value: Any, where: str) -> int:
    return uint(value, where, U64_MAX)


def boolean(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise ProtocolError("json", f"{where}: expected true or false")
    return value


def string(value: Any, where: str) -> str:
    if type(value) is not str:
        raise ProtocolError("json", f"{where}: expected a string")
    return value


def array(value: Any, where: str) -> list[Any]:
    if type(value) is not list:
        raise ProtocolError("json", f"{where}: expected an array")
    return value


def u32_array(value: Any, where: str) -> tuple[int, ...]:
    """An array of u32 (prompt token ids); checked without per-item Python calls where
    possible because prompts can be long."""
    items = array(value, where)
    if not all(type(x) is int for x in items):
        raise ProtocolError("json", f"{where}: every entry must be an unsigned integer")
    if items and (min(items) < 0 or max(items) > U32_MAX):
        raise ProtocolError("json", f"{where}: entry outside 0..={U32_MAX}")
    return tuple(items)
