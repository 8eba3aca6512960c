"""Restores whose two long hashes run on the device (kvpack.engine.device_verify).

On the CPU the pipeline is forced (``verify_on = "device"``) and hashes the *device copy*
of each wave with hashlib through the job table's addresses: routing (raw chunks deferred,
encrypted and lossless chunks decoded on the host), the wave ring, installing from the
hashed copy, and every refusal are checked without a GPU. The kernel itself and the same
pipeline on CUDA are checked in the ``requires_cuda`` tests at the end."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from kvpack.engine import device_verify
from kvpack.errors import StoreError
from kvpack.store import PackStore

from .conftest import cohere2_engine, llama_engine, random_tokens, requires_cuda


def _store(tmp_path, encrypted=False, wave_chunks=5, waves=3, verify_on="device") -> PackStore:
    store = PackStore.init(os.path.join(tmp_path, "s"), encrypted=encrypted, chunk_bytes=4096)
    store.verify_on = verify_on
    store.wave_chunks = wave_chunks
    store.device_waves = waves
    return store


def _ring_idle(device, wave_chunks):
    ring = device_verify.wave_ring(device, wave_chunks=wave_chunks, waves=1)
    return ring._free.qsize() == ring.waves


@pytest.mark.parametrize("model,encrypted", [("llama-f16", False), ("llama-bf16", True), ("llama-f32", False), ("cohere2", False)])
def test_device_verified_restore_is_bit_identical(tmp_path, model, encrypted):
    eng = cohere2_engine() if model == "cohere2" else llama_engine(model.split("-")[1])
    tokens = random_tokens(640, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, encrypted)
    store.save(s)
    r = eng.new_session()
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    report = store.restore(hit, r, tokens)
    assert report.chunks_verified > 3 * store.wave_chunks  # the ring (3 waves) wrapped around
    if encrypted:  # AEAD chunks are opened on the host; nothing is left for the device
        assert report.hashed_on == {"device": 0, "host": report.chunks_verified}
    elif model == "cohere2":  # windowed layers use the lossless codec (host), full ones raw
        assert report.hashed_on["device"] > 0 and report.hashed_on["host"] > 0
    else:
        assert report.hashed_on == {"device": report.chunks_verified, "host": 0}
    assert r.cache_digest() == s.cache_digest()
    assert r.decode_greedy(4)[0] == s.decode_greedy(4)[0]
    assert _ring_idle(eng.device, store.wave_chunks)


def test_restore_timeline_records_every_wave_in_order(tmp_path, monkeypatch):
    """KVPACK_RESTORE_TIMELINE: one JSON line per restore, one row per wave, each wave's
    reads done before it launched and its hash seen before its install was queued."""
    import json

    path = os.path.join(tmp_path, "timeline.jsonl")
    monkeypatch.setenv("KVPACK_RESTORE_TIMELINE", path)
    eng = llama_engine("f32")
    tokens = random_tokens(384, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path)
    store.save(s)
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    with open(path) as fh:
        lines = [json.loads(line) for line in fh]
    assert len(lines) == 1
    rows = lines[0]
    assert sorted(row["wave"] for row in rows) == list(range(report.phases["device_waves"]))
    assert sum(row["chunks"] for row in rows) == report.chunks_verified
    for row in rows:
        assert row["submit"] <= row["submitted"] <= row["launch"] <= row["hash_seen"] <= row["install_queued"]
        assert row["reads_done"] <= row["launched"]
    assert r.cache_digest() == s.cache_digest()


@pytest.mark.parametrize("tail", [1, 7, 10_000])
def test_device_verify_hands_the_tail_to_the_host(tmp_path, tail):
    """The last ``device_host_tail`` chunks are verified completely on the host (their raw
    plaintext stays in its slot), the rest by the device pipeline; the result is identical."""
    eng = llama_engine("f16")
    tokens = random_tokens(640, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path)
    store.device_host_tail = tail
    store.save(s)
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    host = min(tail, report.chunks_verified)
    assert report.hashed_on == {"device": report.chunks_verified - host, "host": host}
    assert r.cache_digest() == s.cache_digest()
    assert _ring_idle(eng.device, store.wave_chunks)


def test_concurrent_restores_share_the_ring_without_deadlock(tmp_path):
    """Two restores in two threads on one ring too small for both (3 waves each wanted):
    neither may wait for a wave while holding waves the other needs."""
    import threading

    eng = llama_engine("f16")
    tokens = random_tokens(640, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, wave_chunks=2, waves=3)
    store.save(s)
    device_verify.wave_ring(eng.device, wave_chunks=2, waves=4)  # 4 waves for two restores that want 3 each
    results, errors = [], []

    def restore():
        try:
            r = eng.new_session()
            store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
            results.append(r.cache_digest())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=restore, daemon=True) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "restores deadlocked on the shared ring"
    assert not errors
    assert results == [s.cache_digest()] * 2
    assert _ring_idle(eng.device, 2)


def test_device_verified_delta_chain_restores(tmp_path):
    eng = llama_engine("f16")
    tokens = random_tokens(900, eng.layout.vocab_size, seed=3)
    s = eng.new_session()
    s.prefill(tokens[:512])
    store = _store(tmp_path)
    store.save(s)
    s.prefill(tokens[512:])
    store.save(s)  # a delta pack over the first cut
    r = eng.new_session()
    hit = store.find_deepest(tokens, eng.layout, eng.ids())
    report = store.restore(hit, r, tokens)
    assert report.packs == 2
    assert report.hashed_on["device"] == report.chunks_verified
    assert r.cache_digest() == s.cache_digest()


def _victim(store, index=None):
    d = os.path.join(store.path, "chunks")
    names = sorted(os.listdir(d))
    return os.path.join(d, names[len(names) // 2 if index is None else index])


@pytest.mark.parametrize(
    "where",
    [
        "payload",  # plaintext byte: object digest and content id both differ
        "header_digest",  # header field covered by the object digest
        "padding",  # a nonzero pad byte: refused by the host checks before any hashing
        "truncate",  # the file is shorter than its ref
        "missing",
    ],
)
@pytest.mark.parametrize("tail", [None, 10_000], ids=["device", "host-tail"])
def test_device_verified_refusal_installs_nothing(tmp_path, where, tail):
    eng = llama_engine("f16")
    tokens = random_tokens(512, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path)
    store.device_host_tail = tail
    store.save(s)
    victim = _victim(store)
    data = bytearray(open(victim, "rb").read())
    if where == "payload":
        data[4096 + 16 + 100] ^= 1
    elif where == "header_digest":
        data[210] ^= 0x40
    elif where == "padding":
        data[-1] ^= 1
    if where == "missing":
        os.unlink(victim)
    elif where == "truncate":
        open(victim, "wb").write(bytes(data[:4096]))
    else:
        open(victim, "wb").write(bytes(data))
    r = eng.new_session()
    r.prefill(tokens[:10])
    before = r.cache_digest()
    with pytest.raises(StoreError) as exc:
        store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert exc.value.category == ("incomplete" if where == "missing" else "corrupt")
    assert r.cache_digest() == before  # the live session is untouched
    assert len(r.tokens) == 10
    assert _ring_idle(eng.device, store.wave_chunks)


def test_device_and_host_verification_agree_on_every_flipped_byte_class(tmp_path):
    """The same damaged store is refused by both paths with the same underlying category
    (sampled flips across header, frame header, plaintext and padding)."""
    eng = llama_engine("f16")
    tokens = random_tokens(300, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path)
    store.save(s)
    victim = _victim(store, 0)
    pristine = open(victim, "rb").read()
    rng = random.Random(7)
    positions = [0, 9, 16, 20, 24, 28, 40, 50, 90, 120, 150, 180, 200, 230, 300, 4095, 4096, 4100, 4111, 4112, 5000]
    positions += [rng.randrange(len(pristine)) for _ in range(6)] + [len(pristine) - 1]
    for pos in positions:
        data = bytearray(pristine)
        data[pos] ^= 0x10
        open(victim, "wb").write(bytes(data))
        reasons = {}
        for verify_on in ("host", "device"):
            store.verify_on = verify_on
            r = eng.new_session()
            with pytest.raises(StoreError) as exc:
                store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
            reasons[verify_on] = str(exc.value)
        assert reasons["host"] == reasons["device"], pos
    open(victim, "wb").write(pristine)


def test_hmac_split_matches_hmac():
    import hmac

    from kvpack.format.identity import hmac_sha256_finish, hmac_sha256_pads

    rng = random.Random(1)
    for klen in (0, 1, 32, 63, 64, 65, 200):
        key = rng.randbytes(klen)
        msg = rng.randbytes(rng.randrange(0, 3000))
        inner, outer = hmac_sha256_pads(key)
        assert hmac_sha256_finish(outer, hashlib.sha256(inner + msg).digest()) == hmac.new(key, msg, hashlib.sha256).digest()


def test_host_job_hashing_reads_head_then_body():
    import torch

    body = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    head = torch.randint(0, 256, (70,), dtype=torch.uint8)
    table = torch.tensor([[body.data_ptr() + 3, head.data_ptr(), 4000, 70], [body.data_ptr(), 0, 0, 0]], dtype=torch.int64)
    got = device_verify.hash_jobs_on_host(table.numpy(), 2)
    assert got[0] == hashlib.sha256(head.numpy().tobytes() + body.numpy()[3:4003].tobytes()).digest()
    assert got[1] == hashlib.sha256(b"").digest()


# -- on a GPU ----------------------------------------------------------------------------------


@requires_cuda
def test_gpu_sha256_matches_hashlib_on_every_length_class():
    import torch

    from kvpack.engine import gpu_digest

    assert gpu_digest.available("cuda") is None
    rng = random.Random(5)
    buf = torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda")
    host = buf.cpu().numpy().tobytes()
    cases = []
    for n in list(range(0, 200)) + [255, 256, 4095, 4096, 4097, 65536 + 13, (1 << 20) + 7]:
        off = rng.randrange(0, 8)
        hlen = rng.choice([0, 0, 1, 55, 56, 63, 64, 65, 130, 200, gpu_digest.HEAD_BYTES])
        head = rng.randbytes(hlen)
        cases.append((buf[off : off + n], head, head + host[off : off + n]))
    got = gpu_digest.sha256_many([(b, h) for b, h, _ in cases], "cuda")
    for (_b, _h, message), digest in zip(cases, got):
        assert digest == hashlib.sha256(message).digest(), len(message)


@requires_cuda
def test_host_tail_is_calibrated_from_the_kernel_latency():
    from kvpack.engine import gpu_digest
    from kvpack.format import constants as C

    ring = device_verify.wave_ring("cuda", wave_chunks=5, waves=1)
    latency = gpu_digest.message_latency("cuda", C.MAX_CHUNK_OBJECT_BYTES)
    assert 0 < latency < 5
    chunk = C.MAX_CHUNK_OBJECT_BYTES
    tail = device_verify.host_tail_chunks(ring, 16, chunk)
    assert tail == int(latency * 16 / (chunk / device_verify.READ_BYTES_PER_S + 2 * chunk / device_verify.host_sha256_rate()))
    # measured host cost per byte and one wave's upload, as a restore passes them
    measured = device_verify.host_tail_chunks(ring, 16, chunk, host_s_per_byte=1e-9, upload_bytes=1 << 29)
    assert measured == int((latency + (1 << 29) / device_verify.H2D_BYTES_PER_S) * 16 / (chunk * 1e-9))
    assert device_verify.host_tail_chunks(ring, 16, chunk, host_s_per_byte=2e-9) < measured


@requires_cuda
def test_gpu_sha256_full_chunk_objects():
    import torch

    from kvpack.engine import gpu_digest

    objs = torch.randint(0, 256, (8, device_verify.SLOT_BYTES), dtype=torch.uint8, device="cuda")
    host = objs.cpu().numpy()
    got = gpu_digest.sha256_many([(objs[i, : device_verify.SLOT_BYTES - 4096 * i], b"") for i in range(8)], "cuda")
    for i in range(8):
        assert got[i] == hashlib.sha256(host[i, : device_verify.SLOT_BYTES - 4096 * i].tobytes()).digest()


@requires_cuda
@pytest.mark.parametrize("digests", ["copy", "mapped"])
@pytest.mark.parametrize("tail", [0, None], ids=["all-device", "calibrated-host-tail"])
@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_device_verified_restore_on_cuda_is_bit_identical(tmp_path, monkeypatch, dtype, tail, digests):
    import torch

    monkeypatch.setattr(device_verify, "DIGESTS", digests)
    eng = llama_engine(dtype, device="cuda")
    tokens = random_tokens(1000, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, verify_on="auto")
    store.device_host_tail = tail
    store.save(s)
    r = eng.new_session()
    report = store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert sum(report.hashed_on.values()) == report.chunks_verified
    if tail == 0:
        assert report.hashed_on == {"device": report.chunks_verified, "host": 0}
    torch.cuda.synchronize()
    for layer, role in eng.layout.states():
        a, _ = s._plane(layer, role)
        b, _ = r._plane(layer, role)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, role)
    assert torch.equal(s.last_logits, r.last_logits)
    assert r.decode_greedy(6)[0] == s.decode_greedy(6)[0]
    assert _ring_idle(eng.device, store.wave_chunks)


@requires_cuda
@pytest.mark.parametrize("digests", ["copy", "mapped"])
def test_device_verified_refusal_on_cuda(tmp_path, monkeypatch, digests):
    monkeypatch.setattr(device_verify, "DIGESTS", digests)
    eng = llama_engine("f16", device="cuda")
    tokens = random_tokens(512, eng.layout.vocab_size)
    s = eng.new_session()
    s.prefill(tokens)
    store = _store(tmp_path, verify_on="auto")
    store.device_host_tail = 0
    store.save(s)
    victim = _victim(store)
    data = bytearray(open(victim, "rb").read())
    data[4096 + 16 + 2000] ^= 0x80
    open(victim, "wb").write(bytes(data))
    r = eng.new_session()
    r.prefill(tokens[:20])
    before = r.cache_digest()
    with pytest.raises(StoreError) as exc:
        store.restore(store.find_deepest(tokens, eng.layout, eng.ids()), r, tokens)
    assert "object digest" in str(exc.value)
    assert r.cache_digest() == before
    assert _ring_idle(eng.device, store.wave_chunks)


@requires_cuda
@pytest.mark.parametrize("count", [1, 31, 33, 65])
def test_gpu_sha256_partial_groups_with_one_long_message(count):
    """Jobs run in groups of 32 sharing two warps; a group that is not full, or whose longest
    message sits in any lane, still gives every lane its own digest."""
    import torch

    from kvpack.engine import gpu_digest

    rng = random.Random(count)
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    host = buf.cpu().numpy().tobytes()
    long_lane = rng.randrange(count)
    cases = []
    for i in range(count):
        n = (1 << 19) + 3 if i == long_lane else rng.randrange(0, 300)
        off = rng.randrange(0, 4)
        head = rng.randbytes(rng.choice([0, 64, 130]))
        cases.append((buf[off : off + n], head, head + host[off : off + n]))
    got = gpu_digest.sha256_many([(b, h) for b, h, _ in cases], "cuda")
    assert got == [hashlib.sha256(m).digest() for _b, _h, m in cases]
