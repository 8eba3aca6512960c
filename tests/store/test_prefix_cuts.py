"""Prefix cuts: cuts saved without their final-logits row (engines that never expose it, vLLM).

They are found and restored only by callers that extend them by computing
(``require_logits=False``); every other caller gets a miss or a refusal and its live session
is untouched."""

from __future__ import annotations

import pytest

from kvpack.engine.arrays import array_layout, ArrayEngine
from kvpack.errors import StoreError
from kvpack.store import PackStore

LAYOUT = array_layout(layers=3, kv_heads=2, head_dim=8)
TOKENS = [(i * 5 + 1) % 64 for i in range(800)]


@pytest.fixture()
def store(tmp_path) -> PackStore:
    return PackStore.init(str(tmp_path / "store"), chunk_bytes=4096)


def _saved(store: PackStore, cuts=(256, 512, 768)):
    eng = ArrayEngine(LAYOUT)
    s = eng.new_session()
    s.prefill(TOKENS)
    reports = [store.save(s, cut=c, prefix_only=True) for c in cuts]
    return eng, s, reports


def test_prefix_cuts_chain_as_deltas_and_are_found_only_without_the_logits_requirement(store):
    eng, _s, reports = _saved(store)
    assert [r.kind for r in reports] == ["full", "delta", "delta"]
    assert store.find_deepest(TOKENS, eng.layout, eng.ids()) is None
    hit = store.find_deepest(TOKENS, eng.layout, eng.ids(), require_logits=False)
    assert hit is not None and hit.cut == 768
    # a prompt sharing only the first 512 tokens finds the 512 cut
    other = TOKENS[:512] + [(t + 1) % 64 for t in TOKENS[512:]]
    hit = store.find_deepest(other, eng.layout, eng.ids(), require_logits=False)
    assert hit is not None and hit.cut == 512
    assert store.verify(read_data=True)["ok"]


def test_restoring_a_prefix_cut_installs_exactly_its_rows_only_when_asked(store):
    eng, src, _ = _saved(store)
    hit = store.find_deepest(TOKENS, eng.layout, eng.ids(), require_logits=False)
    target = eng.new_session()
    before = target.cache_digest()
    with pytest.raises(StoreError) as exc:
        store.restore(hit, target, TOKENS)
    assert exc.value.category == "miss"
    assert target.cache_digest() == before and target.position == 0
    # a healing caller that needs the row gets a plain miss: the prefix cut is not quarantined
    assert store.restore_healing(hit, target, TOKENS) == (None, None)
    assert store.find_deepest(TOKENS, eng.layout, eng.ids(), require_logits=False) == hit
    store.restore(hit, target, TOKENS, require_logits=False)
    assert target.position == 768 and target.last_logits is None
    for layer, role in eng.layout.states():
        assert bytes(target.export_rows(layer, role, 0, 768)) == bytes(src.export_rows(layer, role, 0, 768))


def test_a_prefix_cut_refuses_a_logits_row(store):
    eng = ArrayEngine(LAYOUT)
    s = eng.new_session()
    s.prefill(TOKENS[:256])
    with pytest.raises(StoreError) as exc:
        store.save(s, cut=256, prefix_only=True, logits=s.export_logits())
    assert exc.value.category == "usage"
    assert store.find_deepest(TOKENS, eng.layout, eng.ids(), require_logits=False) is None


def test_a_full_cut_stays_a_full_cut(store):
    eng = ArrayEngine(LAYOUT)
    s = eng.new_session()
    s.prefill(TOKENS[:512])
    store.save(s)
    hit = store.find_deepest(TOKENS[:512], eng.layout, eng.ids())
    assert hit is not None and hit.cut == 512
    target = eng.new_session()
    store.restore(hit, target, TOKENS[:512], require_logits=False)
    assert target.last_logits is not None  # the row travels whenever it was saved
