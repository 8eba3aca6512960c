"""An index entry the storage fails to read during a lookup (EIO on a directory; an S3 server
that stops answering) is a miss for the caller -- which recomputes -- but never damage:
nothing is quarantined or deleted, the entry is reported distinctly (``Lookup.unreadable``,
``PackStore.unreadable_entries``, the node metric ``kvpack_store_unreadable_entries_total``,
``generate``'s ``unreadable``) and serves again once the storage reads. Before, an entry
that failed to read was skipped silently (a plain miss, counted nowhere), and a failure
looking at its cut's pack or logits object, or quarantining an incomplete entry, failed the
whole lookup."""

from __future__ import annotations

import errno
import os

import pytest

from kvpack.errors import StoreError
from kvpack.generate import generate
from kvpack.store import PackStore, Unreadable
from kvpack.testing.faults import FaultyOps

from .helpers import TOKENS, PosixBackend, engine, files, flip, names, session_with


def _engine():
    eng = engine()
    eng.tokenizer = None  # kvpack.generate decodes no text for the NumPy adapter
    return eng


def _published(tmp_path):
    store = PosixBackend().new(str(tmp_path))
    eng = _engine()
    session_with(eng, TOKENS, store)  # cuts 256, 512, 768, 1024, 1200
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    assert top.cut == len(TOKENS)
    return store, eng, top


@pytest.mark.parametrize("failing", ["index_entry", "pack_stat", "logits_header"])
def test_an_entry_the_disk_fails_to_read_is_a_counted_miss_and_never_healed(tmp_path, failing):
    store, eng, top = _published(tmp_path)
    mid = top.manifest_id.hex()
    target = {
        "index_entry": ("read", f"/index/{top.node_id.hex()}"),
        "pack_stat": ("stat", f"/packs/{mid}.kvpkp"),
        "logits_header": ("read", f"/logits/{mid}.kvchk"),
    }[failing]
    ops = FaultyOps(fail_reads=lambda kind, path: (kind, path[len(store.path) :]) == target)
    sick = PackStore.open(store.path, ops=ops)
    before = files(store.path)

    # find_deepest alone: the next shallower cut, the failure reported apart
    passed: list[Unreadable] = []
    hit = sick.find_deepest(TOKENS, eng.layout, eng.ids(), unreadable=passed)
    assert hit is not None and hit.cut == 1024
    assert [u.node_id for u in passed] == [top.node_id] and sick.unreadable_entries == 1
    assert passed[0].error.category == "io" and "Input/output error" in passed[0].error.message

    # the healing lookup every consumer uses: restores 1024, quarantines nothing
    live = eng.new_session()
    found = sick.lookup_restore(TOKENS, live)
    assert found.hit is not None and found.hit.cut == 1024 and live.position == 1024
    assert not found.quarantined and [u.node_id for u in found.unreadable] == [top.node_id]
    assert sick.unreadable_entries == 2

    # generate: the same tokens as without a store; the unreadable entry reported, not healed
    expected = generate(eng, None, TOKENS, max_new_tokens=3).tokens
    result = generate(eng, sick, TOKENS, max_new_tokens=3, save=False)
    assert result.tokens == expected and result.reused_tokens == 1024 and not result.quarantined
    assert len(result.unreadable) == 1 and "Input/output error" in result.unreadable[0]
    assert result.as_dict()["unreadable"] == result.unreadable

    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from kvpack.node.metrics import NodeMetrics

    metrics = NodeMetrics("decode")
    metrics.watch_store(sick)
    metrics.watch_store(sick)  # once per registry
    assert 'kvpack_store_unreadable_entries_total{role="decode"} 3.0' in generate_latest(metrics.registry).decode()

    assert files(store.path) == before  # nothing quarantined, deleted or written
    assert not names(store, "quarantine/")
    healthy = PackStore.open(store.path)
    assert healthy.find_deepest(TOKENS, eng.layout, eng.ids()) == top  # serves again
    assert healthy.verify(read_data=True)["ok"]


