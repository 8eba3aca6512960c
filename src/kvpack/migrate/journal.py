"""Durable transfer journals: one pretty-JSON record per transfer, 0600, atomic.

Why it exists: a restarted node must be able to finish or reconcile every transfer from disk
alone. ``<home>/session-transfers/<id>.json`` holds the typed
:class:`~kvpack.migrate.machine.TransferRecord`: the binding (session, destination, mode,
tier), the status, size and SHA-256 of the sealed payload, the per-transfer key (which is why
the file is 0600 and the directory 0700), the incoming side's durable upload offset, prepare
material and recorded expectation, and a short history of status changes with their reasons.
Every write goes through :func:`kvpack.durable.atomic_write` (temp file, fsync, rename,
directory fsync): after a crash a journal is the old record or the new one, never a mix.
What it must never do: decide anything (that is :mod:`.machine`) or accept a record it cannot
decode exactly (unknown fields, wrong types: ``integrity``).

Payload files live next to the journals:

* ``<id>.payload``     the sealed bundle (source: what is sent; destination: what was verified)
* ``.<id>.incoming``   the destination's partial upload (resumable from ``received``)

The public projection is :func:`view`, the TransferView of D.1 in its exact field order.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
from dataclasses import asdict, fields, replace
from typing import Any, Optional

from ..vocab import strict_json_loads
from ..durable import REAL_OPS, FileOps, atomic_write, durable_unlink, ensure_dir
from ..errors import MigrationError
from . import machine as M

ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
ID_RULE = "1..128 of [A-Za-z0-9_-]"


def valid_id(value: Any) -> bool:
    """Ids are matched whole (``fullmatch``: a trailing newline is not a valid id)."""
    return isinstance(value, str) and ID_RE.fullmatch(value) is not None


def view(rec: M.TransferRecord) -> dict[str, Any]:
    """TransferView (D.1), serialization order; ``last_error`` omitted when null."""
    out: dict[str, Any] = {
        "id": rec.id,
        "session_id": rec.session_id,
        "direction": rec.direction,
        "mode": rec.mode,
        "tier": rec.tier,
        "destination": rec.destination,
        "status": rec.status.value,
        "bytes": rec.bytes,
        "sha256": rec.sha256,
        "source_deleted": rec.source_deleted,
    }
    if rec.last_error is not None:
        out["last_error"] = rec.last_error
    return out


# -- the record's JSON form ------------------------------------------------------------------------------


def _state_json(state: Optional[M.SessionState]) -> Optional[dict[str, Any]]:
    if state is None:
        return None
    if isinstance(state, M.Held):
        return {"state": "held", "revision": state.revision, "bundle_sha256": state.bundle_sha256}
    return {"state": "absent"}


def record_json(rec: M.TransferRecord) -> dict[str, Any]:
    out = {f.name: getattr(rec, f.name) for f in fields(rec)}
    out["status"] = rec.status.value
    out["material"] = None if rec.material is None else asdict(rec.material)
    out["expected"] = _state_json(rec.expected)
    out["history"] = [{"status": h.status.value, "note": h.note, "t": h.t} for h in rec.history]
    return out


def _bad(tid: str, what: str) -> MigrationError:
    return MigrationError("integrity", f"journal {tid} is malformed: {what}")


def _state_from(tid: str, obj: Any) -> Optional[M.SessionState]:
    if obj is None:
        return None
    if obj == {"state": "absent"}:
        return M.ABSENT
    if isinstance(obj, dict) and set(obj) == {"state", "revision", "bundle_sha256"} and obj["state"] == "held":
        if type(obj["revision"]) is int and isinstance(obj["bundle_sha256"], str):
            return M.Held(obj["revision"], obj["bundle_sha256"])
    raise _bad(tid, "expected")


def _status(tid: str, value: Any) -> M.Status:
    try:
        return M.Status(value)
    except ValueError:
        raise _bad(tid, f"status {value!r}") from None


_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "session_id": (str,),
    "direction": (str,),
    "mode": (str,),
    "tier": (str,),
    "destination": (str,),
    "bytes": (int,),
    "sha256": (str,),
    "source_deleted": (bool,),
    "last_error": (str, type(None)),
    "transport_key": (str, type(None)),
    "phase": (str,),
    "received": (int,),
    "installed": (bool,),
    "created": (float, int),
    "updated": (float, int),
}


def record_from_json(tid: str, obj: Any) -> M.TransferRecord:
    """Decode a journal object exactly; anything unexpected is ``integrity``."""
    if not isinstance(obj, dict) or obj.get("id") != tid:
        raise _bad(tid, "not a record of this transfer")
    known = {f.name for f in fields(M.TransferRecord)}
    unknown = set(obj) - known
    if unknown:
        raise _bad(tid, f"unknown fields {sorted(unknown)}")
    for name, types in _TYPES.items():
        if name in obj and (not isinstance(obj[name], types) or (bool not in types and isinstance(obj[name], bool))):
            raise _bad(tid, f"field {name}")
    if obj.get("direction") not in ("outgoing", "incoming") or obj.get("mode") not in M.MODES or obj.get("tier") not in M.TIERS:
        raise _bad(tid, "binding")
    if obj.get("phase", "export") not in ("export", "restore-pending", "restore"):
        raise _bad(tid, "phase")
    values = {k: v for k, v in obj.items() if k in _TYPES}
    values["status"] = _status(tid, obj.get("status"))
    values["expected"] = _state_from(tid, obj.get("expected"))
    material = obj.get("material")
    try:
        values["material"] = None if material is None else M.Material(**material)
        values["history"] = tuple(M.HistoryEntry(_status(tid, h["status"]), str(h["note"]), float(h.get("t", 0.0))) for h in obj.get("history", ()))
        return M.TransferRecord(**values)
    except (TypeError, KeyError, ValueError):
        raise _bad(tid, "material or history") from None


class Journals:
    """The journal directory of one node."""

    def __init__(self, home: str, *, ops: FileOps = REAL_OPS) -> None:
        self.dir = os.path.join(os.path.abspath(home), "session-transfers")
        self.ops = ops
        ensure_dir(self.dir, mode=0o700, ops=ops)
        self._lock = threading.RLock()

    # -- paths -------------------------------------------------------------------------------------
    def _check(self, tid: str) -> None:
        if not valid_id(tid):
            raise MigrationError("usage", f"transfer id must be {ID_RULE}")

    def path(self, tid: str) -> str:
        self._check(tid)
        return os.path.join(self.dir, f"{tid}.json")

    def payload_path(self, tid: str) -> str:
        self._check(tid)
        return os.path.join(self.dir, f"{tid}.payload")

    def incoming_path(self, tid: str) -> str:
        self._check(tid)
        return os.path.join(self.dir, f".{tid}.incoming")

    # -- records -----------------------------------------------------------------------------------
    def load(self, tid: str) -> Optional[M.TransferRecord]:
        try:
            with open(self.path(tid), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        try:
            obj = strict_json_loads(data)
        except ValueError:
            raise MigrationError("integrity", f"journal {tid} is not JSON") from None
        return record_from_json(tid, obj)

    def require(self, tid: str) -> M.TransferRecord:
        rec = self.load(tid)
        if rec is None:
            raise MigrationError("not_found", "session transfer does not exist")
        return rec

    def save(self, rec: M.TransferRecord) -> M.TransferRecord:
        """Durably write ``rec`` (stamped with the time of writing); returns what was written."""
        rec = replace(rec, updated=time.time())
        body = json.dumps(record_json(rec), indent=2, sort_keys=True).encode() + b"\n"
        atomic_write(self.path(rec.id), body, ops=self.ops, mode=0o600)
        return rec

    def transition(self, rec: M.TransferRecord, status: M.Status, text: str = "", **changes: Any) -> M.TransferRecord:
        """Durably move ``rec`` to ``status`` (checked against the machine), with changes."""
        return self.save(M.transition(rec, status, text, now=time.time(), **changes))

    def note(self, rec: M.TransferRecord, text: str, **changes: Any) -> M.TransferRecord:
        return self.save(M.note(rec, text, now=time.time(), **changes))

    def record_failure(self, rec: M.TransferRecord, error: str) -> M.TransferRecord:
        """D.4 failure recording: kept statuses keep, others become ``ambiguous``; error attached."""
        return self.save(M.record_failure(rec, error, now=time.time()))

    def all(self) -> list[M.TransferRecord]:
        out = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".json") and not name.startswith("."):
                rec = self.load(name[:-5])
                if rec is not None:
                    out.append(rec)
        return out

    def unlink_payload(self, tid: str) -> None:
        durable_unlink(self.payload_path(tid), ops=self.ops)

    @property
    def lock(self) -> threading.RLock:
        return self._lock


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode("ascii")


def decode_key(text: Optional[str]) -> bytes:
    if text is None:
        raise MigrationError("integrity", "this transfer has no transport key yet")
    try:
        key = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise MigrationError("usage", "transport_key is not standard base64") from None
    if len(key) != 32 or encode_key(key) != text:
        raise MigrationError("usage", "transport_key must be the canonical base64 of 32 bytes")
    return key
