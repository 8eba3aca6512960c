"""The source-side orchestrators: export (decode or storage tier) and restore from storage.

Both follow D.4 and consult :func:`kvpack.migrate.machine.plan` for every decision, with the
journal written durably *before* the step it licenses:

export
    1. reconcile: unless the transfer is ``starting`` or already past the destination's commit,
       look the transfer up at the destination (a lookup, never a guess);
    2. ``starting`` -> seal the session's committed bundle under a fresh 32-byte key into
       ``<id>.payload`` (durable), then record ``prepared`` with bytes and sha256;
    3. record ``transferring``; prepare at the destination, upload from its durable offset,
       commit; require ``committed``;
    4. on any error, look the destination up again: ``committed`` there counts as success,
       anything else records ``ambiguous`` (kept statuses keep, with the error attached);
    5. record ``destination_committed``;
    6. move: delete the source session (only now: :func:`machine.may_delete_source`), then
       ``completed`` with ``source_deleted``; a failed delete records
       ``destination_committed_source_retained`` with ``last_error``. Copy: ``completed``.

restore (storage tier, destination ``"local"``)
    fetch the bundle from the storage node, check size and SHA-256, open it with the
    transfer's key, adopt it as a local session (durable), record ``source_restored``; for a
    move then delete the remote copy: ``completed`` or ``source_restored_remote_retained``.
"""

from __future__ import annotations

import os
from typing import Any

from ..durable import atomic_write
from ..errors import KvpackError, MigrationError
from . import failpoints
from . import machine as M
from .bundle import new_transport_key, open_sealed, seal, sha256_hex
from .journal import decode_key, encode_key


def _err(exc: BaseException) -> str:
    if isinstance(exc, KvpackError):
        return f"{exc.category}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


def run_export(svc, rec: dict[str, Any], dest) -> dict[str, Any]:
    j = svc.journals
    tid = rec["id"]
    payload = j.payload_path(tid)
    try:
        if rec["status"] in (M.COMPLETED, M.SOURCE_RESTORED, M.SOURCE_RESTORED_REMOTE_RETAINED):
            return rec
        if rec["status"] not in M.DESTINATION_DURABLE:
            dstatus, received = (None, 0) if rec["status"] == M.STARTING else dest.lookup(tid, rec)
            step = M.plan(rec["status"], rec["mode"], have_payload=os.path.exists(payload), destination=dstatus, received=received, size=rec.get("bytes", 0))
            if step.action == "export":
                if rec["status"] != M.STARTING:
                    raise MigrationError("integrity", "the sealed payload of this transfer is gone; it cannot be resumed")
                plain = svc.registry.bundle_bytes(rec["session_id"])
                key = new_transport_key()
                sealed = seal(plain, key)
                atomic_write(payload, sealed, mode=0o600)
                j.transition(rec, M.PREPARED, "sealed payload written", bytes=len(sealed), sha256=sha256_hex(sealed), transport_key=encode_key(key))
                step = M.Step("prepare")
            if step.action in ("prepare", "upload", "commit"):
                if rec["status"] != M.TRANSFERRING:
                    j.transition(rec, M.TRANSFERRING, f"next: {step.action}")
                if step.action == "prepare":
                    failpoints.hit("source.before_prepare")
                    st = dest.prepare(rec, svc.identity_fields())
                    failpoints.hit("source.after_prepare")
                    if st == M.COMMITTED:
                        step = M.Step("record_committed")
                    elif st == M.UPLOADED:
                        step = M.Step("commit")
                    else:
                        dstatus, received = dest.lookup(tid, rec)
                        step = M.plan(rec["status"], rec["mode"], have_payload=True, destination=dstatus, received=received, size=rec["bytes"])
                if step.action == "upload":
                    rec.setdefault("history", []).append({"status": rec["status"], "note": f"upload from {step.offset} of {rec['bytes']}"})
                    j.save(rec)
                    svc.note_progress(tid, step.offset, resumed_from=step.offset)
                    dest.upload(rec, payload, step.offset, lambda n: svc.note_progress(tid, n))
                    failpoints.hit("source.after_upload")
                    step = M.Step("commit")
                if step.action == "commit":
                    if dest.commit(rec) != M.COMMITTED:
                        raise MigrationError("transport", "destination did not durably commit the transfer")
                    step = M.Step("record_committed")
            if step.action == "record_committed":
                j.transition(rec, M.DESTINATION_COMMITTED, "destination committed", last_error=None)
    except Exception as exc:  # noqa: BLE001 - any failure before the commit is recorded, never lost in a thread
        # D.4 step 5: reconcile by lookup before recording anything.
        text = _err(exc)
        if rec["status"] in M.DESTINATION_DURABLE or rec["status"] in M.KEPT_ON_FAILURE:
            j.record_failure(rec, text)
            return rec
        try:
            dstatus, _ = dest.lookup(tid, rec)
        except Exception as exc2:  # noqa: BLE001
            dstatus = None
            text += f"; destination lookup failed: {_err(exc2)}"
        if dstatus == M.COMMITTED and rec["status"] in (M.TRANSFERRING, M.AMBIGUOUS):
            j.transition(rec, M.DESTINATION_COMMITTED, f"error ({text}); destination lookup: committed", last_error=None)
        else:
            j.record_failure(rec, text)
            return rec
    failpoints.hit("source.after_destination_committed")
    return finish_export(svc, rec)