@pytest.mark.parametrize("failing", [1, 2, 3, 5])
def test_a_lookup_stops_after_three_unreadable_entries_in_a_row(tmp_path, failing):
    """One or two unreadable entries: the next shallower entry serves. Three in a row: the
    storage is taken for down and the lookup is a miss without reading the entries below
    (with the S3 server gone every read spends the client's retries)."""
    store, eng, top = _published(tmp_path)
    chain = sorted(((n.cumulative_count, n.node_id) for n in store._chain(store.context(eng.layout, eng.ids()), TOKENS).nodes), reverse=True)
    entries = [node for cut, node in chain if cut in (1200, 1024, 768, 512, 256)]
    bad = {f"/index/{node.hex()}" for node in entries[:failing]}
    ops = FaultyOps(fail_reads=lambda kind, path: kind == "read" and path[len(store.path) :] in bad)
    sick = PackStore.open(store.path, ops=ops)
    passed: list[Unreadable] = []
    hit = sick.find_deepest(TOKENS, eng.layout, eng.ids(), unreadable=passed)
    read = [p for kind, p in ops.reads if kind == "read" and "/index/" in p]
    if failing < 3:
        assert hit is not None and hit.cut == [1200, 1024, 768][failing] and len(passed) == failing
    else:
        assert hit is None and len(passed) == 3
        assert len(read) == 3, read  # the two shallowest entries were never read
    assert sick.unreadable_entries == len(passed)


def test_an_incomplete_entry_whose_quarantine_fails_is_passed_over_not_fatal(tmp_path):
    """The deepest cut lost its pack (damage: quarantined on a healthy disk); the disk then
    refuses the receipt's write: the lookup still restores the next cut, and reports the
    failure; the entry is quarantined by the next lookup on a disk that writes."""
    store, eng, top = _published(tmp_path)
    os.unlink(store.pack_path(top.manifest_id))
    sick = PackStore.open(store.path, ops=FaultyOps(fail_ops={"open"}, errno_=errno.EIO))
    live = eng.new_session()
    found = sick.lookup_restore(TOKENS, live)
    assert found.hit is not None and found.hit.cut == 1024 and not found.quarantined
    assert [u.node_id for u in found.unreadable] == [top.node_id] and found.unreadable[0].error.category == "io"
    assert os.path.exists(store.index_path(top.node_id)) and not names(store, "quarantine/")
    healed = PackStore.open(store.path).lookup_restore(TOKENS, eng.new_session())
    assert healed.hit.cut == 1024 and len(healed.quarantined) == 1 and not healed.unreadable
    assert not os.path.exists(store.index_path(top.node_id))


def test_a_malformed_entry_is_still_damage_not_unreadable(tmp_path):
    store, eng, top = _published(tmp_path)
    store.env.write(f"index/{top.node_id.hex()}", b"not hex\n")
    found = store.lookup_restore(TOKENS, eng.new_session())
    assert found.hit.cut == 1024 and len(found.quarantined) == 1 and not found.unreadable
    assert store.unreadable_entries == 0


@pytest.mark.slow
def test_seaweedfs_stopped_mid_lookup_is_a_miss_that_heals_nothing(hung, tmp_path):
    """A real SeaweedFS server SIGKILLed right after the lookup read the deepest index entry:
    every further request fails (connection refused), the lookup answers a miss with each
    entry it could not read (three: then it stops), writes nothing, and once the server is
    back every entry serves.
    (~50 s: two server starts, and the client's bounded retries of every refused request.)"""
    from kvpack.store.s3 import S3Env

    server, store = hung.server, hung.store
    key = str(tmp_path / "root.key")  # the hung fixture's store key

    class KilledAfterFirstIndexRead(S3Env):
        killed = False

        def read_versioned(self, name, **kw):
            got = super().read_versioned(name, **kw)
            if name.startswith("index/") and not KilledAfterFirstIndexRead.killed:
                KilledAfterFirstIndexRead.killed = True
                server.kill()
            return got

    eng = _engine()
    session_with(eng, TOKENS, store)
    entries = names(store, "index/")
    assert len(entries) == 5
    env = KilledAfterFirstIndexRead.from_url(store.path, endpoint=server.endpoint, credentials_file=server.credentials_file)
    sick = PackStore.open(env, root_key_file=key)
    live = eng.new_session()
    found = sick.lookup_restore(TOKENS, live)
    assert KilledAfterFirstIndexRead.killed
    assert found.hit is None and live.position == 0 and not found.quarantined
    # the deepest entry read, its pack's HEAD failed, then two more entries: three in a
    # row, so the lookup stopped without spending retries on the two shallowest
    assert len(found.unreadable) == 3 and all(u.error.category == "io" for u in found.unreadable)
    assert sick.unreadable_entries == 3
    with pytest.raises(StoreError):  # the server really is gone
        sick.env.read("store.json")

    server.start()  # same ports, same data
    back = PackStore.open(S3Env.from_url(store.path, endpoint=server.endpoint, credentials_file=server.credentials_file), root_key_file=key)
    assert names(back, "index/") == entries and not names(back, "quarantine/")
    assert back.find_deepest(TOKENS, eng.layout, eng.ids()).cut == len(TOKENS)
    assert back.verify(read_data=True)["ok"]


