"""The destination side of a decode-tier transfer: prepare, commit and crash recovery (D.3).

Why it exists: this is where a session arrives on a node, so this is where the commit invariant
is enforced against the node's real state. The decisions are :mod:`.machine`'s
(:func:`~.machine.prepare_decision`, :func:`~.machine.commit_decision`); this module reads the
state they judge, performs what they decide and journals it first. What it must never do:
install a session over a state other than the one prepare recorded, report ``committed``
without the session, or leave a refused transfer installable later.

Commit ordering (the destination's durable commit)::

    verify payload (size, SHA-256), open it, decode the bundle, check identity
    -> under the registry lock: adopt it (nothing visible yet), observe the session id,
       judge (commit invariant):
         conflict -> journal ``conflict`` (final), payload removed, 409
         proceed  -> journal ``committed`` (the commit point, durable)
                  -> session file written (atomic) and registered live -> journal ``installed``
    -> payload removed

A crash after the commit point leaves ``committed`` with the payload still on disk;
:meth:`IncomingTransfers.recover` installs it at the next start, before the API serves, so a
committed transfer is never lost and never reported committed without its session.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ..durable import durable_unlink
from ..errors import MigrationError
from . import failpoints
from . import machine as M
from ..vocab import is_hex64, sha256_hex
from .bundle import check_identity, decode_bundle, open_sealed
from .journal import ID_RULE, Journals, decode_key, valid_id, view
from .registry import SessionRegistry

MAX_TRANSFER_BYTES = 32 * 1024**3
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
LAYOUT_ABI = "kvpack-kv-layout-v1"


def material_from_prepare(body: dict[str, Any]) -> M.Material:
    """Validate an InternalTransferPrepare body (D.3 rules) into typed material."""
    for name in ("transfer_id", "session_id"):
        if not valid_id(body[name]):
            raise MigrationError("usage", f"{name} must be {ID_RULE}")
    if body["tier"] != "decode":
        raise MigrationError("usage", "only tier decode can be prepared on a decode node")
    if body["mode"] not in M.MODES:
        raise MigrationError("usage", "mode must be copy or move")
    if not 1 <= body["bytes"] <= MAX_TRANSFER_BYTES:
        raise MigrationError("usage", f"bytes must be in 1..{MAX_TRANSFER_BYTES}")
    for name in ("sha256", "model_sha256", "tokenizer_sha256", "template_sha256", "engine_identity_sha256"):
        if not is_hex64(body[name]):
            raise MigrationError("usage", f"{name} must be 64 lowercase hex digits")
    for name in ("dflash_identity_sha256", "vision_projector_sha256", "vision_preprocessing_sha256"):
        if body[name] is not None and not is_hex64(body[name]):
            raise MigrationError("usage", f"{name} must be null or 64 lowercase hex digits")
    if (body["vision_projector_sha256"] is None) != (body["vision_preprocessing_sha256"] is None):
        raise MigrationError("usage", "vision digests must be both present or both absent")
    if body["layout_abi"] != LAYOUT_ABI:
        raise MigrationError("usage", f"layout_abi must be {LAYOUT_ABI!r}")
    decode_key(body["transport_key"])
    return M.Material(**{k: body[k] for k in ("session_id", "source", "mode", "tier", "bytes", "sha256", "transport_key", *IDENTITY_KEYS)})


class IncomingTransfers:
    """Incoming transfers of one node: journals, the session registry and the node identity."""

    def __init__(self, journals: Journals, registry: SessionRegistry, identity: dict[str, Optional[str]]) -> None:
        self.journals = journals
        self.registry = registry
        self.identity = identity

    # -- prepare ----------------------------------------------------------------------------------
    def prepare(self, body: dict[str, Any]) -> dict[str, Any]:
        material = material_from_prepare(body)
        differing = [k for k in IDENTITY_KEYS if getattr(material, k) != self.identity[k]]
        if differing:
            raise MigrationError("identity_mismatch", f"identity differs from this node in: {', '.join(differing)}")
        tid = body["transfer_id"]
        with self.journals.lock:
            existing = self.journals.load(tid)
            observed = self.registry.observe(material.session_id)
            decision = M.prepare_decision(existing, material, observed)
            if decision.verdict == "refuse":
                raise MigrationError("conflict", decision.reason)
            if existing is not None:
                return view(existing)
            return view(self.journals.save(M.new_incoming(tid, material, observed, now=time.time())))

    def upload_offset(self, tid: str) -> dict[str, Any]:
        rec = self._incoming(tid)
        received = rec.bytes if rec.status != M.PREPARED else rec.received
        return {"id": tid, "status": rec.status.value, "bytes": rec.bytes, "received": received}

    def _incoming(self, tid: str) -> M.TransferRecord:
        rec = self.journals.require(tid)
        if rec.direction != "incoming":
            raise MigrationError("conflict", f"transfer {tid} is not incoming")
        return rec

    # -- commit -----------------------------------------------------------------------------------
    def commit(self, tid: str) -> dict[str, Any]:
        with self.journals.lock:
            rec = self.journals.require(tid)
            decision = M.commit_decision(rec, self.registry.observe(rec.session_id))
            if decision.verdict == "existing":
                return view(rec)
            if decision.verdict == "finish_install":
                return view(self.install_committed(rec))
            if decision.verdict == "refuse" and decision.category != "conflict":
                raise MigrationError(decision.category, decision.reason)
            if decision.verdict == "refuse":
                raise self._conflict(rec, decision.reason)
            plain = self._verified_plain(rec)
            rec = self._commit_point(rec, plain)
            durable_unlink(self.journals.payload_path(tid))
            return view(rec)

    def _verified_plain(self, rec: M.TransferRecord) -> bytes:
        with open(self.journals.payload_path(rec.id), "rb") as fh:
            sealed = fh.read()
        if len(sealed) != rec.bytes or sha256_hex(sealed) != rec.sha256:
            raise MigrationError("integrity", "stored payload no longer matches its size and SHA-256")
        plain = open_sealed(sealed, decode_key(rec.transport_key))
        bundle = decode_bundle(plain)
        check_identity(bundle.record, self.registry.engine)
        if bundle.session_id != rec.session_id:
            raise MigrationError("integrity", "payload holds another session than the one prepared")
        return plain

    def _commit_point(self, rec: M.TransferRecord, plain: bytes) -> M.TransferRecord:
        """Adopt, judge the invariant on the state *now*, journal, publish: one registry hold."""
        with self.registry.lock:
            live = self.registry.adopt(rec.session_id, plain)
            observed = self.registry.observe(rec.session_id)
            decision = M.commit_decision(rec, observed)
            if decision.verdict != "proceed":
                raise self._conflict(rec, decision.reason)
            failpoints.hit("dest.commit.before_journal")
            rec = self.journals.transition(rec, M.COMMITTED, "payload verified; commit point", installed=False)
            failpoints.hit("dest.commit.after_journal")
            self.registry.publish(rec.session_id, plain, live, expected=observed)
            return self.journals.note(rec, "session installed", installed=True)

    def _conflict(self, rec: M.TransferRecord, reason: str) -> MigrationError:
        """Record the conflict (final) and discard the payload, so it can never be installed."""
        if rec.status != M.CONFLICT:
            rec = self.journals.transition(rec, M.CONFLICT, reason, last_error=f"conflict: {reason}")
        durable_unlink(self.journals.payload_path(rec.id))
        return MigrationError("conflict", reason)

    # -- recovery ---------------------------------------------------------------------------------
    def recover(self) -> None:
        """Finish installs whose commit is on record (crash between commit point and install)."""
        for rec in self.journals.all():
            if rec.direction == "incoming" and rec.status == M.COMMITTED and not rec.installed:
                self.install_committed(rec)

    def install_committed(self, rec: M.TransferRecord) -> M.TransferRecord:
        path = self.journals.payload_path(rec.id)
        with self.registry.lock:
            observed = self.registry.observe(rec.session_id)
            if M.install_decision(observed) == "install":
                with open(path, "rb") as fh:
                    plain = open_sealed(fh.read(), decode_key(rec.transport_key))
                self.registry.install(rec.session_id, plain, expected=observed)
                text = f"session installed (bundle {sha256_hex(plain)[:12]})"
            else:
                text = f"session already installed ({M.describe(observed)})"
            rec = self.journals.note(rec, text, installed=True)
        durable_unlink(path)
        return rec
