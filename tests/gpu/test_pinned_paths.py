"""The CUDA export/restore paths' logic, checked on CPU tensors (runs everywhere).

kvpack.engine.cuda works on any device: on the CPU the "pinned" buffers are ordinary ones
and there are no streams or events, but the order, the buffer reuse, the in-place upload
detection, the window zero-fill and the refusal clean-up are the same code the GPU runs.
"""

from __future__ import annotations

import os

import pytest

from kvpack.engine import cuda
from kvpack.engine.transformers_adapter import DetachedInstall
from kvpack.errors import EngineError, StoreError
from kvpack.store import PackStore

from .conftest import DTYPES, cohere2_engine, llama_engine, random_tokens


@pytest.fixture(scope="module", params=sorted(DTYPES))
def llama(request):
    return llama_engine(request.param)


def test_export_spans_equal_export_rows(llama):
    s = llama.new_session()
    s.prefill(random_tokens(300, llama.layout.vocab_size))
    row = llama.layout.layer(0).row_bytes
    reqs = [(0, "k", 0, 300), (1, "v", 17, 18), (3, "k", 5, 5), (2, "v", 128, 256), (3, "v", 299, 300), (0, "v", 0, 300)]
    # buffers smaller than the largest request: oversized ones take the one-off path
    pool = cuda.HostBufferPool(200 * row, pin=False, limit=3)
    seen = 0
    for (layer, role, a, b), (view, release) in zip(reqs, cuda.export_spans(s, reqs, depth=2, pool=pool)):
        assert bytes(view) == bytes(s.export_rows(layer, role, a, b))
        assert bytes(view) == bytes(s.export_rows_tensor(layer, role, a, b).numpy())
        release()
        release()  # idempotent
        seen += 1
    assert seen == len(reqs)
    assert pool.idle == pool.allocated <= 3


def test_session_export_spans_on_cpu_is_export_rows(llama):
    s = llama.new_session()
    s.prefill(random_tokens(130, llama.layout.vocab_size))
    reqs = [(l, r, 0, 130) for l, r in llama.layout.states()]
    for req, (view, release) in zip(reqs, s.export_spans(reqs)):
        assert release is None and bytes(view) == bytes(s.export_rows(*req))


def test_export_generator_closed_early_returns_buffers(llama):
    s = llama.new_session()
    s.prefill(random_tokens(64, llama.layout.vocab_size))
    pool = cuda.HostBufferPool(1 << 20, pin=False)
    gen = cuda.export_spans(s, [(l, r, 0, 64) for l, r in llama.layout.states()], depth=4, pool=pool)
    view, release = next(gen)
    release()
    gen.close()
    assert pool.idle == pool.allocated > 0


def test_export_refuses_evicted_rows():
    eng = cohere2_engine()
    s = eng.new_session()
    s.prefill(random_tokens(100, eng.layout.vocab_size))
    with pytest.raises(EngineError):
        list(cuda.export_spans(s, [(0, "k", 0, 100)]))


def _store(tmp_path, name, key, **kw):
    kw.setdefault("chunk_bytes", 4096)
    return PackStore.init(os.path.join(tmp_path, name), root_key_file=key, **kw)


def _chunks(store):
    d = os.path.join(store.path, "chunks")
    return {n: open(os.path.join(d, n), "rb").read() for n in os.listdir(d) if n.endswith(".kvchk")}


