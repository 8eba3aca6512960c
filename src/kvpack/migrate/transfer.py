"""The source-side orchestrators: export (decode or storage tier) and restore from storage.

Why it exists: it turns :func:`kvpack.migrate.machine.plan`'s decisions into effects on a
:class:`Destination` (the seam every tier implements: decode over HTTPS, storage over SSH),
with the journal written durably *before* the step it licenses. What it must never do: delete
a source before the destination's commit is on record, or resolve an error by guessing.

export
    1. reconcile: unless the transfer is ``starting`` or already past the destination's commit,
       look the transfer up at the destination (a lookup, never a guess);
    2. ``starting`` -> seal the session's committed bundle under a fresh 32-byte key into
       ``<id>.payload`` (durable), then record ``prepared`` with bytes and sha256;
    3. record ``transferring``; prepare at the destination, upload from its durable offset,
       commit; require ``committed``;
    4. a ``conflict`` answer to prepare or commit (or a lookup reporting ``conflict``) is final:
       record ``conflict``, drop the sealed payload, keep the session here (unfenced);
    5. on any other error, look the destination up again: ``committed`` there counts as success,
       ``conflict`` is recorded as in 4, anything else records ``ambiguous`` (kept statuses keep,
       with the error attached);
    6. record ``destination_committed``;
    7. move: delete the source session (only now: :func:`machine.may_delete_source`), then
       ``completed`` with ``source_deleted``; a failed delete records
       ``destination_committed_source_retained`` with ``last_error``. Copy: ``completed``.

restore (storage tier, destination ``"local"``)
    fetch the bundle from the storage node, check size and SHA-256, open it with the
    transfer's key, adopt it as a local session (durable, only where none is held), record
    ``source_restored``; for a move then delete the remote copy: ``completed`` or
    ``source_restored_remote_retained``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Optional, Protocol

from ..durable import atomic_write
from ..errors import KvpackError, MigrationError
from . import failpoints
from . import machine as M
from ..vocab import sha256_hex
from .bundle import new_transport_key, open_sealed, seal
from .journal import decode_key, encode_key


class DestinationConflict(MigrationError):
    """The destination refused this transfer for good (409 ``conflict`` at prepare or commit)."""

    def __init__(self, message: str) -> None:
        super().__init__("conflict", message)


class Destination(Protocol):
    """What a tier implements for the orchestrators (decode: :mod:`.decode_tier`; storage:
    :mod:`.storage_tier`). ``lookup`` answers the destination's status of the transfer (None:
    no record) and, while it is ``prepared``, its durable upload offset."""

    def lookup(self, rec: M.TransferRecord) -> tuple[Optional[M.Status], int]: ...

    def prepare(self, rec: M.TransferRecord, identity: dict[str, Optional[str]]) -> M.Status: ...

    def upload(self, rec: M.TransferRecord, path: str, offset: int, progress: Optional[Callable[[int], None]] = None) -> None: ...

    def commit(self, rec: M.TransferRecord) -> M.Status: ...

    def delete(self, rec: M.TransferRecord) -> None: ...

    def fetch(self, rec: M.TransferRecord) -> bytes: ...

    def close(self) -> None: ...


def _err(exc: BaseException) -> str:
    if isinstance(exc, KvpackError):
        return f"{exc.category}: {exc.message}"
    return f"{type(exc).__name__}: {exc}"


# -- export ------------------------------------------------------------------------------------------------


def run_export(svc: Any, rec: M.TransferRecord, dest: Destination) -> M.TransferRecord:
    if rec.status in (M.COMPLETED, M.SOURCE_RESTORED, M.SOURCE_RESTORED_REMOTE_RETAINED):
        return rec
    try:
        rec = _drive(svc, rec, dest)
    except DestinationConflict as exc:
        # records are immutable: what the failed run last recorded is the journal's record
        rec = _record_conflict(svc, svc.journals.require(rec.id), exc.message)
    except Exception as exc:  # noqa: BLE001 - any failure before the commit is recorded, never lost in a thread
        rec = _after_error(svc, svc.journals.require(rec.id), dest, exc)
    if rec.status == M.CONFLICT:
        svc.journals.unlink_payload(rec.id)
        return rec
    if rec.status not in M.DESTINATION_DURABLE:
        return rec
    failpoints.hit("source.after_destination_committed")
    return finish_export(svc, rec)


def _drive(svc: Any, rec: M.TransferRecord, dest: Destination) -> M.TransferRecord:
    """Run the plan from the current status until the destination commit is on record."""
    j = svc.journals
    if rec.status in M.KEPT_ON_FAILURE:
        return rec
    payload = j.payload_path(rec.id)
    dstatus, received = (None, 0) if rec.status == M.STARTING else dest.lookup(rec)
    step = M.plan(rec.status, rec.mode, have_payload=os.path.exists(payload), destination=dstatus, received=received, size=rec.bytes)
    if step.action == "export":
        if rec.status != M.STARTING:
            raise MigrationError("integrity", "the sealed payload of this transfer is gone; it cannot be resumed")
        rec = _seal(svc, rec, payload)
        step = M.Step("prepare")
    if step.action in ("prepare", "upload", "commit"):
        if rec.status != M.TRANSFERRING:
            rec = j.transition(rec, M.TRANSFERRING, f"next: {step.action}")
        rec, step = _send(svc, rec, dest, step, payload)
    if step.action == "record_committed":
        rec = j.transition(rec, M.DESTINATION_COMMITTED, "destination committed", last_error=None)
    elif step.action == "record_conflict":
        rec = _record_conflict(svc, rec, "destination lookup: conflict")
    return rec


def _seal(svc: Any, rec: M.TransferRecord, payload: str) -> M.TransferRecord:
    plain = svc.registry.bundle_bytes(rec.session_id)
    key = new_transport_key()
    sealed = seal(plain, key)
    atomic_write(payload, sealed, mode=0o600)
    return svc.journals.transition(rec, M.PREPARED, "sealed payload written", bytes=len(sealed), sha256=sha256_hex(sealed), transport_key=encode_key(key))


def _send(svc: Any, rec: M.TransferRecord, dest: Destination, step: M.Step, payload: str) -> tuple[M.TransferRecord, M.Step]:
    """prepare -> upload -> commit, from ``step`` on; returns the record and the final step."""
    j = svc.journals
    if step.action == "prepare":
        failpoints.hit("source.before_prepare")
        st = dest.prepare(rec, svc.identity_fields())
        failpoints.hit("source.after_prepare")
        if st == M.COMMITTED:
            return rec, M.Step("record_committed")
        if st == M.UPLOADED:
            step = M.Step("commit")
        else:
            dstatus, received = dest.lookup(rec)
            step = M.plan(rec.status, rec.mode, have_payload=True, destination=dstatus, received=received, size=rec.bytes)
    if step.action == "upload":
        rec = j.note(rec, f"upload from {step.offset} of {rec.bytes}")
        svc.note_progress(rec.id, step.offset, resumed_from=step.offset)
        tid = rec.id
        dest.upload(rec, payload, step.offset, lambda n: svc.note_progress(tid, n))
        failpoints.hit("source.after_upload")
        step = M.Step("commit")
    if step.action == "commit":
        if dest.commit(rec) != M.COMMITTED:
            raise MigrationError("transport", "destination did not durably commit the transfer")
        step = M.Step("record_committed")
    return rec, step


def _record_conflict(svc: Any, rec: M.TransferRecord, reason: str) -> M.TransferRecord:
    if rec.status == M.CONFLICT:
        return rec
    if rec.status not in (M.TRANSFERRING, M.AMBIGUOUS):
        return svc.journals.record_failure(rec, f"conflict: {reason}")
    return svc.journals.transition(rec, M.CONFLICT, f"destination refused: {reason}", last_error=f"conflict: {reason}")


def _after_error(svc: Any, rec: M.TransferRecord, dest: Destination, exc: Exception) -> M.TransferRecord:
    """D.4 step 5: reconcile by lookup before recording anything."""
    j = svc.journals
    text = _err(exc)
    if rec.status in M.KEPT_ON_FAILURE:
        return j.record_failure(rec, text)
    try:
        dstatus, _ = dest.lookup(rec)
    except Exception as exc2:  # noqa: BLE001
        dstatus = None
        text += f"; destination lookup failed: {_err(exc2)}"
    if dstatus == M.COMMITTED and rec.status in (M.TRANSFERRING, M.AMBIGUOUS):
        return j.transition(rec, M.DESTINATION_COMMITTED, f"error ({text}); destination lookup: committed", last_error=None)
    if dstatus == M.CONFLICT and rec.status in (M.TRANSFERRING, M.AMBIGUOUS):
        return _record_conflict(svc, rec, f"error ({text}); destination lookup: conflict")
    return j.record_failure(rec, text)


def finish_export(svc: Any, rec: M.TransferRecord) -> M.TransferRecord:
    j = svc.journals
    if rec.status not in M.DESTINATION_DURABLE:
        return rec
    if rec.mode == "copy":
        j.unlink_payload(rec.id)
        return j.transition(rec, M.COMPLETED, "copy complete", last_error=None)
    assert M.may_delete_source(rec.mode, rec.status)  # the move invariant, checked at the act
    try:
        failpoints.hit("source.delete")
        svc.registry.delete(rec.session_id)
        j.unlink_payload(rec.id)
    except (KvpackError, OSError) as exc:
        return j.transition(rec, M.DESTINATION_COMMITTED_SOURCE_RETAINED, "source delete failed", last_error=_err(exc))
    return j.transition(rec, M.COMPLETED, "source deleted", source_deleted=True, last_error=None)


# -- restore from storage -----------------------------------------------------------------------------------


def run_restore(svc: Any, rec: M.TransferRecord, dest: Destination) -> M.TransferRecord:
    j = svc.journals
    sid = rec.session_id
    if rec.status not in (M.SOURCE_RESTORED, M.SOURCE_RESTORED_REMOTE_RETAINED):
        try:
            sealed = dest.fetch(rec)
            plain = open_sealed(sealed, decode_key(rec.transport_key))
            _adopt_restored(svc, sid, plain)
        except (KvpackError, OSError) as exc:
            return j.note(rec, f"restore failed: {_err(exc)}", last_error=_err(exc))
        rec = j.transition(rec, M.SOURCE_RESTORED, "restored from storage", phase="restore", last_error=None)
    if rec.mode != "move" or rec.status == M.COMPLETED:
        return rec
    try:
        failpoints.hit("source.remote_delete")
        dest.delete(rec)
    except (KvpackError, OSError) as exc:
        return j.transition(rec, M.SOURCE_RESTORED_REMOTE_RETAINED, "remote delete failed", last_error=_err(exc))
    return j.transition(rec, M.COMPLETED, "remote copy deleted", last_error=None)


def _adopt_restored(svc: Any, sid: str, plain: bytes) -> None:
    """Install the restored bundle where no session of that id is held; the very same bundle
    already held (a re-run) is fine; anything else is a conflict, never overwritten."""
    with svc.registry.lock:
        observed = svc.registry.observe(sid)
        if isinstance(observed, M.Held):
            if observed.bundle_sha256 != sha256_hex(plain):
                raise MigrationError("conflict", f"session {sid} exists here with other state; not overwritten")
            return
        svc.registry.install(sid, plain, expected=observed)
