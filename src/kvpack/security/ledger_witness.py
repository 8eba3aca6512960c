"""The replay ledger's rollback witness: evidence of the highest reserved generations, kept
outside the ledger file (pure rules; the file I/O is :class:`kvpack.security.ledger.ReplayLedger`'s).

Why it exists: the ledger is the only thing that proves *when* a sealed transfer was sent, and
the ledger trusts its own file. Delete it, put back yesterday's copy, or empty its map, and
every captured transfer of that key and epoch above the old watermark is admitted again
(upstream has no defence). The witness, ``<ledger>.witness`` next to it, records per
``key_id:epoch`` a *lower bound* of the ledger's watermark; at open, a ledger below its witness
for any counter space still admissible (epoch >= the configured minimum) is a rollback, and the
receiver refuses to start (:func:`rollback_refusal`).

What it must never do: exceed the durable ledger (a crash must never make an honest ledger look
rolled back), or decide to forgive a rollback by itself -- only an operator does, through a new
enrollment epoch or an explicit, logged ``kvpack ledger reset`` that only moves forward.

Format (pretty JSON, sorted keys, trailing newline, 0600)::

    {
      "format": "kvpack-ledger-witness-v1",
      "highest_generation": {"<key_id>:<epoch>": <u64>},
      "ledger": "<file name of the ledger it witnesses>"
    }
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Optional

from ..vocab import strict_json_loads
from ..errors import SecurityError

WITNESS_FORMAT = "kvpack-ledger-witness-v1"
WITNESS_SUFFIX = ".witness"
U64_MAX = (1 << 64) - 1


def witness_path(ledger_path: str) -> str:
    return ledger_path + WITNESS_SUFFIX


def encode_witness(ledger_name: str, highest: Mapping[str, int]) -> bytes:
    body = {"format": WITNESS_FORMAT, "highest_generation": dict(sorted(highest.items())), "ledger": ledger_name}
    return json.dumps(body, indent=2, sort_keys=True).encode("ascii") + b"\n"


def decode_witness(data: bytes, ledger_name: str, *, source: str) -> dict[str, int]:
    """Parse witness bytes strictly; it must name ``ledger_name`` (a witness copied from another
    ledger proves nothing about this one)."""
    try:
        obj = strict_json_loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SecurityError("ledger", f"{source} is not valid witness JSON: {exc}") from None
    if not isinstance(obj, dict) or set(obj) != {"format", "highest_generation", "ledger"} or obj["format"] != WITNESS_FORMAT:
        raise SecurityError("ledger", f"{source} is not a {WITNESS_FORMAT} object")
    if obj["ledger"] != ledger_name:
        raise SecurityError("ledger", f"{source} witnesses ledger {obj['ledger']!r}, not {ledger_name!r}")
    table = obj["highest_generation"]
    if not isinstance(table, dict) or not all(type(v) is int and 0 <= v <= U64_MAX for v in table.values()):
        raise SecurityError("ledger", f"{source}: 'highest_generation' must map counter spaces to u64 integers")
    return dict(table)


def merge(*tables: Mapping[str, int]) -> dict[str, int]:
    """Per counter space, the highest value in any table (witnesses only ever grow)."""
    out: dict[str, int] = {}
    for table in tables:
        for key, value in table.items():
            out[key] = max(out.get(key, 0), value)
    return out


def epoch_of(space: str) -> int:
    """The epoch of a ``key_id:epoch`` counter space (key ids may contain ':')."""
    tail = space.rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0


def rollback_refusal(
    ledger: Optional[Mapping[str, int]],
    witness: Optional[Mapping[str, int]],
    *,
    minimum_epoch: int,
    ledger_path: str,
) -> Optional[SecurityError]:
    """The refusal to start when the ledger is missing, older or emptied against its witness, or
    when a non-empty ledger has lost its witness; None when consistent. Pure. Counter spaces of
    epochs below ``minimum_epoch`` are not compared: their seals are refused by the epoch rule
    whatever the ledger says (that is how a rotation to a new epoch recovers)."""
    recover = (
        f"recover with a new HMAC epoch (kvpack enroll node CLUSTER NAME --rotate) or, knowing the highest generation "
        f"the producer has sent, kvpack ledger reset --ledger {ledger_path} --min-generation N"
    )
    if witness is None:
        if ledger:
            return SecurityError(
                "rollback",
                f"replay ledger {ledger_path} holds watermarks but its rollback witness {witness_path(ledger_path)} is missing "
                f"(deleted, or the ledger was copied here): it cannot be trusted; {recover}",
            )
        return None
    for space, floor in sorted(witness.items()):
        if epoch_of(space) < minimum_epoch or floor == 0:
            continue
        have = None if ledger is None else ledger.get(space)
        if have is not None and have >= floor:
            continue
        what = "is missing" if ledger is None else "is empty" if not ledger else f"has {space} at {have or 0}"
        return SecurityError(
            "rollback",
            f"replay ledger {ledger_path} {what} but its witness records {space} at generation {floor}: "
            f"the ledger was rolled back and captured transfers would be admitted again; refusing to start; {recover}",
        )
    return None
