"""One decode node's migration service: registry, journals, runners and the incoming side.

The ASGI app (:mod:`kvpack.node.api`) is a thin HTTP layer over this object. Heavy work
(sealing, adoption) runs on worker threads; each transfer runs on at most one thread at a time
(a per-transfer lock), so a reconcile racing a running transfer waits for it rather than
acting twice.

Incoming commit ordering (the destination's durable commit)::

    verify payload (size, SHA-256), open it, decode the bundle, check identity and adopt it
    (nothing is visible yet) -> journal ``committed`` (the commit point, durable)
    -> session file written (atomic) and registered live -> journal ``installed``
    -> payload removed

A crash after the commit point leaves ``committed`` with the payload still on disk, and
:meth:`MigrationService.recover` installs it at the next start, so a committed transfer is
never lost and never reported committed without its session.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
import time
from typing import Any

from ..durable import durable_unlink, ensure_dir
from ..errors import MigrationError
from . import failpoints
from . import machine as M
from .bundle import check_identity, decode_bundle, open_sealed
from .config import NodeConfig, build_engine, read_api_key
from .decode_tier import LAYOUT_ABI, DecodeDestination, validate_decode_destination
from .journal import Journals, decode_key, valid_id, view
from .registry import SessionRegistry
from .storage_tier import StorageDestination, load_storage_node
from .transfer import run_export, run_restore

MAX_TRANSFER_BYTES = 32 * 1024**3
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
IDENTITY_KEYS = (
    "model_sha256",
    "tokenizer_sha256",
    "template_sha256",
    "layout_abi",
    "engine_identity_sha256",
    "dflash_identity_sha256",
    "vision_projector_sha256",
    "vision_preprocessing_sha256",
)


def new_transfer_id() -> str:
    return "xfer-" + secrets.token_hex(16)


def new_session_id() -> str:
    return "sess-" + secrets.token_hex(16)


class MigrationService:
    def __init__(self, cfg: NodeConfig, *, engine=None) -> None:
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
        self.progress: dict[str, dict[str, int]] = {}
        self.recover()

    # -- identity -------------------------------------------------------------------------------------
    def identity_fields(self) -> dict[str, Any]:
        ident = self.engine.identity
        ids = ident.ids()
        tmpl = ident.chat_template_digest
        if not _HEX64.match(tmpl or ""):
            tmpl = hashlib.sha256((tmpl or "").encode()).hexdigest()
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

    # -- recovery -------------------------------------------------------------------------------------
    def recover(self) -> None:
        """Finish installs whose commit is on record (crash between commit point and install)."""
        for rec in self.journals.all():
            if rec["direction"] == "incoming" and rec["status"] == M.COMMITTED and not rec.get("installed"):
                self._install_committed(rec)

    def _install_committed(self, rec: dict[str, Any]) -> None:
        path = self.journals.payload_path(rec["id"])
        with open(path, "rb") as fh:
            sealed = fh.read()
        plain = open_sealed(sealed, decode_key(rec["transport_key"]))
        self.registry.install(rec["session_id"], plain)
        rec["installed"] = True
        rec.setdefault("history", []).append({"status": M.COMMITTED, "note": "session installed", "t": time.time()})
        self.journals.save(rec)
        durable_unlink(path)

    # -- outgoing ---------------------------------------------------------------------------------------
    def start_migration(self, sid: str, destination: str, mode: str, tier: str, transfer_id: str | None) -> dict[str, Any]:
        if mode not in M.MODES:
            raise MigrationError("usage", "mode must be copy or move")
        if transfer_id is not None and not valid_id(transfer_id):
            raise MigrationError("usage", "transfer_id must be 1..128 of [A-Za-z0-9_-]")
        if not valid_id(sid):
            raise MigrationError("usage", "session id must be 1..128 of [A-Za-z0-9_-]")
        if tier == "decode":
            destination = validate_decode_destination(destination)
            if self.peer_key is None:
                raise MigrationError("state", "migration_not_configured: no peer API key file")
        elif tier == "storage":
            if destination == "local":
                return self._start_restore(sid, mode, transfer_id)
            load_storage_node(self.cfg.cluster_dir, destination)
        else:
            raise MigrationError("usage", "tier must be decode or storage")
        tid = transfer_id or new_transfer_id()
        with self.journals.lock:
            existing = self.journals.load(tid)
            if existing is not None:
                if (existing["direction"], existing["session_id"], existing["destination"], existing["mode"], existing["tier"]) != (
                    "outgoing",
                    sid,
                    destination,
                    mode,
                    tier,
                ):
                    raise MigrationError("conflict", f"transfer {tid} is bound to another session, destination or mode")
                self.schedule(tid)
                return view(existing)
            if not self.registry.exists(sid):
                raise MigrationError("not_found", f"session {sid} does not exist")
            fenced = self.registry.fence(sid)
            if fenced:
                raise MigrationError("conflict", f"session {sid} is busy: transfer {fenced} is moving it")
            rec = {
                "id": tid,
                "session_id": sid,
                "direction": "outgoing",
                "mode": mode,
                "tier": tier,
                "destination": destination,
                "status": M.STARTING,
                "bytes": 0,
                "sha256": "",
                "source_deleted": False,
                "last_error": None,
                "phase": "export",
            }
            self.journals.create(rec)
        self.schedule(tid)
        return view(rec)

    def _start_restore(self, sid: str, mode: str, tid: str | None) -> dict[str, Any]:
        if tid is None:
            raise MigrationError("usage", "a restore from storage needs the transfer_id of the export")
        with self.journals.lock:
            rec = self.journals.require(tid)
            if (rec["direction"], rec["session_id"], rec["tier"], rec["mode"]) != ("outgoing", sid, "storage", mode):
                raise MigrationError("conflict", f"transfer {tid} does not match this session, tier and mode")
            if rec.get("phase") != "restore" and rec["status"] not in (M.COMPLETED, *M.DESTINATION_DURABLE):
                raise MigrationError("conflict", f"transfer {tid} is {rec['status']}: the storage node holds no committed bundle yet")
            if rec.get("phase") != "restore":
                rec["phase"] = "restore-pending"
                self.journals.save(rec)
        self.schedule(tid)
        return view(rec)

    def reconcile(self, tid: str) -> dict[str, Any]:
        rec = self.journals.require(tid)
        if rec["direction"] != "outgoing":
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

    def run_now(self, tid: str) -> dict[str, Any]:
        """Run (or reconcile) a transfer on this thread; returns the final record."""
        self._run(tid)
        return self.journals.require(tid)

    def _destination(self, rec: dict[str, Any]):
        if rec["tier"] == "decode":
            if self.peer_key is None:
                raise MigrationError("state", "migration_not_configured: no peer API key file")
            return DecodeDestination(rec["destination"], self.peer_key, self.cfg.peer_ca, chunk_bytes=self.cfg.upload_chunk_bytes)
        node = load_storage_node(self.cfg.cluster_dir, rec["destination"])
        return StorageDestination(node, self.cfg.ssh_identity_file, os.path.join(self.cfg.home, "ssh"), chunk_bytes=self.cfg.upload_chunk_bytes)

    def _run(self, tid: str) -> None:
        with self._guard:
            lock = self._run_locks.setdefault(tid, threading.Lock())
        with lock:
            rec = self.journals.require(tid)
            try:
                dest = self._destination(rec)
            except MigrationError as exc:
                if rec["status"] not in M.KEPT_ON_FAILURE:
                    self.journals.record_failure(rec, f"{exc.category}: {exc.message}")
                return
            try:
                if rec.get("phase") in ("restore", "restore-pending"):
                    if not (rec.get("phase") == "restore" and rec["status"] == M.COMPLETED):
                        run_restore(self, rec, dest)
                else:
                    run_export(self, rec, dest)
            finally:
                dest.close()

    def note_progress(self, tid: str, sent: int, resumed_from: int | None = None) -> None:
        p = self.progress.setdefault(tid, {"sent": 0, "resumed_from": 0})
        p["sent"] = sent
        if resumed_from is not None:
            p["resumed_from"] = resumed_from

    def progress_view(self, tid: str) -> dict[str, Any]:
        rec = self.journals.require(tid)
        p = self.progress.get(tid, {})
        return {
            "id": tid,
            "status": rec["status"],
            "phase": rec.get("phase", "export") if rec["direction"] == "outgoing" else "incoming",
            "running": self.running(tid),
            "bytes": rec.get("bytes", 0),
            "sent": p.get("sent", 0),
            "resumed_from": p.get("resumed_from", 0),
        }

    def running(self, tid: str) -> bool:
        t = self._runners.get(tid)
        return bool(t is not None and t.is_alive())

    # -- incoming ---------------------------------------------------------------------------------------
    def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        tid = body["transfer_id"]
        for name in ("transfer_id", "session_id"):
            if not valid_id(body[name]):
                raise MigrationError("usage", f"{name} must be 1..128 of [A-Za-z0-9_-]")
        if body["tier"] != "decode":
            raise MigrationError("usage", "only tier decode can be prepared on a decode node")
        if body["mode"] not in M.MODES:
            raise MigrationError("usage", "mode must be copy or move")
        if not 1 <= body["bytes"] <= MAX_TRANSFER_BYTES:
            raise MigrationError("usage", f"bytes must be in 1..{MAX_TRANSFER_BYTES}")
        for name in ("sha256", "model_sha256", "tokenizer_sha256", "template_sha256", "engine_identity_sha256"):
            if not _HEX64.match(body[name]):
                raise MigrationError("usage", f"{name} must be 64 lowercase hex digits")
        for name in ("dflash_identity_sha256", "vision_projector_sha256", "vision_preprocessing_sha256"):
            if body[name] is not None and not _HEX64.match(body[name]):
                raise MigrationError("usage", f"{name} must be null or 64 lowercase hex digits")
        if (body["vision_projector_sha256"] is None) != (body["vision_preprocessing_sha256"] is None):
            raise MigrationError("usage", "vision digests must be both present or both absent")
        if body["layout_abi"] != LAYOUT_ABI:
            raise MigrationError("usage", f"layout_abi must be {LAYOUT_ABI!r}")
        decode_key(body["transport_key"])
        mine = self.identity_fields()
        differing = [k for k in IDENTITY_KEYS if body[k] != mine[k]]
        if differing:
            raise MigrationError("identity_mismatch", f"identity differs from this node in: {', '.join(differing)}")
        material = {k: body[k] for k in ("session_id", "source", "mode", "tier", "bytes", "sha256", "transport_key", *IDENTITY_KEYS)}
        with self.journals.lock:
            existing = self.journals.load(tid)
            if existing is not None:
                if existing["direction"] != "incoming" or existing.get("material") != material:
                    raise MigrationError("conflict", f"transfer {tid} is already bound to other material")
                return view(existing)
            if self.registry.exists(body["session_id"]):
                raise MigrationError("conflict", f"session {body['session_id']} already exists on this node")
            rec = {
                "id": tid,
                "session_id": body["session_id"],
                "direction": "incoming",
                "mode": body["mode"],
                "tier": "decode",
                "destination": body["source"],
                "status": M.PREPARED,
                "bytes": body["bytes"],
                "sha256": body["sha256"],
                "source_deleted": False,
                "last_error": None,
                "transport_key": body["transport_key"],
                "received": 0,
                "installed": False,
                "material": material,
            }
            self.journals.create(rec)
            return view(rec)

    def status(self, tid: str) -> dict[str, Any]:
        return view(self.journals.require(tid))

    def upload_offset(self, tid: str) -> dict[str, Any]:
        rec = self.journals.require(tid)
        if rec["direction"] != "incoming":
            raise MigrationError("conflict", f"transfer {tid} is not incoming")
        received = rec["bytes"] if rec["status"] != M.PREPARED else int(rec.get("received", 0))
        return {"id": tid, "status": rec["status"], "bytes": rec["bytes"], "received": received}

    def commit(self, tid: str) -> dict[str, Any]:
        with self.journals.lock:
            rec = self.journals.require(tid)
            if rec["direction"] != "incoming":
                raise MigrationError("conflict", f"transfer {tid} is not incoming")
            if rec["status"] == M.COMMITTED:
                if not rec.get("installed"):
                    self._install_committed(rec)
                return view(rec)
            if rec["status"] != M.UPLOADED:
                raise MigrationError("state", f"transfer {tid} is {rec['status']}, not uploaded")
            path = self.journals.payload_path(tid)
            with open(path, "rb") as fh:
                sealed = fh.read()
            if len(sealed) != rec["bytes"] or hashlib.sha256(sealed).hexdigest() != rec["sha256"]:
                raise MigrationError("integrity", "stored payload no longer matches its size and SHA-256")
            plain = open_sealed(sealed, decode_key(rec["transport_key"]))
            bundle = decode_bundle(plain)
            check_identity(bundle.record, self.engine)
            if bundle.session_id != rec["session_id"]:
                raise MigrationError("integrity", "payload holds another session than the one prepared")
            failpoints.hit("dest.commit.before_journal")
            self.journals.transition(rec, M.COMMITTED, "payload verified; commit point", installed=False)
            failpoints.hit("dest.commit.after_journal")
            self.registry.install(rec["session_id"], plain)
            rec["installed"] = True
            self.journals.save(rec)
            durable_unlink(path)
            return view(rec)
