"""Index lookups on a network backend (S3) fetch entries ahead in growing parallel batches
(1, 2, 4, ... deepest first): the same answer as one GET after another, one GET for a hit
at the deepest node, and a malformed entry still skipped."""

from __future__ import annotations

import pytest

from .helpers import TOKENS, S3Backend, engine, session_with


class IndexGets:
    """GETs of index entries, from the client's ``before-send`` hook."""

    def __init__(self, client) -> None:
        self.count = 0
        client.meta.events.register("before-send.s3.GetObject", self._seen)

    def _seen(self, request, **_kw) -> None:
        if "/index/" in request.url:
            self.count += 1


@pytest.mark.slow
def test_batched_index_lookup_matches_sequential_and_costs_one_get_on_a_deepest_hit(tmp_path, seaweed):
    store = S3Backend(seaweed).new(tmp_path, name="lookup")
    eng = engine()
    session_with(eng, TOKENS[:768], store)  # cuts 256, 512, 768
    gets = IndexGets(store.env.for_lookup().client)  # lookups read through the short-timeout client
    assert store.env.io_parallelism > 1
    prompts = [TOKENS[:n] for n in (300, 768, 1000, 1200)] + [[(t + 1) % 64 for t in TOKENS]]
    batched = [store.find_deepest(p, eng.layout, eng.ids()) for p in prompts]
    store.env.io_parallelism = 0  # one GET after another
    sequential = [store.find_deepest(p, eng.layout, eng.ids()) for p in prompts]
    assert batched == sequential
    assert [h.cut if h else None for h in batched] == [256, 768, 768, 768, None]
    store.env.io_parallelism = 16
    gets.count = 0
    assert store.find_deepest(TOKENS[:768], eng.layout, eng.ids()).cut == 768
    assert gets.count == 1  # the deepest node first, alone
    # a malformed entry at the deepest node is skipped, as before
    hit = store.find_deepest(TOKENS[:768], eng.layout, eng.ids())
    store.env.write(f"index/{hit.node_id.hex()}", b"not hex\n")
    assert store.find_deepest(TOKENS[:1000], eng.layout, eng.ids()).cut == 512
