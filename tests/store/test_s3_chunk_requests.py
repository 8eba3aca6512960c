"""Chunk requests of an S3 save: a first save PUTs each new chunk once (create-only) and never
GETs one first; once a PUT finds its chunk already stored (412), the rest of that save looks
before it uploads, so republishing a stored cut does not upload every chunk for nothing. One
worker, so the order is deterministic."""

from __future__ import annotations

import threading

import pytest

from .helpers import TOKENS, S3Backend, engine, session_with


class ChunkRequests:
    """PUTs and GETs of chunk objects, from the client's ``before-send`` hook."""

    def __init__(self, client) -> None:
        self.counts = {"PUT": 0, "GET": 0}
        self._lock = threading.Lock()
        client.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request, **_kw) -> None:
        if "/chunks/" in request.url and request.method in self.counts:
            with self._lock:
                self.counts[request.method] += 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {"PUT": 0, "GET": 0}
        return out


@pytest.mark.slow
def test_first_save_puts_without_probing_and_a_republication_probes_after_one_412(tmp_path, seaweed):
    store = S3Backend(seaweed).new(tmp_path, name="chunk-requests")
    store.workers = 1
    eng = engine()
    tokens = TOKENS[:512]
    counter = ChunkRequests(store.env.client)
    src = session_with(eng, tokens, store)  # cuts 256 and 512
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    first = counter.take()
    chunks = len(list(store.load_chain(hit.manifest_id)[0].chunk_refs()))
    assert first["GET"] == 0 and first["PUT"] >= chunks  # no probe before a new chunk
    store.forget(hit.manifest_id)  # its chunks stay (no gc): a republication finds them all
    report = store.save(src)
    again = counter.take()
    assert report.kind == "delta" and report.chunks_written == 0 and report.chunks_reused == chunks
    assert again["PUT"] == 1  # one upload answered 412; every later chunk was looked at first
    assert again["GET"] == chunks  # each stored copy read and verified before it is reused
    live = eng.new_session()
    store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), live, tokens)
    assert live.cache_digest() == src.cache_digest()
