"""gc on S3 beside publishers, with the interleavings forced (no reliance on load).

* A delta whose parent is forgotten while it publishes: the publisher protects its parent with a lease, but releases the lease as soon as its index
entry is written. If that entry is written after gc listed the index and the lease is gone
before gc reads the leases, neither rule of docs/store.md "gc and leases" keeps the parent:
its pack and chunks are old, no index entry gc saw names them, no lease it read protects
them. Here the commit waits until gc has marked, and gc reads the leases only after the
  publisher is done.
* A forgotten cut republished while gc sweeps: the publisher rewrites the old chunks it reuses
  (so they are young), but gc deletes from a listing taken before that rewrite unless it
  checks each object's age again right before deleting it.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvpack.store import publish

from .helpers import TOKENS, S3Backend, engine, session_with

pytestmark = pytest.mark.slow


def test_gc_keeps_the_forgotten_parent_of_a_delta_committed_during_its_mark(tmp_path, seaweed, monkeypatch):
    grace = 2.0
    store = S3Backend(seaweed, gc_grace_s=grace).new(tmp_path, name="parent-race")
    eng = engine()
    tokens = TOKENS[:900]
    session_with(eng, tokens[:768], store)  # cuts 256, 512 and the parent, 768
    parent = store.find_deepest(tokens[:768], eng.layout, eng.ids())
    assert parent is not None and parent.cut == 768
    time.sleep(grace + 1.0)  # every object of the parent is now older than the grace period
    session = eng.new_session()
    session.prefill(tokens, chunk_size=256)

    parent_picked, gc_marked = threading.Event(), threading.Event()
    real_commit = publish._commit_index

    def commit_after_gc_marked(store_, node_id, mid):
        parent_picked.set()  # the parent is protected, confirmed and built on
        assert gc_marked.wait(60)
        return real_commit(store_, node_id, mid)

    monkeypatch.setattr(publish, "_commit_index", commit_after_gc_marked)
    reports: list = []
    publisher = threading.Thread(target=lambda: reports.append(store.save(session)))
    publisher.start()
    assert parent_picked.wait(60)
    store.forget(parent.manifest_id)  # the delta's parent is now named by no index entry

    real_protected = store.env.protected

    def protected_after_the_publisher_is_done():
        gc_marked.set()  # gc has listed and marked the index without the new entry
        publisher.join(60)  # it commits and releases the lease protecting its parent
        return real_protected()

    monkeypatch.setattr(store.env, "protected", protected_after_the_publisher_is_done)
    store.gc()
    monkeypatch.undo()
    assert not publisher.is_alive() and reports and reports[0].kind == "delta"

    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    assert hit is not None and hit.cut == 900 and hit.manifest_id.hex() == reports[0].manifest_id
    report = store.verify(read_data=True)
    assert report["ok"], report["problems"][:5]
    live = eng.new_session()
    store.restore(hit, live, tokens)
    assert live.cache_digest() == session.cache_digest()
    store.gc()  # a later gc keeps the whole chain too (and quarantines nothing)
    assert store.verify(read_data=True)["ok"]
    assert store.find_deepest(tokens, eng.layout, eng.ids()).cut == 900


def test_gc_keeps_old_chunks_a_publisher_reuses_after_gc_listed_them(tmp_path, seaweed, monkeypatch):
    grace = 2.0
    store = S3Backend(seaweed, gc_grace_s=grace).new(tmp_path, name="reuse-race")
    eng = engine()
    tokens = TOKENS[:768]
    session_with(eng, tokens, store)
    cut = store.find_deepest(tokens, eng.layout, eng.ids())
    assert cut is not None and cut.cut == 768
    store.forget(cut.manifest_id)  # its own chunks (tokens 512..768) are now garbage
    time.sleep(grace + 1.0)  # ... and older than the grace period

    real_list = store.env.list
    republished: list = []

    def republish_after_gc_listed_the_chunks(prefix):
        listing = list(real_list(prefix))
        if prefix == "chunks/" and not republished:
            # the cut is saved again: its old chunks are reused (and rewritten: young again)
            republished.append(session_with(eng, tokens, store))
        return iter(listing)

    monkeypatch.setattr(store.env, "list", republish_after_gc_listed_the_chunks)
    store.gc()
    monkeypatch.undo()
    assert republished

    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    assert hit is not None and hit.cut == 768
    report = store.verify(read_data=True)
    assert report["ok"], report["problems"][:5]
    live = eng.new_session()
    store.restore(hit, live, tokens)
    assert live.cache_digest() == republished[0].cache_digest()
