"""The admin-side onboarding state record of one node, and its stage machine.

One JSON file per node, ``<cluster>/onboard/<name>/state.json`` (schema
``kvpack-onboard-state-v1``, documented in docs/operations.md, read by the status page),
published through :mod:`kvpack.durable` after every transition, so the record on disk is
always the last completed step: a wizard SIGKILLed anywhere resumes from it.

``state`` is one of ``running:<stage>`` (a wizard is in that stage, or was when it died),
``failed:<stage>`` (with ``failure.category`` and ``failure.reason``), ``healthy`` or
``removed``. Stages run in order; each ends with a receipt file and ``stages[<stage>].status
= "done"``. The transitions are pure functions on the record (the clock is passed in); the
file I/O is :func:`load` and :func:`save` only.

This module never talks to a node and never decides trust: the wizard does both.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..durable import atomic_write, ensure_dir
from ..errors import OnboardError
from ..vocab import FileLock

SCHEMA = "kvpack-onboard-state-v1"
STAGES = ("preflight", "keygen", "sign", "install", "configs", "start", "qualify", "healthy")
LABELS = {
    "preflight": "checking the node: SSH and host key, kvpack version, engine identity, ledger volume",
    "keygen": "generating the node's TLS key on the node (versioned 0700 staging directory)",
    "sign": "fetching the CSR, checking key type, subject and SANs, signing it",
    "install": "installing certificate, CA and pins on the node; provisioning HMAC keys over SSH",
    "configs": "writing configs on both sides (secrets by path)",
    "start": "starting the node daemon",
    "qualify": "qualifying: three Handoff V2 exchanges, 2,048 positions, 256 output tokens",
    "healthy": "recording state=healthy",
}
#: Stages whose effects reach peers (keys, pins, configs, daemons): a failure at or after the
#: first of them revokes those effects on the admin side and re-runs them on resume.
TRUST_STAGES = ("install", "configs", "start", "qualify", "healthy")
MAX_RECORD_BYTES = 1 << 20


def new_record(name: str, role: str, target: dict[str, Any], options: dict[str, Any], *, key_version: int, now_ms: int) -> dict[str, Any]:
    """A fresh record: nothing done yet."""
    return {
        "schema": SCHEMA,
        "name": name,
        "role": role,
        "state": f"running:{STAGES[0]}",
        "target": dict(target),
        "options": dict(options),
        "key_version": key_version,
        "stages": {s: {"status": "pending"} for s in STAGES},
        "pending": {},
        "failure": None,
        "qualification": None,
        "history": [{"unix_ms": now_ms, "event": "created"}],
        "created_unix_ms": now_ms,
        "updated_unix_ms": now_ms,
    }


def next_stage(rec: dict[str, Any]) -> str | None:
    """The first stage not done, or None when all are."""
    for stage in STAGES:
        if rec["stages"][stage]["status"] != "done":
            return stage
    return None


def begin(rec: dict[str, Any], stage: str, now_ms: int) -> None:
    entry = rec["stages"][stage]
    entry.update(status="running", started_unix_ms=now_ms, attempts=int(entry.get("attempts", 0)) + 1)
    rec["state"] = f"running:{stage}"
    rec["failure"] = None
    _touch(rec, now_ms, f"begin {stage}")


def finish(rec: dict[str, Any], stage: str, receipt: str, now_ms: int) -> None:
    entry = rec["stages"][stage]
    entry.update(status="done", finished_unix_ms=now_ms, receipt=receipt)
    nxt = next_stage(rec)
    rec["state"] = "healthy" if nxt is None else f"running:{nxt}"
    _touch(rec, now_ms, f"done {stage}")


def fail(rec: dict[str, Any], stage: str, category: str, reason: str, now_ms: int, receipt: str | None = None) -> None:
    rec["stages"][stage].update(status="failed", finished_unix_ms=now_ms, receipt=receipt)
    rec["state"] = f"failed:{stage}"
    rec["failure"] = {"stage": stage, "category": category, "reason": reason[:4000], "unix_ms": now_ms}
    _touch(rec, now_ms, f"failed {stage}: {category}")


def reopen_trust_stages(rec: dict[str, Any], now_ms: int) -> None:
    """After a revocation: every stage that put trust on peers runs again on resume."""
    for stage in TRUST_STAGES:
        if rec["stages"][stage]["status"] != "pending":
            rec["stages"][stage]["status"] = "revoked"
    _touch(rec, now_ms, "revoked peer trust")


def _touch(rec: dict[str, Any], now_ms: int, event: str) -> None:
    rec["updated_unix_ms"] = now_ms
    rec["history"] = (rec.get("history") or [])[-199:] + [{"unix_ms": now_ms, "event": event}]


# -- files ------------------------------------------------------------------------------------------


def onboard_dir(cluster_root: str, name: str) -> str:
    return os.path.join(cluster_root, "onboard", name)


def record_path(cluster_root: str, name: str) -> str:
    return os.path.join(onboard_dir(cluster_root, name), "state.json")


def load(cluster_root: str, name: str) -> dict[str, Any] | None:
    """The record of ``name``, or None when it was never onboarded."""
    path = record_path(cluster_root, name)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_RECORD_BYTES:
        raise OnboardError("state", f"{path}: larger than {MAX_RECORD_BYTES} bytes")
    try:
        rec = json.loads(data)
    except ValueError as exc:
        raise OnboardError("state", f"{path}: not JSON: {exc}") from None
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA or rec.get("name") != name or set(rec.get("stages", {})) != set(STAGES):
        raise OnboardError("state", f"{path}: not a {SCHEMA} record for {name!r}")
    return rec


def save(cluster_root: str, rec: dict[str, Any]) -> None:
    directory = onboard_dir(cluster_root, rec["name"])
    ensure_dir(directory, mode=0o700)
    atomic_write(record_path(cluster_root, rec["name"]), json.dumps(rec, indent=2, sort_keys=True).encode() + b"\n", mode=0o644)


def write_receipt(cluster_root: str, name: str, stage: str, attempt: int, body: dict[str, Any]) -> str:
    """Publish one stage receipt; returns its path relative to the node's onboard directory."""
    rel = os.path.join("receipts", f"{STAGES.index(stage) + 1:02d}-{stage}.{attempt}.json")
    path = os.path.join(onboard_dir(cluster_root, name), rel)
    ensure_dir(os.path.dirname(path), mode=0o700)
    atomic_write(path, json.dumps(body, indent=2, sort_keys=True, default=str).encode() + b"\n", mode=0o644)
    return rel


class RunLock:
    """One wizard per node: an exclusive ``flock`` on ``onboard/<name>/.lock``. A lock that is
    free while the record says ``running:<stage>`` means the last wizard died there."""

    def __init__(self, cluster_root: str, name: str) -> None:
        self.path = os.path.join(onboard_dir(cluster_root, name), ".lock")
        self._lock = FileLock(self.path)

    def acquire(self) -> "RunLock":
        ensure_dir(os.path.dirname(self.path), mode=0o700)
        try:
            self._lock.acquire()
        except OSError:
            raise OnboardError("state", f"another 'kvpack node add' is running for this node ({self.path} is locked)") from None
        return self

    def release(self) -> None:
        self._lock.release()

    def held_elsewhere(self) -> bool:
        """True if a live wizard holds the lock (for ``node show``: running vs interrupted)."""
        if not os.path.exists(self.path):
            return False
        try:
            FileLock(self.path).acquire().release()
        except OSError:
            return True
        return False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