def finish_export(svc, rec: dict[str, Any]) -> dict[str, Any]:
    j = svc.journals
    if rec["status"] not in M.DESTINATION_DURABLE:
        return rec
    if rec["mode"] == "copy":
        j.unlink_payload(rec["id"])
        return j.transition(rec, M.COMPLETED, "copy complete", last_error=None)
    assert M.may_delete_source(rec["mode"], rec["status"])  # the move invariant, checked at the act
    try:
        failpoints.hit("source.delete")
        svc.registry.delete(rec["session_id"])
        j.unlink_payload(rec["id"])
    except (KvpackError, OSError) as exc:
        return j.transition(rec, M.DESTINATION_COMMITTED_SOURCE_RETAINED, "source delete failed", last_error=_err(exc))
    return j.transition(rec, M.COMPLETED, "source deleted", source_deleted=True, last_error=None)


def run_restore(svc, rec: dict[str, Any], dest) -> dict[str, Any]:
    j = svc.journals
    sid = rec["session_id"]
    if rec["status"] not in (M.SOURCE_RESTORED, M.SOURCE_RESTORED_REMOTE_RETAINED):
        try:
            sealed = dest.fetch(rec)
            plain = open_sealed(sealed, decode_key(rec["transport_key"]))
            existing = None
            if svc.registry.exists(sid):
                existing = svc.registry.bundle_bytes(sid)
                if existing != plain:
                    raise MigrationError("conflict", f"session {sid} exists here with other state; not overwritten")
            else:
                svc.registry.install(sid, plain)
        except (KvpackError, OSError) as exc:
            rec["last_error"] = _err(exc)
            rec.setdefault("history", []).append({"status": rec["status"], "note": f"restore failed: {_err(exc)}"})
            j.save(rec)
            return rec
        j.transition(rec, M.SOURCE_RESTORED, "restored from storage", phase="restore", last_error=None)
    if rec["mode"] != "move" or rec["status"] == M.COMPLETED:
        return rec
    try:
        failpoints.hit("source.remote_delete")
        dest.delete(rec)
    except (KvpackError, OSError) as exc:
        return j.transition(rec, M.SOURCE_RESTORED_REMOTE_RETAINED, "remote delete failed", last_error=_err(exc))
    return j.transition(rec, M.COMPLETED, "remote copy deleted", last_error=None)
