"""Requests of an S3 save, counted on a real SeaweedFS (by HTTP method and object kind, from
the client's ``before-send`` hook): a save that follows its lookup -- what every consumer does
-- makes one PUT per new chunk plus a constant ten (docs/store.md "Requests of an S3 save").
Before, it also read the index entry of every 256-token node below its cut again (the
lookup had just read them all) and wrote its lease object once more while it protected
nothing: a 2,048-token cut of 16 chunks took 34 requests, now 26. Counts, not times: a
request added to the save path fails here."""

from __future__ import annotations

import threading
from collections import Counter
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.store import PackStore

from .helpers import S3Backend

#: two full-span layers of 64-byte rows: 512 tokens per 32 KiB chunk, so a 2,048-token cut
#: is 16 chunks (2 layers x k, v x 4 spans) under 8 index nodes
LAYOUT = array_layout(layers=2, kv_heads=2, head_dim=8)
TOKENS = [(i * 11 + 5) % 64 for i in range(2048)]
CHUNK_BYTES = 32768


class Requests:
    """Requests by (method, kind): kind is the object's first name component (``chunks``,
    ``index``, ``leases``, ``gc.epoch``...) or ``list:<kind>`` for a ListObjectsV2."""

    def __init__(self, store: PackStore) -> None:
        self.prefix = store.env.prefix
        self.bucket = store.env.bucket
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        store.env.client.meta.events.register("before-send.s3", self._seen)  # (deadline clients forward)
        quick = store.env.for_lookup().client  # a lookup's own client of short timeouts
        if quick is not store.env.client:
            quick.meta.events.register("before-send.s3", self._seen)

    def _seen(self, request, **_kw) -> None:
        url = urlsplit(request.url)
        key = unquote(url.path).lstrip("/")[len(self.bucket) + 1 :]
        if not key:  # a bucket-level request: a listing
            prefix = parse_qs(url.query).get("prefix", [""])[0]
            kind = "list:" + prefix[len(self.prefix) :].split("/")[0]
        else:
            kind = key[len(self.prefix) :].split("/")[0]
        with self._lock:
            self.counts[(request.method, kind)] += 1

    def take(self) -> Counter[tuple[str, str]]:
        with self._lock:
            out, self.counts = self.counts, Counter()
        return out


#: what a save adds to its chunk PUTs (with no parent): the cut's own index entry (is it
#: there already?), the gc epoch and the sweep leases before it reads anything and again
#: before its commit, its lease (written once, protecting its cut) and its release, the
#: pack, the logits object and the index entry
CONSTANT = Counter(
    {
        ("GET", "index"): 1,
        ("HEAD", "gc.epoch"): 2,
        ("GET", "list:leases"): 2,
        ("PUT", "leases"): 1,
        ("DELETE", "leases"): 1,
        ("PUT", "packs"): 1,
        ("PUT", "logits"): 1,
        ("PUT", "index"): 1,
    }
)


@pytest.fixture()
def counted(tmp_path, seaweed):
    store = S3Backend(seaweed).new(tmp_path, name="save-requests", chunk_bytes=CHUNK_BYTES)
    store.workers = 2
    eng = ArrayEngine(LAYOUT, name="save-requests")
    src = eng.new_session()
    src.prefill(TOKENS, chunk_size=256)
    return store, eng, src, Requests(store)


@pytest.mark.slow
def test_a_save_after_its_lookup_is_its_chunk_puts_plus_a_constant(counted):
    store, eng, src, requests = counted
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()) is None  # the lookup: a miss
    assert requests.take() == Counter({("GET", "index"): 8})  # one entry per 256-token node
    report = store.save(src)
    got = requests.take()
    assert report.kind == "full" and report.chunks_written == 16
    assert got == CONSTANT + Counter({("PUT", "chunks"): 16}), got
    assert sum(got.values()) == 26  # 16 chunk PUTs + 10 (was 34)


@pytest.mark.slow
def test_a_save_with_no_lookup_before_it_reads_the_nodes_below_its_cut(counted):
    """Without a lookup the parent pick reads the 7 entries below the cut (deepest first,
    in parallel batches): the only requests the save still spends on finding no parent."""
    store, _eng, src, requests = counted
    report = store.save(src)
    got = requests.take()
    assert report.kind == "full"
    assert got == CONSTANT + Counter({("PUT", "chunks"): 16, ("GET", "index"): 7}), got


@pytest.mark.slow
def test_a_delta_after_a_lookup_hit_reads_its_parent_and_nothing_deeper(counted):
    """The lookup of 2,048 tokens hits the committed 1,024 cut; the save of 2,048 skips the
    three empty nodes between them and reads the parent's entry twice (before and after its
    lease protects it) and its pack (the chain verifies), then writes the delta's chunks."""
    store, eng, src, requests = counted
    first = eng.new_session()
    first.prefill(TOKENS[:1024], chunk_size=256)
    store.save(first)
    requests.take()
    hit = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert hit is not None and hit.cut == 1024
    requests.take()
    report = store.save(src)
    got = requests.take()
    assert report.kind == "delta" and report.chunks_written == 8
    parent = Counter({("GET", "index"): 2, ("PUT", "leases"): 1, ("GET", "packs"): 1})
    assert got == CONSTANT + parent + Counter({("PUT", "chunks"): 8}), got
    live = eng.new_session()
    store.restore(store.find_deepest(TOKENS, eng.layout, eng.ids()), live, TOKENS)
    assert live.cache_digest() == src.cache_digest()


@pytest.mark.slow
def test_checkpoints_saved_one_after_another_each_find_the_one_before(counted):
    """A commit of this process marks its node present: the next checkpoint's parent pick
    reads it (a delta on it), though the lookup before found it absent."""
    store, eng, src, requests = counted
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()) is None
    kinds = []
    for cut in (256, 512, 768):
        kinds.append(store.save(src, cut=cut, logits=bytes(eng.layout.logits_bytes)).kind)
    assert kinds == ["full", "delta", "delta"]
    hit = store.find_deepest(TOKENS[:768], eng.layout, eng.ids())
    assert hit is not None and hit.cut == 768 and len(store.load_chain(hit.manifest_id)) == 3
