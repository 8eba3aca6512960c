"""Commit-time invariants at a decode destination, against real HTTPS daemons (issue 15).

Two copy transfers of one session reach ``uploaded`` at the destination; the first commit
installs the session, which then decodes there; the second commit must be refused with 409
``conflict`` (the destination's state is no longer what its prepare recorded: absent) and the
source must end ``conflict``, never ``completed`` and never ``ambiguous``. The decoded session
at the destination stays exactly as it was.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpack.errors import MigrationError
from kvpack.migrate import machine as M
from kvpack.migrate.bundle import new_transport_key, seal
from kvpack.migrate.config import build_engine, load_config
from kvpack.migrate.journal import encode_key
from kvpack.migrate.resume import receive_payload
from kvpack.migrate.service import MigrationService

from .conftest import API_KEY, write_secret


SID = "sess-twice"
MODEL_SID = "sess-model"
SMALL = {"kind": "arrays", "layers": 2, "kv_heads": 2, "head_dim": 8, "vocab": 64}


@pytest.mark.slow
def test_second_commit_never_overwrites_a_decoded_session(nodes):
    b = nodes("dec-b").start()
    a = nodes("dec-a").start("source.after_upload=kill")
    a.create(SID, 300)
    # Two copy transfers of the same session, each killed right after its upload: both sit at
    # "uploaded" at the destination, neither committed.
    for tid in ("xfer-twice-1", "xfer-twice-2"):
        assert a.migrate(SID, b.url, "copy", tid).status_code == 202
        assert a.wait_dead() == -9
        assert b.journal(tid)["status"] == "uploaded"
        a.start("source.after_upload=kill" if tid.endswith("1") else "")
    assert not b.has_session(SID)
    # Commit 1 installs the session at B; B decodes 7 tokens there.
    rc, view = a.reconcile_cli("xfer-twice-1")
    assert rc == 0 and view["status"] == "completed", view
    decoded = b.decode(SID, 7).json()
    assert decoded["position"] == 307
    before = b.info(SID).json()
    # Commit 2: refused 409 conflict at B; the source records "conflict" (final, not ambiguous).
    rc, view = a.reconcile_cli("xfer-twice-2")
    assert rc == 1 and view["status"] == "conflict", view
    assert "conflict" in view["last_error"]
    r = b.client.post("/__kvpack/v1/session-transfers/xfer-twice-2/commit")
    assert r.status_code == 409 and r.json()["error"]["type"] == "conflict", r.text
    incoming = b.journal("xfer-twice-2")
    assert incoming["status"] == "conflict"
    assert not (b.home / "session-transfers" / "xfer-twice-2.payload").exists()
    # The decoded session at B is intact and still decodes; the source keeps its own copy, live.
    assert b.info(SID).json() == before
    assert b.decode(SID, 1).json()["position"] == 308
    assert a.info(SID).json()["state"] == "live" and a.decode(SID, 1).status_code == 200
    # Reconciling again is idempotent: the conflict is final on both ends.
    rc, again = a.reconcile_cli("xfer-twice-2")
    assert rc == 1 and again["status"] == "conflict"
    assert not (a.home / "session-transfers" / "xfer-twice-2.payload").exists()


# -- the real destination service in-process, under hypothesis -------------------------------------------


class Source:
    """Sealed payloads of one session at two revisions, and their prepare bodies."""

    def __init__(self, root: Path, identity: dict) -> None:
        from kvpack.migrate.journal import Journals
        from kvpack.migrate.registry import SessionRegistry

        engine = build_engine(SMALL)
        home = root / "source"
        registry = SessionRegistry(str(home), engine, Journals(str(home)))
        registry.create(MODEL_SID, list(range(1, 41)))
        plains = [registry.bundle_bytes(MODEL_SID)]
        registry.decode(MODEL_SID, 2)
        plains.append(registry.bundle_bytes(MODEL_SID))
        self.payloads, self.bodies = [], []
        for i, plain in enumerate(plains):
            key = new_transport_key()
            sealed = seal(plain, key)
            self.payloads.append(sealed)
            self.bodies.append(
                {
                    "transfer_id": f"xfer-model-{i}",
                    "session_id": MODEL_SID,
                    "source": "kvpack-decode-source",
                    "mode": "copy",
                    "tier": "decode",
                    "bytes": len(sealed),
                    "sha256": hashlib.sha256(sealed).hexdigest(),
                    "transport_key": encode_key(key),
                    **identity,
                }
            )


async def _blocks(data: bytes, size: int = 64 * 1024):
    for i in range(0, len(data), size):
        yield data[i : i + size]


class DestinationService(RuleBasedStateMachine):
    """Two transfers of one session into a real MigrationService (files, journals, adoption):
    prepare / upload / commit in any order, decodes and drops at the destination, restarts."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="kvpack-commit-")
        root = Path(self.tmp.name)
        write_secret(root / "api.key", API_KEY)
        (root / "node.json").write_text(json.dumps({"home": "home", "api_key_file": "api.key", "engine": SMALL}))
        self.config = str(root / "node.json")
        self.svc = MigrationService(load_config(self.config))
        self.src = Source(root, self.svc.identity_fields())
        self.installed_by: list[int] = []  # commits that installed (in order)
        self.conflicted: set[int] = set()

    def teardown(self) -> None:
        self.tmp.cleanup()

    @initialize(staged=st.sampled_from([(0, 1), (1, 0), (0,), (1,), ()]))
    def stage(self, staged: tuple[int, ...]) -> None:
        """Mostly start with both transfers uploaded while the session is absent (the issue's
        race); the rules below then interleave everything else, re-prepares included."""
        for i in staged:
            self.prepare(i)
            self.upload(i)

    def info(self) -> dict | None:
        try:
            return self.svc.registry.info(MODEL_SID)
        except MigrationError:
            return None

    @rule(i=st.sampled_from((0, 1)))
    def prepare(self, i: int) -> None:
        before = self.info()
        try:
            v = self.svc.prepare(self.src.bodies[i])
            assert v["status"] in ("prepared", "uploaded", "committed", "conflict")
        except MigrationError as exc:
            assert exc.category == "conflict" and before is not None
        assert self.info() == before

    @rule(i=st.sampled_from((0, 1)))
    def upload(self, i: int) -> None:
        tid = self.src.bodies[i]["transfer_id"]
        before = self.info()
        try:
            v = asyncio.run(receive_payload(self.svc, tid, {}, _blocks(self.src.payloads[i])))
            assert v["status"] == "uploaded"
        except MigrationError as exc:
            assert exc.category in ("not_found", "conflict"), exc
        assert self.info() == before

    @rule(i=st.sampled_from((0, 1)))
    def commit(self, i: int) -> None:
        tid = self.src.bodies[i]["transfer_id"]
        before = self.info()
        try:
            v = self.svc.commit(tid)
        except MigrationError as exc:
            assert exc.category in ("not_found", "state", "conflict"), exc
            assert self.info() == before, "a refused commit changed the session held here"
            if exc.category == "conflict":
                self.conflicted.add(i)
                assert self.svc.journals.require(tid).status == M.CONFLICT
                assert not os.path.exists(self.svc.journals.payload_path(tid))
            return
        assert v["status"] == "committed"
        if i not in self.installed_by:
            assert before is None, "a commit installed over a session held here"
            self.installed_by.append(i)
        else:
            assert self.info() == before  # an idempotent re-commit changes nothing

    @precondition(lambda self: self.svc.registry.exists(MODEL_SID))
    @rule(n=st.integers(1, 3))
    def decode_at_destination(self, n: int) -> None:
        before = self.info()
        out = self.svc.registry.decode(MODEL_SID, n)
        assert out["position"] == before["position"] + n and out["revision"] == before["revision"] + 1

    @precondition(lambda self: self.svc.registry.exists(MODEL_SID))
    @rule()
    def drop_at_destination(self) -> None:
        self.svc.registry.delete(MODEL_SID)

    @rule()
    def restart(self) -> None:
        before = self.info()
        self.svc = MigrationService(load_config(self.config))
        assert self.info() == before

    @invariant()
    def conflicts_are_final(self) -> None:
        for i in self.conflicted:
            assert i not in self.installed_by
            assert self.svc.journals.require(self.src.bodies[i]["transfer_id"]).status == M.CONFLICT


DestinationService.TestCase.settings = settings(max_examples=30, stateful_step_count=12, deadline=None, suppress_health_check=list(HealthCheck))
test_destination_service_commit_invariant = DestinationService.TestCase
