"""The CUDA export/restore paths on a real device (skipped without CUDA).

Byte identity: the pinned asynchronous export equals the synchronous ``.cpu()`` export and
the live plane's own bytes, for f16, bf16 and f32; a store round trip through the staged
restore reproduces every plane bit for bit and the same greedy continuation.
"""

from __future__ import annotations

import os

import pytest

from kvpack.engine import cuda
from kvpack.errors import StoreError
from kvpack.store import PackStore

from .conftest import DTYPES, cohere2_engine, llama_engine, random_tokens, requires_cuda

pytestmark = requires_cuda


def _plane_bytes(session, layer, role):
    import torch

    t, lo = session._plane(layer, role)
    return t[0].transpose(0, 1).contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_pinned_export_equals_cpu_export(dtype):
    eng = llama_engine(dtype, device="cuda")
    s = eng.new_session()
    s.prefill(random_tokens(600, eng.layout.vocab_size))
    reqs = [(l, r, 0, 600) for l, r in eng.layout.states()] + [(1, "k", 100, 357), (2, "v", 599, 600)]
    pool = cuda.export_pool(eng.device)
    assert pool.pin
    for (layer, role, a, b), (view, release) in zip(reqs, s.export_spans(reqs, depth=3)):
        assert release is not None
        data = bytes(view)
        assert data == bytes(s.export_rows(layer, role, a, b))
        if (a, b) == (0, 600):
            assert data == _plane_bytes(s, layer, role)
        release()
    assert pool.idle == pool.allocated


def _roundtrip(tmp_path, eng, n, encrypted=False, staging="auto"):
    import torch

    tokens = random_tokens(n, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = PackStore.init(os.path.join(tmp_path, "store"), encrypted=encrypted, chunk_bytes=64 * 1024)
    store.plane_staging = staging  # "auto": whole planes on CUDA; "never": per-chunk slots
    store.verify_on = "host"  # these staging paths hash on the host (device hashing: test_device_verify)
    store.save(s)
    r = eng.new_session()
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    store.restore(hit, r, tokens)
    torch.cuda.synchronize()
    for layer, role in eng.layout.states():
        a, _ = s._plane(layer, role)
        b, _ = r._plane(layer, role)
        assert b.device.type == "cuda"
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, role)
    assert torch.equal(s.last_logits, r.last_logits)
    assert r.decode_greedy(6)[0] == s.decode_greedy(6)[0]
    stager = cuda.restore_stager(eng.device, 1)
    assert stager.idle == stager.slots
    return store, tokens, s


@pytest.mark.parametrize("staging", ["auto", "never"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_store_roundtrip_on_cuda_is_bit_identical(tmp_path, dtype, staging):
    _roundtrip(tmp_path, llama_engine(dtype, device="cuda"), 1000, staging=staging)


def test_store_roundtrip_windowed_and_encrypted_on_cuda(tmp_path):
    _roundtrip(tmp_path, cohere2_engine(device="cuda"), 700, encrypted=True)


def test_refusal_on_cuda_leaves_session_and_slots(tmp_path):
    eng = llama_engine("f16", device="cuda")
    store, tokens, _ = _roundtrip(tmp_path, eng, 512)
    d = os.path.join(store.path, "chunks")
    names = sorted(os.listdir(d))
    victim = os.path.join(d, names[len(names) // 2])
    data = bytearray(open(victim, "rb").read())
    data[-1 - 4096 * 3] ^= 0x80
    open(victim, "wb").write(bytes(data))
    r = eng.new_session()
    r.prefill(tokens[:20])
    before = r.cache_digest()
    with pytest.raises(StoreError):
        store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert r.cache_digest() == before
    stager = cuda.restore_stager(eng.device, 1)
    assert stager.idle == stager.slots
