"""gc reads every lease object under ``leases/`` (S3): a damaged one -- not JSON, not an
object, ``protects`` not a list of ids, a ``ttl_s`` that is not a positive finite number --
protects nothing and never stops gc; once older than twice the lease time it is deleted
like the lease of a holder that died. Before: ``[]`` or ``{"protects": 5}`` raised out of
``protected()`` (AttributeError / TypeError): every gc of the store failed, ``internal``."""

from __future__ import annotations

import time

import pytest

from .helpers import TOKENS, S3Backend, engine, names, session_with

DAMAGED = [b"[]", b'{"protects": 5}', b'"x"', b'{"ttl_s": "NaN", "protects": []}', b'{"ttl_s": -1}', b"\xff\xfe", b'{"protects": [1, 2]}']


@pytest.mark.slow
def test_damaged_lease_objects_never_stop_gc_and_are_removed_once_old(tmp_path, seaweed):
    store = S3Backend(seaweed).new(tmp_path)
    eng = engine()
    session_with(eng, TOKENS[:600], store)
    for i, body in enumerate(DAMAGED):
        store.env.write(f"leases/damaged-{i}.json", body)
    assert store.env.protected() == set()  # young: kept, but they protect nothing
    assert len(names(store, "leases/")) == len(DAMAGED)
    store.gc()
    assert store.verify(read_data=True)["ok"]
    store.env.lease_ttl_s = 0.5  # their age now passes twice the lease time
    time.sleep(2.5)
    store.gc()
    assert names(store, "leases/") == []
    assert store.verify(read_data=True)["ok"] and store.verify()["cuts"] == 3
