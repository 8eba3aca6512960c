"""One decode node's migration service: registry, journals, runners and the incoming side.

Why it exists: the ASGI app (:mod:`kvpack.node.api`) is a thin HTTP layer over this object,
which owns the node's migration state (journals, sessions, running transfers). Heavy work
(sealing, adoption) runs on worker threads; each transfer runs on at most one thread at a time
(a per-transfer lock), so a reconcile racing a running transfer waits for it rather than acting
twice. What it must never do: decide transitions itself (:mod:`.machine` does) or act before
the journal records the step. The destination side lives in :mod:`.incoming`.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Any, Optional

from ..durable import ensure_dir
from ..errors import MigrationError
from . import machine as M
from .config import NodeConfig, build_engine, read_api_key
from .decode_tier import DecodeDestination, validate_decode_destination
from ..vocab import is_hex64, sha256_hex
from .incoming import LAYOUT_ABI, MAX_TRANSFER_BYTES, IncomingTransfers
from .journal import ID_RULE, Journals, valid_id, view
from .registry import SessionRegistry
from .s3_tier import S3Destination
from .s3_tier import parse_destination as parse_s3_destination
from .storage_tier import StorageDestination, load_storage_node
from .transfer import Destination, run_export, run_restore

__all__ = ["MAX_TRANSFER_BYTES", "MigrationService", "new_session_id", "new_transfer_id"]


def new_transfer_id() -> str:
    return "xfer-" + secrets.token_hex(16)


def new_session_id() -> str:
    return "sess-" + secrets.token_hex(16)


class MigrationService:
    def __init__(self, cfg: NodeConfig, *, engine: Any = None) -> None:
        self.cfg = cfg
        ensure_dir(cfg.home, mode=0o700)
        self.journals = Journals(cfg.home)
        self.engine = engine if engine is not None else build_engine(cfg.engine)
        self.registry = SessionRegistry(cfg.home, self.engine, self.journals)
        self.api_key = read_api_key(cfg.api_key_file)
        self.peer_key = read_api_key(cfg.peer_api_key_file) if cfg.peer_api_key_file else None
        self._runners: dict[str, threading.Thread] = {}
        self._run_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._uploads: set[str] = set()  # transfer ids with an upload in progress (one writer each)
        self.progress: dict[str, dict[str, int]] = {}
        self.incoming = IncomingTransfers(self.journals, self.registry, self.identity_fields())
        self.incoming.recover()

    # -- identity -------------------------------------------------------------------------------------
    def identity_fields(self) -> dict[str, Optional[str]]:
        ident = self.engine.identity
        ids = ident.ids()
        tmpl = ident.chat_template_digest
        if not is_hex64(tmpl):
            tmpl = sha256_hex(tmpl or "")
        return {
            "model_sha256": ids.weights_config.hex(),
            "tokenizer_sha256": ids.tokenizer_template.hex(),
            "template_sha256": tmpl,
            "layout_abi": LAYOUT_ABI,
            "engine_identity_sha256": ids.digest().hex(),
            "dflash_identity_sha256": None,
            "vision_projector_sha256": None,
            "vision_preprocessing_sha256": None,
        }

    # -- incoming (D.3), delegated ------------------------------------------------------------------------
    def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.incoming.prepare(body)

    def commit(self, tid: str) -> dict[str, Any]:
        return self.incoming.commit(tid)

    def upload_offset(self, tid: str) -> dict[str, Any]:
        return self.incoming.upload_offset(tid)

    def status(self, tid: str) -> dict[str, Any]:
        return view(self.journals.require(tid))

    def claim_upload(self, tid: str) -> bool:
        """Take the single-writer claim on ``tid``'s upload; False when another upload holds it."""
        with self._guard:
            if tid in self._uploads:
                return False
            self._uploads.add(tid)
            return True

    def release_upload(self, tid: str) -> None:
        with self._guard:
            self._uploads.discard(tid)

    # -- outgoing -------------------------------------------------------------------------------------------
    def start_migration(self, sid: str, destination: str, mode: str, tier: str, transfer_id: Optional[str]) -> dict[str, Any]:
        if mode not in M.MODES:
            raise MigrationError("usage", "mode must be copy or move")
        if transfer_id is not None and not valid_id(transfer_id):
            raise MigrationError("usage", f"transfer_id must be {ID_RULE}")
        if not valid_id(sid):
            raise MigrationError("usage", f"session id must be {ID_RULE}")
        if tier == "decode":
            destination = validate_decode_destination(destination)
            if self.peer_key is None:
                raise MigrationError("state", "migration_not_configured: no peer API key file")
        elif tier == "storage":
            if destination == "local":
                return self._start_restore(sid, mode, transfer_id)
            if destination.startswith("s3://"):
                parse_s3_destination(destination)  # the s3 kind: a bucket prefix, no enrollment
            else:
                load_storage_node(self.cfg.cluster_dir, destination)
        else:
            raise MigrationError("usage", "tier must be decode or storage")
        tid = transfer_id or new_transfer_id()
        with self.journals.lock:
            existing = self.journals.load(tid)
            if existing is not None:
                if (existing.direction, existing.session_id, existing.destination, existing.mode, existing.tier) != ("outgoing", sid, destination, mode, tier):
                    raise MigrationError("conflict", f"transfer {tid} is bound to another session, destination or mode")
                self.schedule(tid)
                return view(existing)
            if not self.registry.exists(sid):
                raise MigrationError("not_found", f"session {sid} does not exist")
            fenced = self.registry.fence(sid)
            if fenced:
                raise MigrationError("conflict", f"session {sid} is busy: transfer {fenced} is moving it")
            rec = self.journals.save(M.new_outgoing(tid, sid, mode, tier, destination, now=time.time()))  # type: ignore[arg-type]
        self.schedule(tid)
        return view(rec)

    def _start_restore(self, sid: str, mode: str, tid: Optional[str]) -> dict[str, Any]:
        if tid is None:
            raise MigrationError("usage", "a restore from storage needs the transfer_id of the export")
        with self.journals.lock:
            rec = self.journals.require(tid)
            if (rec.direction, rec.session_id, rec.tier, rec.mode) != ("outgoing", sid, "storage", mode):
                raise MigrationError("conflict", f"transfer {tid} does not match this session, tier and mode")
            if rec.phase != "restore" and rec.status not in (M.COMPLETED, *M.DESTINATION_DURABLE):
                raise MigrationError("conflict", f"transfer {tid} is {rec.status}: the storage node holds no committed bundle yet")
            if rec.phase != "restore":
                rec = self.journals.note(rec, "restore requested", phase="restore-pending")
        self.schedule(tid)
        return view(rec)

    def reconcile(self, tid: str) -> dict[str, Any]:
        rec = self.journals.require(tid)
        if rec.direction != "outgoing":
            return view(rec)  # incoming transfers are driven by their source
        # Synchronous: the caller gets the status the lookup-driven run ended in. A run already
        # in flight holds the transfer's lock; this one waits and then re-checks (idempotent).
        self._run(tid)
        return view(self.journals.require(tid))

    def schedule(self, tid: str) -> None:
        with self._guard:
            t = self._runners.get(tid)
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=self._run, args=(tid,), name=f"transfer-{tid}", daemon=True)
            self._runners[tid] = t
            t.start()

    def run_now(self, tid: str) -> M.TransferRecord:
        """Run (or reconcile) a transfer on this thread; returns the final record."""
        self._run(tid)
        return self.journals.require(tid)

    def _destination(self, rec: M.TransferRecord) -> Destination:
        if rec.tier == "decode":
            if self.peer_key is None:
                raise MigrationError("state", "migration_not_configured: no peer API key file")
            return DecodeDestination(rec.destination, self.peer_key, self.cfg.peer_ca, chunk_bytes=self.cfg.upload_chunk_bytes)
        if rec.destination.startswith("s3://"):
            return S3Destination(rec.destination, endpoint=self.cfg.s3_endpoint, credentials_file=self.cfg.s3_credentials_file)
        node = load_storage_node(self.cfg.cluster_dir, rec.destination)
        return StorageDestination(node, self.cfg.ssh_identity_file, os.path.join(self.cfg.home, "ssh"), chunk_bytes=self.cfg.upload_chunk_bytes)

    def _run(self, tid: str) -> None:
        with self._guard:
            lock = self._run_locks.setdefault(tid, threading.Lock())
        with lock:
            rec = self.journals.require(tid)
            try:
                dest = self._destination(rec)
            except MigrationError as exc:
                if rec.status not in M.KEPT_ON_FAILURE:
                    self.journals.record_failure(rec, f"{exc.category}: {exc.message}")
                return
            try:
                if rec.phase in ("restore", "restore-pending"):
                    if not (rec.phase == "restore" and rec.status == M.COMPLETED):
                        run_restore(self, rec, dest)
                else:
                    run_export(self, rec, dest)
            finally:
                dest.close()

    def note_progress(self, tid: str, sent: int, resumed_from: Optional[int] = None) -> None:
        p = self.progress.setdefault(tid, {"sent": 0, "resumed_from": 0})
        p["sent"] = sent
        if resumed_from is not None:
            p["resumed_from"] = resumed_from

    def progress_view(self, tid: str) -> dict[str, Any]:
        rec = self.journals.require(tid)
        p = self.progress.get(tid, {})
        return {
            "id": tid,
            "status": rec.status.value,
            "phase": rec.phase if rec.direction == "outgoing" else "incoming",
            "running": self.running(tid),
            "bytes": rec.bytes,
            "sent": p.get("sent", 0),
            "resumed_from": p.get("resumed_from", 0),
        }

    def running(self, tid: str) -> bool:
        t = self._runners.get(tid)
        return bool(t is not None and t.is_alive())
