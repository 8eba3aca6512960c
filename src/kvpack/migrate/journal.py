"""Durable transfer journals: one pretty-JSON record per transfer, 0600, atomic.

``<home>/session-transfers/<id>.json`` holds everything a restarted node needs to finish or
reconcile a transfer: the binding (session, destination, mode, tier), the status, size and
SHA-256 of the sealed payload, the per-transfer key (which is why the file is 0600 and the
directory 0700), the incoming side's durable upload offset, and a short history of status
changes with their reasons. Every write goes through :func:`kvpack.durable.atomic_write`
(temp file, fsync, rename, directory fsync): after a crash a journal is the old record or the
new one, never a mix. Payload files live next to the journals:

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
from typing import Any

from ..durable import REAL_OPS, FileOps, atomic_write, durable_unlink, ensure_dir
from ..errors import MigrationError
from . import machine as M

ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
HISTORY_LIMIT = 64


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and bool(ID_RE.match(value))


def view(rec: dict[str, Any]) -> dict[str, Any]:
    """TransferView (D.1), serialization order; ``last_error`` omitted when null."""
    out = {
        "id": rec["id"],
        "session_id": rec["session_id"],
        "direction": rec["direction"],
        "mode": rec["mode"],
        "tier": rec["tier"],
        "destination": rec["destination"],
        "status": rec["status"],
        "bytes": rec.get("bytes", 0),
        "sha256": rec.get("sha256", ""),
        "source_deleted": bool(rec.get("source_deleted", False)),
    }
    if rec.get("last_error") is not None:
        out["last_error"] = rec["last_error"]
    return out


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
            raise MigrationError("usage", "transfer id must be 1..128 of [A-Za-z0-9_-]")

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
    def load(self, tid: str) -> dict[str, Any] | None:
        try:
            with open(self.path(tid), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        try:
            rec = json.loads(data)
        except ValueError:
            raise MigrationError("integrity", f"journal {tid} is not JSON") from None
        if not isinstance(rec, dict) or rec.get("id") != tid:
            raise MigrationError("integrity", f"journal {tid} is malformed")
        return rec

    def require(self, tid: str) -> dict[str, Any]:
        rec = self.load(tid)
        if rec is None:
            raise MigrationError("not_found", "session transfer does not exist")
        return rec

    def save(self, rec: dict[str, Any]) -> None:
        rec["updated"] = time.time()
        body = json.dumps(rec, indent=2, sort_keys=True).encode() + b"\n"
        atomic_write(self.path(rec["id"]), body, ops=self.ops, mode=0o600)

    def create(self, rec: dict[str, Any]) -> dict[str, Any]:
        rec.setdefault("history", [])
        rec.setdefault("created", time.time())
        rec["history"].append({"status": rec["status"], "note": "created", "t": time.time()})
        self.save(rec)
        return rec

    def transition(self, rec: dict[str, Any], status: str, note: str = "", **fields: Any) -> dict[str, Any]:
        """Durably move ``rec`` to ``status`` (checked against the machine), with extra fields."""
        M.check_transition(rec["direction"], rec["status"], status)
        rec.update(fields)
        rec["status"] = status
        hist = rec.setdefault("history", [])
        hist.append({"status": status, "note": note, "t": time.time()})
        del hist[:-HISTORY_LIMIT]
        self.save(rec)
        return rec

    def record_failure(self, rec: dict[str, Any], error: str) -> dict[str, Any]:
        """D.4 failure recording: kept statuses keep, others become ``ambiguous``; error attached."""
        status = M.failure_status(rec["status"])
        if status != rec["status"]:
            M.check_transition(rec["direction"], rec["status"], status)
        rec["status"] = status
        rec["last_error"] = error
        rec.setdefault("history", []).append({"status": status, "note": f"error: {error}", "t": time.time()})
        del rec["history"][:-HISTORY_LIMIT]
        self.save(rec)
        return rec

    def all(self) -> list[dict[str, Any]]:
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


def decode_key(text: str) -> bytes:
    try:
        key = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise MigrationError("usage", "transport_key is not standard base64") from None
    if len(key) != 32 or encode_key(key) != text:
        raise MigrationError("usage", "transport_key must be the canonical base64 of 32 bytes")
    return key
