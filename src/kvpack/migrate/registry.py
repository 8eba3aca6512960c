"""The decode node's session registry: sessions this node holds, persisted as plain bundles.

A session lives at ``<home>/sessions/<id>.bundle`` (the plain session bundle of
:mod:`.bundle`, written atomically after every change): that file is the session's *committed
place* on this node. The live engine session is kept in memory and rebuilt from the file (a
verified adoption) after a restart.

Fencing enforces "never live on two nodes": a session with an outgoing **move** whose export
is not finished (any status from ``starting`` up to ``destination_committed_source_retained``)
is fenced: it refuses decode and a second migration, because the destination may already hold
it. The fence is derived from the durable journals, so it survives a crash of this node.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..durable import atomic_write, durable_unlink, ensure_dir
from ..errors import MigrationError
from . import machine as M
from ..vocab import sha256_hex
from .bundle import adopt_bundle, decode_bundle, export_bundle
from .journal import ID_RULE, Journals, valid_id


@dataclass
class LiveSession:
    session: Any
    revision: int
    sampler: dict
    rng: dict
    messages: list = field(default_factory=list)


def _logits_bytes(row) -> bytes:
    if hasattr(row, "detach"):
        row = row.detach().to("cpu").float().numpy()
    return np.asarray(row, dtype="<f4").tobytes()


def greedy(session, n: int) -> tuple[list[int], list[bytes]]:
    """n greedy steps; returns the tokens and the exact float32 logits row each came from."""
    if hasattr(session, "decode_greedy"):
        tokens, rows = session.decode_greedy(n)
        return list(tokens), [_logits_bytes(r) for r in rows]
    tokens, rows = [], []
    for _ in range(n):
        row = np.asarray(session.last_logits, dtype=np.float32)
        token = int(np.argmax(row))  # first maximum, as torch.argmax on CPU
        tokens.append(token)
        rows.append(row.astype("<f4").tobytes())
        session.prefill([token])
    return tokens, rows


class SessionRegistry:
    def __init__(self, home: str, engine, journals: Journals) -> None:
        self.dir = os.path.join(os.path.abspath(home), "sessions")
        ensure_dir(self.dir, mode=0o700)
        self.engine = engine
        self.journals = journals
        self.live: dict[str, LiveSession] = {}
        self.lock = threading.RLock()  # engines are not thread-safe; one session op at a time

    def path(self, sid: str) -> str:
        if not valid_id(sid):
            raise MigrationError("usage", f"session id must be {ID_RULE}")
        return os.path.join(self.dir, f"{sid}.bundle")

    def exists(self, sid: str) -> bool:
        return os.path.exists(self.path(sid))

    def fence(self, sid: str) -> str | None:
        """The transfer id of an unfinished outgoing move of ``sid`` (None when not fenced)."""
        for rec in self.journals.all():
            if rec.session_id == sid and M.fences(rec):
                return rec.id
        return None

    def observe(self, sid: str) -> M.SessionState:
        """This node's state of session ``sid`` now: what prepare records and commit compares.
        Call with :attr:`lock` held when the answer licenses an install."""
        with self.lock:
            try:
                with open(self.path(sid), "rb") as fh:
                    plain = fh.read()
            except FileNotFoundError:
                return M.ABSENT
            live = self.live.get(sid)
            revision = live.revision if live is not None else decode_bundle(plain).record["revision"]
            return M.Held(int(revision), sha256_hex(plain))

    # -- lifecycle -----------------------------------------------------------------------------------
    def create(self, sid: str, tokens: list[int], *, messages: list | None = None, seed: int = 0) -> dict:
        with self.lock:
            if self.exists(sid):
                raise MigrationError("conflict", f"session {sid} already exists")
            if not tokens:
                raise MigrationError("usage", "a session needs at least one prompt token")
            session = self.engine.new_session()
            try:
                session.prefill(tokens)
            except Exception as exc:  # engine refusals (token range, context)
                raise MigrationError("usage", f"prefill refused: {exc}") from None
            rng = np.random.default_rng(seed).bit_generator.state
            live = LiveSession(session, 0, {"kind": "greedy"}, _json_ints(rng), list(messages or []))
            self._persist(sid, live)
            self.live[sid] = live
            return self.info(sid)

    def _persist(self, sid: str, live: LiveSession) -> None:
        plain = export_bundle(live.session, session_id=sid, revision=live.revision, sampler=live.sampler, rng=live.rng, messages=live.messages)
        atomic_write(self.path(sid), plain, mode=0o600)

    def get(self, sid: str) -> LiveSession:
        with self.lock:
            live = self.live.get(sid)
            if live is not None:
                return live
            try:
                with open(self.path(sid), "rb") as fh:
                    plain = fh.read()
            except FileNotFoundError:
                raise MigrationError("not_found", f"session {sid} does not exist") from None
            session, rec = adopt_bundle(plain, self.engine)
            live = LiveSession(session, rec["revision"], rec["sampler"], rec["rng"], rec["messages"])
            self.live[sid] = live
            return live

    def list(self, limit: int = 10000) -> list[dict]:
        """The sessions held here, cheaply: id, live|fenced, bundle size and time; nothing is
        loaded into the engine (``info`` does that for one session)."""
        fenced = {rec.session_id for rec in self.journals.all() if M.fences(rec)}
        out = []
        with os.scandir(self.dir) as entries:
            for entry in entries:
                name = entry.name
                if not name.endswith(".bundle") or not valid_id(name[: -len(".bundle")]):
                    continue
                st = entry.stat()
                sid = name[: -len(".bundle")]
                out.append({"id": sid, "state": "fenced" if sid in fenced else "live", "bytes": st.st_size, "modified_unix": round(st.st_mtime, 3)})
        out.sort(key=lambda d: d["id"])
        return out[:limit]

    def info(self, sid: str) -> dict:
        with self.lock:
            live = self.get(sid)
            return {
                "id": sid,
                "position": live.session.position,
                "revision": live.revision,
                "cache_sha256": live.session.cache_digest().hex(),
                "state": "fenced" if self.fence(sid) else "live",
            }

    def decode(self, sid: str, n: int) -> dict:
        with self.lock:
            fenced = self.fence(sid)
            if fenced:
                raise MigrationError("state", f"session {sid} is being moved by transfer {fenced}; it is not live here")
            live = self.get(sid)
            tokens, rows = greedy(live.session, n)
            live.revision += 1
            self._persist(sid, live)
            return {
                "id": sid,
                "tokens": tokens,
                "logits_sha256": [hashlib.sha256(r).hexdigest() for r in rows],
                "position": live.session.position,
                "revision": live.revision,
            }

    def bundle_bytes(self, sid: str) -> bytes:
        """The committed plain bundle of ``sid`` (exported from the live session at its last change)."""
        with self.lock:
            try:
                with open(self.path(sid), "rb") as fh:
                    return fh.read()
            except FileNotFoundError:
                raise MigrationError("not_found", f"session {sid} does not exist") from None

    def adopt(self, sid: str, plain: bytes) -> LiveSession:
        """Verify and adopt a plain bundle as a new live session of ``sid`` (bit-exact restore),
        without making it visible: nothing is written or registered."""
        with self.lock:
            bundle = decode_bundle(plain)
            if bundle.session_id != sid:
                raise MigrationError("integrity", f"bundle holds session {bundle.session_id}, not {sid}")
            session, rec = adopt_bundle(bundle, self.engine)
            return LiveSession(session, rec["revision"], rec["sampler"], rec["rng"], rec["messages"])

    def publish(self, sid: str, plain: bytes, live: LiveSession, *, expected: M.SessionState) -> None:
        """Make an adopted session durable and live here, only if this node's state of ``sid``
        is still ``expected`` (else ``conflict``, nothing written). The check and the write
        happen under one lock, so no create, decode or other install can slip in between."""
        with self.lock:
            observed = self.observe(sid)
            if observed != expected:
                raise MigrationError("conflict", f"session {sid} is {M.describe(observed)} here, not {M.describe(expected)}; not overwritten")
            atomic_write(self.path(sid), plain, mode=0o600)
            self.live[sid] = live

    def install(self, sid: str, plain: bytes, *, expected: M.SessionState = M.ABSENT) -> None:
        """:meth:`adopt` then :meth:`publish`, under one hold of the lock."""
        with self.lock:
            self.publish(sid, plain, self.adopt(sid, plain), expected=expected)

    def delete(self, sid: str) -> bool:
        with self.lock:
            self.live.pop(sid, None)
            return durable_unlink(self.path(sid))


def _json_ints(obj):
    """numpy bit-generator state as plain JSON (128-bit integers as decimal strings)."""
    if isinstance(obj, dict):
        return {k: _json_ints(v) for k, v in obj.items()}
    if isinstance(obj, (int, np.integer)) and not isinstance(obj, bool):
        v = int(obj)
        return v if 0 <= v < 2**53 else str(v)
    return obj
