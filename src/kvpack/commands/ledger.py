"""``kvpack ledger show|reset``: inspect a replay ledger against its rollback witness, and the
operator's explicit, logged, forward-only reset (docs/security.md, "Ledger rollback").

    kvpack ledger show  (--config RECEIVER.json | --ledger PATH) [--json]
    kvpack ledger reset (--config RECEIVER.json | --ledger PATH) --min-generation N
                        [--key KEY_ID:EPOCH ...] [--reason TEXT] [--json]

``show`` exits 0 when the ledger would open, 1 when a receiver would refuse to start on it.
``reset`` raises each counter space (default: those in the ledger or its witness, plus the
config's ``hmac_key_id:minimum_hmac_epoch``) to ``max(ledger, witness, N)``: never lower. Pick N
at or above the highest generation the producer has issued (its generation ledger holds
``next_generation``). It refuses while a receiver holds the ledger, and appends a JSON line to
``<ledger>.resets.log``. The work lives in :mod:`kvpack.security.ledger`.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from ._args import existing_file, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ledger", help="replay ledger: rollback check and forward-only reset")
    sub = parser.add_subparsers(dest="ledger_command", metavar="ACTION")
    sub.required = True
    show = sub.add_parser("show", help="the ledger, its rollback witness and whether a receiver would start on them")
    _target(show)
    show.set_defaults(func=_show)
    reset = sub.add_parser("reset", help="move watermarks forward (never back); logged")
    _target(reset)
    reset.add_argument("--min-generation", type=positive_int, required=True, help="every reset counter space ends at least here")
    reset.add_argument("--key", action="append", default=[], metavar="KEY_ID:EPOCH", help="counter space to reset (repeatable)")
    reset.add_argument("--reason", default="", help="recorded in the reset log")
    reset.set_defaults(func=_reset)


def _target(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--config", type=existing_file, help="a receiver config (C.15): its replay_ledger, key id and minimum epoch")
    group.add_argument("--ledger", help="the ledger file itself")


def _resolve(args: argparse.Namespace) -> tuple[str, int, Optional[str]]:
    """(ledger path, minimum epoch, the config's own counter space or None)."""
    if args.ledger:
        return args.ledger, 1, None
    from ..security.config import load_receiver_config

    cfg = load_receiver_config(args.config, check_files=False)
    return cfg.replay_ledger, cfg.minimum_hmac_epoch, f"{cfg.hmac_key_id}:{cfg.minimum_hmac_epoch}"


def _show(args: argparse.Namespace) -> int:
    import os

    from ..errors import SecurityError
    from ..security.ledger import read_ledger_file, read_witness_file
    from ..security.ledger_witness import rollback_refusal

    path, minimum_epoch, _ = _resolve(args)
    path = os.path.abspath(path)
    try:
        ledger, witness = read_ledger_file(path), read_witness_file(path)
        refusal = rollback_refusal(ledger, witness, minimum_epoch=minimum_epoch, ledger_path=path)
    except SecurityError as exc:
        ledger = witness = None
        refusal = exc
    doc = {"ledger": path, "minimum_epoch": minimum_epoch, "highest_generation": ledger, "witness": witness, "ok": refusal is None}
    if refusal is not None:
        doc["refusal"] = f"{refusal.category}: {refusal.message}"
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(f"{path}: {'ok' if refusal is None else 'REFUSED'} (minimum epoch {minimum_epoch})")
        for space in sorted(set(ledger or {}) | set(witness or {})):
            print(f"  {space:<48} ledger {(ledger or {}).get(space, '-')!s:>12}  witness {(witness or {}).get(space, '-')!s:>12}")
    if refusal is not None:
        raise refusal  # after the report: the one error line, exit 1 (docs/cli.md)
    return 0


def _reset(args: argparse.Namespace) -> int:
    from ..security.ledger import reset_ledger

    path, _, own = _resolve(args)
    spaces = list(args.key)
    if not spaces and own is not None:
        from ..security.ledger import read_ledger_file, read_witness_file

        known: set[str] = set()
        for read in (read_ledger_file, read_witness_file):
            try:
                known |= set(read(path) or {})
            except Exception:  # noqa: BLE001 - unreadable files are reset_ledger's to report
                pass
        spaces = sorted(known | {own})
    entry = reset_ledger(path, min_generation=args.min_generation, spaces=spaces, reason=args.reason)
    if args.json:
        print(json.dumps(entry, indent=2, sort_keys=True))
    else:
        print(f"{entry['ledger']}: reset forward to at least {entry['min_generation']} (logged in {entry['ledger']}.resets.log)")
        for space in entry["spaces"]:
            print(f"  {space:<48} {entry['before'].get(space, '-')!s:>12} -> {entry['after'][space]}")
        for note in entry["notes"]:
            print(f"  note: {note}")
    return 0