@pytest.mark.parametrize("model", ["llama-f16", "cohere2"])
def test_save_through_pinned_exports_writes_identical_chunks(tmp_path, model):
    eng = llama_engine("f16") if model == "llama-f16" else cohere2_engine()
    key = os.path.join(tmp_path, "root.key")
    tokens = random_tokens(700, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    plain, pinned = _store(tmp_path, "plain", key), _store(tmp_path, "pinned", key)
    s.export_spans = None  # the store's per-span export_rows path
    r1 = plain.save(s)
    pool = cuda.HostBufferPool(4096, pin=False, limit=64)
    s.export_spans = lambda reqs, depth=8: cuda.export_spans(s, reqs, depth=depth, pool=pool)
    r2 = pinned.save(s)
    assert r1.manifest_id == r2.manifest_id and r1.chunks_written == r2.chunks_written > 0
    assert _chunks(plain) == _chunks(pinned)
    assert pool.idle == pool.allocated > 0  # every pinned buffer came back


def _restore_with(store, eng, tokens, stager, monkeypatch):
    monkeypatch.setattr(DetachedInstall, "stager", lambda self, slots: (stager.grow(slots), stager)[1])
    r = eng.new_session()
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    report = store.restore(hit, r, tokens)
    return r, hit, report


@pytest.mark.parametrize("model,encrypted", [("llama-f16", False), ("llama-bf16", True), ("cohere2", False)])
def test_restore_through_stager_is_bit_identical(tmp_path, monkeypatch, model, encrypted):
    eng = cohere2_engine() if model == "cohere2" else llama_engine(model.split("-")[1])
    tokens = random_tokens(640, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, "s", os.path.join(tmp_path, "root.key"), encrypted=encrypted)
    store.save(s)
    stager = cuda.RestoreStager("cpu", slots=2)
    uploads = {"in_place": 0, "copied": 0}
    real_upload = cuda.StagingSlot.upload

    def counting_upload(slot, plaintext):
        real_upload(slot, plaintext)
        uploads["in_place" if slot.in_place else "copied"] += 1

    monkeypatch.setattr(cuda.StagingSlot, "upload", counting_upload)
    r, hit, report = _restore_with(store, eng, tokens, stager, monkeypatch)
    assert hit.cut == 640 and report.chunks_verified > 0
    assert r.cache_digest() == s.cache_digest()
    assert stager.idle == stager.slots >= 2 * store.workers + 2
    assert uploads["in_place"] + uploads["copied"] == report.chunks_verified
    if encrypted:
        assert uploads["in_place"] == 0
    elif model != "cohere2":  # raw frames decode to a view into the slot: uploaded from there
        assert uploads["copied"] == 0
    # (cohere2's windowed states use the lossless codec: decoded copies, copied into the slot)
    assert r.decode_greedy(4)[0] == s.decode_greedy(4)[0]


def test_restore_refusal_returns_every_slot(tmp_path, monkeypatch):
    eng = llama_engine("f16")
    tokens = random_tokens(512, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, "s", os.path.join(tmp_path, "root.key"))
    store.save(s)
    d = os.path.join(store.path, "chunks")
    victim = os.path.join(d, sorted(os.listdir(d))[len(os.listdir(d)) // 2])
    data = bytearray(open(victim, "rb").read())
    data[5000] ^= 1
    open(victim, "wb").write(bytes(data))
    stager = cuda.RestoreStager("cpu", slots=2)
    r = eng.new_session()
    r.prefill(tokens[:10])
    before = r.cache_digest()
    with pytest.raises(StoreError) as exc:
        _restore_with(store, eng, tokens, stager, monkeypatch)
    assert exc.value.category == "corrupt"
    assert stager.idle == stager.slots
    assert r.cache_digest() == before


def test_oversized_chunk_file_is_refused_not_truncated(tmp_path, monkeypatch):
    eng = llama_engine("f32")
    tokens = random_tokens(256, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, "s", os.path.join(tmp_path, "root.key"))
    store.save(s)
    d = os.path.join(store.path, "chunks")
    victim = os.path.join(d, sorted(os.listdir(d))[0])
    with open(victim, "ab") as fh:
        fh.write(bytes(cuda.MAX_OBJECT_BYTES))
    stager = cuda.RestoreStager("cpu", slots=2)
    with pytest.raises(StoreError):
        _restore_with(store, eng, tokens, stager, monkeypatch)
    assert stager.idle == stager.slots


def test_staged_rows_must_be_flat_uint8_on_the_device(llama):
    import torch

    s = llama.new_session()
    s.prefill(random_tokens(8, llama.layout.vocab_size))
    inst = s.begin_install(8, s.tokens, llama.identity)
    row = llama.layout.layer(0).row_bytes
    with pytest.raises(EngineError):
        inst.write_rows(0, "k", 0, torch.zeros(row // 2, dtype=torch.int16))
    with pytest.raises(EngineError):
        inst.write_rows(0, "k", 0, torch.zeros(row + 1, dtype=torch.uint8))
    inst.write_rows(0, "k", 0, s.export_rows_tensor(0, "k", 0, 8))
    assert inst.missing()[0] == (0, "v", 8)
    inst.abort()


def test_row_blocks_install_equals_row_by_row(llama):
    """write_row_blocks (strided blocks, one copy) installs what write_rows would, and
    refuses wrong shapes, dtypes, ranges and rows written twice."""
    import torch

    s = llama.new_session()
    s.prefill(random_tokens(12, llama.layout.vocab_size))
    row = llama.layout.layer(0).row_bytes
    rows = s.export_rows_tensor(0, "k", 0, 12)  # flat uint8, token-major
    # 3 blocks of 4 rows, spaced 1000 bytes apart in a larger buffer (as in wave slots)
    spaced = torch.zeros(3 * (4 * row + 1000), dtype=torch.uint8)
    for b in range(3):
        spaced[b * (4 * row + 1000) : b * (4 * row + 1000) + 4 * row] = rows[b * 4 * row : (b + 1) * 4 * row]
    blocks = spaced.as_strided((3, 4 * row), (4 * row + 1000, 1))
    inst = s.begin_install(12, s.tokens, llama.identity)
    with pytest.raises(EngineError):
        inst.write_row_blocks(0, "k", 0, blocks.view(torch.int8))
    with pytest.raises(EngineError):
        inst.write_row_blocks(0, "k", 0, spaced[: 4 * row])  # 1-D
    with pytest.raises(EngineError):
        inst.write_row_blocks(0, "k", 4, blocks)  # rows 4..16 run past the cut
    inst.write_row_blocks(0, "k", 0, blocks)
    with pytest.raises(EngineError):
        inst.write_rows(0, "k", 8, rows[: 4 * row])  # written twice
    ref = s.begin_install(12, s.tokens, llama.identity)
    ref.write_rows(0, "k", 0, rows)
    assert torch.equal(inst._planes[(0, "k")], ref._planes[(0, "k")])
    inst.abort()
    ref.abort()


def test_slot_rows_bounds():
    stager = cuda.RestoreStager("cpu", slots=1, host_bytes=64, device_bytes=32)
    slot = stager.acquire()
    slot.upload(b"x" * 16)
    assert bytes(slot.rows(4, 8).numpy()) == b"x" * 8
    with pytest.raises(EngineError):
        slot.rows(10, 8)
    with pytest.raises(EngineError):
        slot.upload(b"y" * 33)
    slot.release()
    assert stager.idle == 1
