"""The parsed-manifest cache (kvpack.format.pack.ManifestCache) behind PackStore.load_chain:
a cached parse saves only the parsing, never a check. A pack read again is authenticated
again, a damaged or replaced pack is refused though its manifest was cached, a damaged chunk
of a cached chain is refused, and another store's keys never accept a pack because its
manifest sits in the cache."""

from __future__ import annotations

import os
import shutil

import pytest

from kvpack.errors import FormatError, StoreError
from kvpack.format.pack import ManifestCache, decode_pack
from kvpack.store import PackStore
from kvpack.store.packstore import MANIFESTS

from .helpers import TOKENS, PosixBackend, engine, flip, session_with


@pytest.fixture
def published(tmp_path):
    MANIFESTS.clear()  # every test starts from an empty process-wide cache
    store = PosixBackend().new(tmp_path)
    eng = engine()
    full = session_with(eng, TOKENS, store)  # cuts 256, 512, 768, 1024, 1200
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert top is not None and top.cut == len(TOKENS)
    yield store, eng, full, top
    MANIFESTS.clear()


def _pack(store: PackStore, mid: bytes) -> str:
    return f"packs/{mid.hex()}.kvpkp"


def test_second_decode_reuses_the_parse_and_matches_an_uncached_one(published):
    store, _eng, _full, top = published
    data = store.env.read(_pack(store, top.manifest_id))
    cache = ManifestCache(4)
    first, plain = decode_pack(data, store.keys, manifests=cache)
    second, plain2 = decode_pack(data, store.keys, manifests=cache)
    assert second is first and plain2 == plain  # parsed once
    assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
    uncached, _ = decode_pack(data, store.keys)
    assert uncached == first and uncached is not first


def test_load_chain_parses_each_pack_once_per_process(published):
    store, _eng, _full, top = published
    MANIFESTS.clear()
    hits0, misses0 = MANIFESTS.hits, MANIFESTS.misses
    chain = store.load_chain(top.manifest_id)
    assert len(chain) >= 2 and MANIFESTS.misses - misses0 == len(chain) and MANIFESTS.hits == hits0
    other = PackStore.open(store.path)  # another PackStore object of the same store (vLLM's scheduler and worker)
    again = other.load_chain(top.manifest_id)
    assert [m.manifest_id() for m in again] == [m.manifest_id() for m in chain]
    assert MANIFESTS.hits - hits0 == len(chain) and all(a is b for a, b in zip(again, chain))


@pytest.mark.parametrize("where", ["header", "body", "footer"])
def test_a_damaged_pack_is_refused_though_its_manifest_is_cached(published, where):
    store, eng, _full, top = published
    store.load_chain(top.manifest_id)  # the chain is cached now
    name = _pack(store, top.manifest_id)
    size = len(store.env.read(name))
    flip(store, name, {"header": 100, "body": 4096 + 40, "footer": size - 100}[where])
    with pytest.raises(StoreError) as err:
        store.load_chain(top.manifest_id)
    assert err.value.category == "corrupt"
    with pytest.raises(FormatError):  # decode_pack itself refuses before any cache look-up
        decode_pack(store.env.read(name), store.keys, manifests=MANIFESTS)
    live = eng.new_session()
    with pytest.raises(StoreError):
        store.restore(top, live, TOKENS)
    assert live.position == 0  # nothing installed


def test_a_replaced_pack_is_not_served_from_the_cache(published):
    """The pack file of the top cut replaced by its parent's (valid, authentic, cached too):
    the chain refuses it, as without a cache."""
    store, _eng, _full, top = published
    chain = store.load_chain(top.manifest_id)
    parent = chain[0].schema.parent.manifest_id
    store.load_chain(parent)  # both manifests are cached
    store.env.write(_pack(store, top.manifest_id), store.env.read(_pack(store, parent)))
    with pytest.raises(StoreError) as err:
        store.load_chain(top.manifest_id)
    assert err.value.category == "corrupt" and "another manifest" in str(err.value)


def test_a_flipped_chunk_of_a_cached_chain_is_refused_and_quarantined(published):
    store, eng, full, top = published
    live = eng.new_session()
    store.restore(top, live, TOKENS)  # verified once: the chain is cached
    assert live.cache_digest() == full.cache_digest()
    chain = store.load_chain(top.manifest_id)
    below = {ref.content_id for m in chain[1:] for _k, _s, ref in m.chunk_refs()}
    ref = next(r for k, _s, r in chain[0].chunk_refs() if r.content_id not in below)
    flip(store, f"chunks/{ref.content_id.hex()}.kvchk", 4096 + 16 + 100)
    hits0 = MANIFESTS.hits
    again = eng.new_session()
    report, receipt = store.restore_healing(top, again, TOKENS)
    assert MANIFESTS.hits > hits0  # the chain came from the cache ...
    assert report is None and receipt is not None and receipt["index_entry_removed"]  # ... the chunk did not
    assert again.position == 0
    found = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert found is not None and found.cut == 1024


def test_another_stores_keys_never_accept_a_cached_manifest(published, tmp_path):
    """The same pack bytes under another root key: refused (footer HMAC), although the
    manifest they carry is in the process-wide cache."""
    store, _eng, _full, top = published
    store.load_chain(top.manifest_id)
    other = PosixBackend().new(tmp_path, name="other")
    assert other.keys.manifest_auth != store.keys.manifest_auth
    for sub in ("packs", "chunks"):
        for entry in os.listdir(os.path.join(store.path, sub)):
            shutil.copy(os.path.join(store.path, sub, entry), os.path.join(other.path, sub, entry))
    with pytest.raises(StoreError) as err:
        other.load_chain(top.manifest_id)
    assert err.value.category == "corrupt"
    assert getattr(err.value, "format_category", None) == "authentication"


def test_the_cache_is_bounded_and_refuses_a_zero_capacity(published):
    store, _eng, _full, top = published
    cache = ManifestCache(2)
    mids = [m.manifest_id() for m in store.load_chain(top.manifest_id)]
    assert len(mids) >= 3
    for mid in mids:
        decode_pack(store.env.read(_pack(store, mid)), store.keys, manifests=cache)
    assert len(cache) == 2
    assert cache.get(mids[0], 1 << 62) is None  # oldest out (and another size bound is another key)
    with pytest.raises(ValueError):
        ManifestCache(0)
