"""A restore racing ``forget`` + ``gc``: the operator forgets the cut being restored and gc
removes the objects only it referenced. That is a miss (:class:`CutWithdrawn`, category
``miss``, counted), never ``incomplete``: nothing is quarantined, the live session is
untouched, and ``lookup_restore`` goes on with the next shallower cut. A chunk missing while
the index entry still names the cut stays ``incomplete`` (test_heal.py quarantines it).

* both backends: the forget and gc land between ``find_deepest`` and ``restore`` (POSIX gc
  takes the exclusive lock, so this is the only window there);
* S3, the interleaving forced: gc reads the leases before the restore writes its lease, then
  sweeps while the restore reads its chunks (the pack was already read), through
  ``lookup_restore``.
"""

from __future__ import annotations

import threading

import pytest

from kvpack.errors import StoreError
from kvpack.store import packstore
from kvpack.store.packstore import CutWithdrawn

from .helpers import TOKENS, S3Backend, engine, names, session_with


def _saved(store, eng):
    """Cuts 256, 512 and 768 (768 a delta on 512) and the hit of 768."""
    tokens = TOKENS[:768]
    src = session_with(eng, tokens, store)
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    assert hit is not None and hit.cut == 768
    return tokens, src, hit


def test_restore_of_a_cut_forgotten_and_collected_after_lookup_is_a_withdrawn_miss(tmp_path, backend):
    store = backend.new(tmp_path, name="withdrawn")
    eng = engine()
    tokens, src, hit = _saved(store, eng)
    store.forget(hit.manifest_id)
    removed = store.gc()
    assert removed["packs"] >= 1 and removed["chunks"] >= 1  # the cut's own objects are gone

    live = eng.new_session()
    with pytest.raises(CutWithdrawn) as caught:
        store.restore(hit, live, tokens)
    assert caught.value.category == "miss" and isinstance(caught.value, StoreError)
    assert store.withdrawn_restores == 1
    assert live.position == 0  # nothing installed
    assert store.restore_healing(hit, eng.new_session(), tokens) == (None, None)
    assert store.withdrawn_restores == 2
    assert names(store, "quarantine/") == []  # a withdrawal is not damage: no receipt
    assert store.verify(read_data=True)["ok"]
    # the shallower cut still serves, bit-exact
    found = store.lookup_restore(tokens, live)
    assert found.hit is not None and found.hit.cut == 512 and not found.quarantined
    assert live.cache_digest() == session_with(eng, tokens[:512]).cache_digest()
    del src


def test_a_missing_chunk_of_a_cut_still_indexed_is_not_a_withdrawal(tmp_path, backend):
    """The withdrawal check must not hide damage: same deletion, entry still in the index."""
    store = backend.new(tmp_path, name="not-withdrawn")
    eng = engine()
    tokens, _src, hit = _saved(store, eng)
    chain = store.load_chain(hit.manifest_id)
    below = {ref.content_id for m in chain[1:] for _k, _s, ref in m.chunk_refs()}
    own = next(ref for _k, _s, ref in chain[0].chunk_refs() if ref.content_id not in below)
    store.env.delete(f"chunks/{own.content_id.hex()}.kvchk")
    with pytest.raises(StoreError) as caught:
        store.restore(hit, eng.new_session(), tokens)
    assert caught.value.category == "incomplete" and not isinstance(caught.value, CutWithdrawn)
    assert store.withdrawn_restores == 0


@pytest.mark.slow
def test_gc_sweeping_under_a_lookup_restore_of_a_forgotten_cut_is_a_counted_miss(tmp_path, seaweed, monkeypatch):
    store = S3Backend(seaweed, gc_grace_s=0.0).new(tmp_path, name="withdrawn-race")
    eng = engine()
    tokens, _src, hit = _saved(store, eng)

    leases_read, restore_reading, gc_done = threading.Event(), threading.Event(), threading.Event()
    real_protected = store.env.protected

    def protected_then_wait():
        out = real_protected()  # before the restore's lease exists: it protects nothing
        leases_read.set()
        assert restore_reading.wait(60)
        return out

    real_find = store.find_deepest

    def find_then_forget(*args, **kw):
        found = real_find(*args, **kw)
        if found is not None and found.manifest_id == hit.manifest_id and not leases_read.is_set():
            store.forget(hit.manifest_id)  # the operator, right after this lookup found it
            gc_thread.start()
            assert leases_read.wait(60)
        return found

    real_read_into = packstore._EnvChunks.read_into
    first = threading.Lock()

    def read_after_the_sweep(self, ref, region):
        if first.acquire(blocking=False):  # the first chunk read of the restore
            restore_reading.set()
            assert gc_done.wait(60)
        return real_read_into(self, ref, region)

    results: list = []

    def run_gc():
        results.append(store.gc())
        gc_done.set()

    gc_thread = threading.Thread(target=run_gc)
    monkeypatch.setattr(store.env, "protected", protected_then_wait)
    monkeypatch.setattr(store, "find_deepest", find_then_forget)
    monkeypatch.setattr(packstore._EnvChunks, "read_into", read_after_the_sweep)
    live = eng.new_session()
    found = store.lookup_restore(tokens, live)
    gc_thread.join(60)
    monkeypatch.undo()

    assert results and results[0]["chunks"] >= 1  # the sweep removed the cut's chunks
    assert found.withdrawn == 1 and store.withdrawn_restores == 1
    assert not found.quarantined and names(store, "quarantine/") == []
    assert found.hit is not None and found.hit.cut == 512  # the next cut served, bit-exact
    assert live.cache_digest() == session_with(eng, tokens[:512]).cache_digest()
    assert store.verify(read_data=True)["ok"]
