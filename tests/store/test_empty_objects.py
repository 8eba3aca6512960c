"""An empty chunk object (what an interrupted upload can leave behind on an S3 server: a
SIGKILLed publisher's PUT) is damage like any other, on both backends: reading it gives
zero bytes (S3: the ranged GET's 416 is an empty object, not an I/O error), a restore
refuses the cut and the healing lookup quarantines it, and the next save of that content
rewrites the object instead of failing or building on it."""

from __future__ import annotations

from kvpack.store import PackStore

from .helpers import TOKENS, engine, session_with


def _top_only_chunk(store: PackStore, mid: bytes) -> str:
    chain = store.load_chain(mid)
    below = {ref.content_id for m in chain[1:] for _k, _s, ref in m.chunk_refs()}
    ref = next(r for k, _s, r in chain[0].chunk_refs() if k.layer == 0 and r.content_id not in below)
    return f"chunks/{ref.content_id.hex()}.kvchk"


def test_an_empty_chunk_object_is_refused_quarantined_and_rewritten(tmp_path, backend):
    store = backend.new(tmp_path)
    eng = engine()
    full = session_with(eng, TOKENS, store)
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    name = _top_only_chunk(store, top.manifest_id)
    store.env.write(name, b"")  # emptied in place
    assert store.env.read(name) == b""
    assert store.env.read_range(name, 0, 4096) == b""
    assert not store.verify(read_data=True)["ok"]
    live = eng.new_session()
    found = store.lookup_restore(TOKENS, live)
    assert len(found.quarantined) == 1 and found.hit is not None and found.hit.cut < len(TOKENS)
    live.prefill(TOKENS[live.position :])
    assert live.cache_digest() == full.cache_digest()
    store.save(live)  # the probe reads the empty object, refuses it and rewrites it
    assert len(store.env.read(name)) > 4096
    assert store.verify(read_data=True)["ok"]
    again = eng.new_session()
    healed = store.lookup_restore(TOKENS, again)
    assert healed.hit is not None and healed.hit.cut == len(TOKENS) and not healed.quarantined
    assert again.cache_digest() == full.cache_digest()


def test_a_range_past_the_end_of_an_object_is_empty(tmp_path, backend):
    store = backend.new(tmp_path)
    store.env.write("chunks/probe.kvchk", b"x" * 10)
    assert store.env.read_range("chunks/probe.kvchk", 5, 100) == b"xxxxx"
    assert store.env.read_range("chunks/probe.kvchk", 10, 100) == b""
    assert store.env.read_range("chunks/probe.kvchk", 50, 100) == b""