@pytest.mark.slow
@pytest.mark.timeout(200)  # a hang guard: before, this lookup alone took 250 s (30 s reads, 3 attempts)
def test_a_hung_seaweedfs_costs_a_lookup_its_short_timeouts_then_a_miss(hung):
    """SeaweedFS SIGSTOPped: it accepts connections (the kernel does) and never answers. The
    lookup's small reads go through a client of short timeouts and few attempts
    (``S3Env.for_lookup``), so the lookup passes over three entries and answers a miss;
    nothing is written, and once the server runs again every entry serves."""
    from kvpack.store.s3 import LOOKUP_ATTEMPTS, LOOKUP_TIMEOUT_S

    store = hung.store
    eng = _engine()
    session_with(eng, TOKENS, store)
    entries = names(store, "index/")
    quick = store.env.for_lookup()
    assert quick is store.env.for_lookup() and quick.client is not store.env.client
    config = quick.client.meta.config
    assert config.read_timeout == LOOKUP_TIMEOUT_S and config.connect_timeout == LOOKUP_TIMEOUT_S
    assert config.retries["total_max_attempts"] == LOOKUP_ATTEMPTS
    assert store.env.client.meta.config.retries["total_max_attempts"] == 3  # the default client
    hung.stop()
    live = eng.new_session()
    found = store.lookup_restore(TOKENS, live)
    assert found.hit is None and live.position == 0 and not found.quarantined
    assert len(found.unreadable) == 3 and all(u.error.category == "io" for u in found.unreadable)
    assert all("ReadTimeout" in u.error.message for u in found.unreadable), [u.error.message for u in found.unreadable]
    hung.cont()
    assert names(store, "index/") == entries and not names(store, "quarantine/")
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == len(TOKENS)


@pytest.mark.slow
@pytest.mark.timeout(240)  # a hang guard: before, the quarantine's requests had 30 s x 3 each
def test_a_server_that_hangs_mid_quarantine_ends_the_lookup_within_its_deadline(hung, monkeypatch):
    """A restore refuses a damaged cut and the lookup quarantines it; SeaweedFS stops
    answering right then. The quarantine runs under the restore's deadline, so the lookup
    ends as a miss (the entry reported unreadable, ``io``) soon after it, the live session
    untouched; before, every request of the quarantine waited the default client's 30 s x 3.
    What the cut-short quarantine left is healed by the next lookup once the server answers."""
    import time

    from kvpack.store import maintenance
    from kvpack.store.packstore import chunk_name

    store = hung.store
    store.restore_deadline_s = 4.0
    eng = _engine()
    session_with(eng, TOKENS, store)
    top = store.find_deepest(TOKENS, eng.layout, eng.ids())
    refs = [ref for manifest in store.load_chain(top.manifest_id) for _key, _span, ref in manifest.chunk_refs()]
    flip(store, chunk_name(refs[0].content_id), 100)  # a chunk of the deepest cut

    real = maintenance.quarantine_after_refusal
    calls = []

    def hang_then_quarantine(store_, hit, exc):
        calls.append(exc.category)
        hung.stop()
        return real(store_, hit, exc)

    monkeypatch.setattr(maintenance, "quarantine_after_refusal", hang_then_quarantine)
    live = eng.new_session()
    t0 = time.monotonic()
    found = store.lookup_restore(TOKENS, live)
    took = time.monotonic() - t0
    assert calls == ["corrupt"]
    assert found.hit is None and live.position == 0 and not found.quarantined
    assert [u.error.category for u in found.unreadable] == ["io"]
    assert took < 60, took  # the deadline (4 s) and a request started just before it
    print(f"lookup with a hung quarantine: {took:.1f} s")

    hung.cont()
    monkeypatch.undo()
    healed = store.lookup_restore(TOKENS, eng.new_session())
    assert healed.quarantined and healed.quarantined[0]["manifest_id"] == top.manifest_id.hex()
    assert healed.hit is not None and healed.hit.cut < top.cut  # a shallower cut serves
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()).cut == healed.hit.cut
    store.repair()
    assert store.verify(read_data=True)["ok"]
