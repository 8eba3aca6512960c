"""Payloads hashed while they arrive (receiver, :mod:`kvpack.handoff.streamhash`).

The streamed path must be invisible to the protocol: every stream -- clean, tampered,
truncated, reordered, fuzzed, fed in any split -- gives exactly the outcome of hashing
each complete payload on the receiving thread (same refusal category and message, same
sink and ledger calls, same effects, same seal core). Tiny chunk sizes force many ranges
per payload through the real lanes, on a thread pool and on the core's default inline
executor; large payloads run the default sizes. The core itself starts no threads.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpack.errors import ProtocolError
from kvpack.handoff import receiver as receiver_mod
from kvpack.handoff import manifest as handoff_manifest
from kvpack.handoff import streamhash
from kvpack.handoff.frames import MAGIC, decode_all, frame_bytes
from kvpack.handoff.manifest import SealAccumulator
from kvpack.handoff.events import Abort
from kvpack.handoff.receiver import Committed, Receiver, ReceiverConfig
from kvpack.handoff.schedule import SpanSegment
from kvpack.handoff.sender import Sender
from kvpack.handoff.state import ReceiverState
from kvpack.handoff.streamhash import PayloadStream

from ._support import KEY, KEY_ID, NOW, TINY, MemoryLedger, RecordingSink, build_transfer, manifest

MODES = [False, True]
#: The driver-owned pool the streamed runs hash on (the handoff core never makes one).
POOL = ThreadPoolExecutor(4, thread_name_prefix="test-stream-hash")
INLINE = {"stream_hash_min": None}
STREAMED = {"stream_hash_min": 1, "stream_hash_chunk": 48, "hash_executor": POOL}
STREAMED_INLINE = {"stream_hash_min": 1, "stream_hash_chunk": 48}  # the default executor: no threads


def _receiver(layout=TINY, sink=None, ledger=None, **rkw):
    sink = sink if sink is not None else RecordingSink()
    ledger = ledger if ledger is not None else MemoryLedger()
    cfg = ReceiverConfig(key=KEY, key_id=KEY_ID, minimum_epoch=1, layout=layout)
    return Receiver(cfg, sink, ledger, now_unix_ms=NOW, **rkw), sink, ledger


def _outcome(stream: bytes, *, layout=TINY, splits=None, **rkw):
    """Everything observable about one run: (error, effects, sink calls, live, ledger calls,
    state, seal core, bytes/segments received)."""
    r, sink, ledger = _receiver(layout, **rkw)
    effects = []
    err = None
    try:
        if splits is None:
            effects = r.receive_data(stream)
        else:  # the recv_into path: wanted() / advance(n) in random pieces
            rng = random.Random(splits)
            src = memoryview(stream)
            pos = 0
            while pos < len(src) and r.state is not ReceiverState.DONE:
                dst = r.wanted()
                k = min(len(dst), len(src) - pos, rng.choice((1, 5, 17, 64, 1 << 20)))
                dst[:k] = src[pos : pos + k]
                pos += k
                effects.extend(r.advance(k))
        r.eof()
    except ProtocolError as exc:
        err = (exc.category, exc.message, exc.remote)
    core = r.seal_core()
    return (
        err,
        effects,
        list(sink.calls),
        sink.live,
        list(ledger.calls),
        r.state,
        None if core is None else core.to_json(),
        r.bytes_received,
        r.segments_received,
    )


def _same(stream: bytes, **kw):
    inline = _outcome(stream, **INLINE, **kw)
    assert _outcome(stream, **STREAMED, **kw) == inline
    assert _outcome(stream, **STREAMED_INLINE, **kw) == inline
    return inline


def _header_len(frame: bytes) -> int:
    return 20 + struct.unpack_from("<I", frame, 8)[0]


@pytest.mark.parametrize("deferred", MODES)
def test_clean_transfer_identical_in_any_split(deferred):
    _, frames, _, payloads, _ = build_transfer(deferred=deferred)
    stream = b"".join(frames)
    for splits in (None, 1, 2, 3):
        out = _same(stream, splits=splits)
        assert out[0] is None and isinstance(out[1][-1], Committed) and out[3] == b"".join(payloads)


@pytest.mark.parametrize("deferred", MODES)
def test_tampered_headers_identical(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    base = b"".join(frames)
    tried = 0
    offset = 0
    for frame in frames:
        for pos in range(deferred, _header_len(frame), 2):  # every other byte, both masks
            stream = bytearray(base)
            stream[offset + pos] ^= 0x01 if pos % 4 < 2 else 0x40
            assert _same(bytes(stream))[0] is not None
            tried += 1
        offset += len(frame)
    assert tried > 1000


@pytest.mark.parametrize("deferred", MODES)
def test_payload_flips_truncations_and_reorders_identical(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    base = b"".join(frames)
    rng = random.Random(99 + deferred)
    offset = 0
    for frame in frames:
        h = _header_len(frame)
        for pos in range(h, len(frame)):  # every payload byte
            stream = bytearray(base)
            stream[offset + pos] ^= rng.randrange(1, 256)
            err = _same(bytes(stream))[0]
            assert err is not None and err[0] == "digest"
        offset += len(frame)
    for cut in range(0, len(base), 7):
        assert _same(base[:cut])[0] is not None
    begin, segs, seal = frames[0], frames[1:-1], frames[-1]
    for i in range(len(segs)):
        assert _same(b"".join([begin, *segs[:i], *segs[i + 1 :], seal]))[0] is not None
        assert _same(b"".join([begin, *segs[: i + 1], segs[i], *segs[i + 1 :], seal]))[0] is not None
    assert _same(b"".join(frames[:3]) + frame_bytes(Abort("producer failure")))[0][0] == "aborted"


def test_fuzzed_streams_identical():
    from .test_fuzz import CORPUS, _mutate

    rng = random.Random(0xC6)
    full = [c for c in CORPUS if c.count(MAGIC) > 3]
    refused = 0
    for i in range(1500):
        data = _mutate(rng, rng.choice(full))
        out = _same(data, splits=i if i % 3 == 0 else None)
        refused += out[0] is not None
    assert refused > 1000


# -- large payloads with the production sizes ---------------------------------------------


ELEMENTS = 1024  # f16: 2 KiB per token


def _big_transfer(tokens=(700, 1, 1100, 513), seed=5, **sender_kw):
    """Deferred transfer, no span layout: segments of ~1.4 MiB, 2 KiB, ~2.2 MiB, ~1 MiB."""
    rng = random.Random(seed)
    m = manifest((1,), deferred=True)
    s = Sender(m, KEY, **sender_kw)
    frames = [b"".join(bytes(b) for b in s.begin())]
    payloads = []
    for seq, count in enumerate(tokens):
        p = rng.randbytes(count * ELEMENTS * 2)
        payloads.append(p)
        intent = SpanSegment(seq, "target", "nope_key", seq, 0, count, "f16_le", ELEMENTS)
        frames.append(b"".join(bytes(b) for b in s.send_segment(p, intent)))
    frames.append(b"".join(bytes(b) for b in s.seal()))
    return frames, payloads


def test_large_payloads_stream_with_defaults():
    frames, payloads = _big_transfer()
    stream = b"".join(frames)
    defaults = _outcome(stream, layout=None)
    assert defaults[0] is None and defaults[3] == b"".join(payloads)
    assert defaults == _outcome(stream, layout=None, **INLINE)
    assert defaults == _outcome(stream, layout=None, hash_executor=POOL)
    # wanted() stops at every hash range of a large payload (the driver advances per range)
    r, sink, _ = _receiver(None)
    r.receive_data(b"".join(frames[:1]) + frames[1][: _header_len(frames[1])])
    assert len(r.wanted()) == receiver_mod.STREAM_HASH_CHUNK
    # ... but not for a payload below the streaming size
    r, sink, _ = _receiver(None)
    r.receive_data(b"".join(frames[:2]) + frames[2][: _header_len(frames[2])])
    assert len(r.wanted()) == len(payloads[1])
    # ... and before admission a segment is refused at its header: its declared length never
    # sizes a buffer (allocate after checking, issue 14)
    r, sink, _ = _receiver(None)
    with pytest.raises(ProtocolError) as info:
        r.receive_data(frames[1][: _header_len(frames[1])])
    assert info.value.category == "state" and r.state is ReceiverState.CLOSED
    assert r.decoder.buffered_bytes < len(payloads[0])


def test_large_payload_tampering_identical():
    frames, payloads = _big_transfer()
    base = b"".join(frames)
    first = len(frames[0]) + _header_len(frames[1])
    third = len(b"".join(frames[:3])) + _header_len(frames[3])
    chunk = receiver_mod.STREAM_HASH_CHUNK
    for at in (first, first + chunk - 1, first + chunk, first + len(payloads[0]) - 1, third + 3 * chunk + 5):
        stream = bytearray(base)
        stream[at] ^= 0x80
        out = _outcome(bytes(stream), layout=None, hash_executor=POOL)
        assert out[0][0] == "digest" and out[2][-1] == "abort" and out[3] is None
        assert out == _outcome(bytes(stream), layout=None, **INLINE) == _outcome(bytes(stream), layout=None)
    for cut in (first + 1, first + chunk, first + chunk + 1, third + len(payloads[2]) - 1):
        out = _outcome(base[:cut], layout=None)
        assert out[0][0] == "framing" and out == _outcome(base[:cut], layout=None, **INLINE)
    # a local abort in the middle of a streamed payload
    r, sink, _ = _receiver(None)
    r.receive_data(base[: first + chunk + 100])
    r.abort("timeout")
    assert sink.calls[-1] == "abort" and r.state is ReceiverState.CLOSED and r._stream is None


class _SlowPool:
    """A pool whose lanes start late and hash slowly: a decoder that reused the payload
    buffer before its ranges were hashed would produce wrong digests."""

    def __init__(self):
        self.calls = 0

    def submit(self, fn, *args):
        self.calls += 1

        def slow():
            time.sleep(0.002)
            fn(*args)

        threading.Thread(target=slow, daemon=True).start()


def test_slow_lanes_never_see_a_reused_buffer():
    pool = _SlowPool()
    frames, payloads = _big_transfer(tokens=(520, 530, 515))
    stream = b"".join(frames)
    kw = {"layout": None, "stream_hash_min": 1, "stream_hash_chunk": 200_000, "hash_executor": pool}
    for splits in (None, 7):
        out = _outcome(stream, splits=splits, **kw)
        assert out[0] is None and out[3] == b"".join(payloads)
        assert out == _outcome(stream, layout=None, splits=splits, **INLINE)
    assert pool.calls >= 2 * 2 * 3  # two lanes, two runs, three segments at least


def test_receive_frame_drops_a_streaming_payload():
    frames, payloads = _big_transfer(tokens=(600, 600))
    decoded = decode_all(b"".join(frames))
    r, sink, _ = _receiver(None)
    r.receive_data(frames[0] + frames[1][: _header_len(frames[1]) + 1000])
    assert r._stream is not None
    # mixing the APIs: a frame fed directly is hashed on the calling thread
    r2, sink2, _ = _receiver(None)
    for f in decoded:
        r2.receive_frame(f)
    assert sink2.live == b"".join(payloads)
    r.receive_frame(decoded[1])
    assert r._stream is None and sink.written[-1].sequence == 0


# -- the stream itself --------------------------------------------------------------------


def test_payload_stream_digests_any_feed():
    rng = random.Random(3)
    data = rng.randbytes(300_001)
    base = hashlib.sha256(b"earlier payloads")
    for chunk in (1, 1000, 65_536, 1 << 20):
        s = PayloadStream(memoryview(bytearray(data)), base, chunk)
        filled = 0
        while filled < len(data):
            filled = min(len(data), filled + rng.choice((1, 333, 4096, 70_000)))
            s.feed(filled)
            assert 1 <= s.room() <= chunk
        assert s.digest() == hashlib.sha256(data).hexdigest()
        assert s.running_hash.hexdigest() == hashlib.sha256(b"earlier payloads" + data).hexdigest()
    assert base.hexdigest() == hashlib.sha256(b"earlier payloads").hexdigest()  # copied, not fed
    s = PayloadStream(memoryview(bytearray(10)), base, 4)
    with pytest.raises(ValueError):
        s.feed(11)
    s.feed(6)
    with pytest.raises(ValueError):
        s.feed(5)


def test_payload_stream_errors_and_cancel():
    class Broken:
        def update(self, _view):
            raise MemoryError("boom")

        def copy(self):
            return self

    s = PayloadStream(memoryview(bytearray(100)), Broken(), 10)
    s.feed(100)
    with pytest.raises(MemoryError):
        s.digest()
    s = PayloadStream(memoryview(bytearray(100)), hashlib.sha256(), 10)
    s.feed(50)
    s.cancel()
    s.feed(100)  # ignored after cancel


def test_payload_stream_on_a_pool_matches_inline():
    rng = random.Random(5)
    data = rng.randbytes(1_000_003)
    base = hashlib.sha256(b"before")
    digests = set()
    for executor in (POOL, None):
        kw = {} if executor is None else {"executor": executor}
        s = PayloadStream(memoryview(bytearray(data)), base, 65_536, **kw)
        for filled in range(0, len(data) + 1, 99_991):
            s.feed(filled)
        digests.add((s.digest(), s.running_hash.hexdigest()))
    assert digests == {(hashlib.sha256(data).hexdigest(), hashlib.sha256(b"before" + data).hexdigest())}


def test_the_handoff_core_starts_no_threads():
    """Defaults everywhere (the way a forked child or a library user gets them): a streamed
    large transfer, sender and receiver, runs on the calling thread alone."""
    before = {t.ident for t in threading.enumerate()}
    frames, payloads = _big_transfer()
    out = _outcome(b"".join(frames), layout=None)
    assert out[0] is None and out[3] == b"".join(payloads)
    assert {t.ident for t in threading.enumerate()} == before
    for name in ("hash_pool", "_POOL", "_hash_pool"):
        assert not hasattr(streamhash, name) and not hasattr(handoff_manifest, name)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_streams_with_the_defaults():
    """The fork hang of 9d28fc6 (a child inheriting a pool without its threads) cannot come
    back: the core has no pool. A child forked after the parent hashed on its own pool
    still digests with the defaults."""
    import warnings

    POOL.submit(lambda: None).result()  # the parent's (driver-owned) pool has a thread
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12: fork of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            s = PayloadStream(memoryview(bytearray(b"x" * 5000)), hashlib.sha256(), 1000)
            s.feed(3000)
            big = memoryview(bytes(2 << 20))
            ok = s.digest() == hashlib.sha256(b"x" * 5000).hexdigest()
            ok = ok and SealAccumulator().add_payload_and_digest(big) == hashlib.sha256(big).hexdigest()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("digest hung in a forked child")


def test_sender_on_a_pool_emits_the_same_bytes():
    # large deferred segments: the segment digest runs on the pool while the running digest is fed
    assert _big_transfer(hash_executor=POOL) == _big_transfer()
