"""Whole-plane restore staging (kvpack.engine.cuda.PlaneStager), the default on CUDA installs,
checked on the CPU by forcing it: bit-identical restores (raw, encrypted, windowed lossless),
and a refused restore that leaves the session untouched and every buffer back in the pool."""

from __future__ import annotations

import os

import pytest

from kvpack.engine import cuda
from kvpack.errors import StoreError
from kvpack.store import PackStore

from .conftest import cohere2_engine, llama_engine, random_tokens


def _store(tmp_path, encrypted=False) -> PackStore:
    store = PackStore.init(os.path.join(tmp_path, "s"), encrypted=encrypted, chunk_bytes=4096)
    store.plane_staging = "always"
    return store


@pytest.mark.parametrize("model,encrypted", [("llama-f16", False), ("llama-bf16", True), ("cohere2", False)])
def test_plane_staged_restore_is_bit_identical(tmp_path, model, encrypted):
    eng = cohere2_engine() if model == "cohere2" else llama_engine(model.split("-")[1])
    tokens = random_tokens(640, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, encrypted)
    store.save(s)
    stager = cuda.plane_stager("cpu")
    r = eng.new_session()
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    report = store.restore(hit, r, tokens)
    assert report.chunks_verified > len(eng.layout.states())  # several chunks per plane
    assert r.cache_digest() == s.cache_digest()
    assert r.decode_greedy(4)[0] == s.decode_greedy(4)[0]
    # buffers are pooled by size and all back
    assert all(stager._free.values())


def test_plane_staged_refusal_leaves_session_and_buffers(tmp_path):
    eng = llama_engine("f16")
    tokens = random_tokens(512, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path)
    store.save(s)
    d = os.path.join(store.path, "chunks")
    names = sorted(os.listdir(d))
    victim = os.path.join(d, names[len(names) // 2])
    data = bytearray(open(victim, "rb").read())
    data[5000] ^= 1
    open(victim, "wb").write(bytes(data))
    r = eng.new_session()
    r.prefill(tokens[:10])
    before = r.cache_digest()
    stager = cuda.plane_stager("cpu")
    pooled_before = sum(len(v) for v in stager._free.values())
    with pytest.raises(StoreError) as exc:
        store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert exc.value.category == "corrupt"
    assert r.cache_digest() == before
    pooled_after = sum(len(v) for v in stager._free.values())
    assert pooled_after >= pooled_before  # every buffer taken was given back
    # the damaged store still verifies as damaged, and an undamaged copy restores
    data[5000] ^= 1
    open(victim, "wb").write(bytes(data))
    store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert r.cache_digest() == s.cache_digest()
