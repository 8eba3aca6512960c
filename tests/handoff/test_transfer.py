"""End-to-end sender -> bytes -> receiver transfers, and the tampering sweep.

Every tampered stream must be refused with a typed, named reason; the sink's commit must
never run and nothing may become live; a sink that was opened must be aborted exactly once.
"""

import random
import struct

import pytest

from kvpack.errors import ProtocolError
from kvpack.handoff.events import Abort, Ack, Begin
from kvpack.handoff.frames import frame_bytes
from kvpack.handoff.receiver import Admitted, Committed, SegmentStored
from kvpack.handoff.schedule import MUSE
from kvpack.handoff.state import ReceiverState, SenderState

from ._support import (
    KEY,
    NOW,
    EXPIRES,
    MemoryLedger,
    RecordingSink,
    build_transfer,
    expectations,
    receiver,
    run,
)

MODES = [False, True]


def assert_refused(result, categories=None):
    r, sink, ledger, err, _ = result
    assert err is not None, "tampered stream was accepted"
    assert isinstance(err, ProtocolError) and err.category in ProtocolError.CATEGORIES
    assert err.message
    if categories is not None:
        assert err.category in categories, err
    assert "commit" not in sink.calls and sink.live is None
    assert r.state is ReceiverState.CLOSED
    if "begin" in sink.calls:
        assert sink.calls.count("abort") == 1 and sink.calls[-1] == "abort"
    assert not any(c[0] == "reserve" for c in ledger.calls) or "prepare" in sink.calls
    return err


@pytest.mark.parametrize("deferred", MODES)
def test_clean_transfer_commits(deferred):
    m, frames, intents, payloads, s = build_transfer(deferred=deferred)
    r, sink, ledger, err, effects = run(b"".join(frames))
    assert err is None
    assert isinstance(effects[0], Admitted)
    assert [e.sequence for e in effects if isinstance(e, SegmentStored)] == list(range(len(intents)))
    done = effects[-1]
    assert isinstance(done, Committed) and done.total_bytes == sum(map(len, payloads))
    assert sink.calls == ["begin"] + ["write_segment"] * len(intents) + ["prepare", "commit"]
    assert sink.live == b"".join(payloads)
    assert ledger.calls[-1] == ("reserve", 1) and ledger.highest == {"loop-key:1": 1}
    assert r.state is ReceiverState.DONE
    # The sender accepts exactly that ack.
    assert s.receive_data(done.ack) == Ack(m.transfer_id, m.generation)
    assert s.state is SenderState.DONE


def test_order_prepare_reserve_commit():
    events = []

    class Sink(RecordingSink):
        def prepare(self):
            events.append("prepare")

        def commit(self):
            events.append("commit")

    class Ledger(MemoryLedger):
        def reserve(self, *a):
            events.append("reserve")
            super().reserve(*a)

    _, frames, *_ = build_transfer(deferred=True)
    r, _, _ = receiver(sink=Sink(), ledger=Ledger())
    r.receive_data(b"".join(frames))
    assert events == ["prepare", "reserve", "commit"]


@pytest.mark.parametrize("deferred", MODES)
def test_muse_delta_transfer(deferred):
    prompt = tuple(range(1000, 1301))  # 301-token request, position 300
    m, frames, intents, payloads, _ = build_transfer(layout=MUSE, position=300, cut=256, deferred=deferred, prompt=prompt[:-1])
    assert len(intents) == 4 and all(i.logical_start == 256 for i in intents)
    exp = expectations(prompt)
    r, sink, _, err, _ = run(b"".join(frames), layout=MUSE, held=prompt[:256], exp=exp)
    assert err is None and sink.committed
    # Same stream, session holding a different prefix: refused at admission.
    held = (0,) + prompt[1:256]
    assert_refused(run(b"".join(frames), layout=MUSE, held=held, exp=exp), {"delta"})
    # Same stream, nothing held.
    assert_refused(run(b"".join(frames), layout=MUSE, held=None, exp=exp), {"delta"})


def test_post_ack_bytes_are_ignored():
    _, frames, *_ = build_transfer(deferred=True)
    # The genuine producer may send an abort after a mismatched ack (errata H4).
    stream = b"".join(frames) + frame_bytes(Abort("producer failure"))
    r, sink, _, err, effects = run(stream)
    assert err is None and sink.committed and "abort" not in sink.calls
    assert r.receive_data(b"garbage") == [] and r.state is ReceiverState.DONE


def _frames_stream(frames):
    return b"".join(frames)


def _header_len(frame: bytes) -> int:
    return 20 + struct.unpack_from("<I", frame, 8)[0]


@pytest.mark.parametrize("deferred", MODES)
def test_every_header_byte_flip_is_refused(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    tried = 0
    categories = {}
    for fi, frame in enumerate(frames):
        offset = sum(len(f) for f in frames[:fi])
        for pos in range(_header_len(frame)):
            for mask in (0x01, 0x40):
                stream = bytearray(_frames_stream(frames))
                stream[offset + pos] ^= mask
                err = assert_refused(run(bytes(stream)))
                categories[err.category] = categories.get(err.category, 0) + 1
                tried += 1
    assert tried > 5000
    # The sweep exercises many distinct reasons, not one catch-all.
    assert {"framing", "json", "digest", "authentication", "sequence"} <= set(categories)


@pytest.mark.parametrize("deferred", MODES)
def test_random_payload_byte_flips_are_refused(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    rng = random.Random(20240817 + deferred)
    regions = []
    offset = 0
    for frame in frames:
        h = _header_len(frame)
        if h < len(frame):
            regions.append((offset + h, offset + len(frame)))
        offset += len(frame)
    base = _frames_stream(frames)
    for _ in range(400):
        lo, hi = rng.choice(regions)
        stream = bytearray(base)
        stream[rng.randrange(lo, hi)] ^= rng.randrange(1, 256)
        assert_refused(run(bytes(stream)), {"digest"})


@pytest.mark.parametrize("deferred", MODES)
def test_drop_duplicate_reorder_segments(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    begin, segs, seal = frames[0], frames[1:-1], frames[-1]
    n = len(segs)
    variants = []
    for i in range(n):
        variants.append(segs[:i] + segs[i + 1 :])  # drop
        variants.append(segs[: i + 1] + [segs[i]] + segs[i + 1 :])  # duplicate
        for j in range(n):
            if i != j:
                v = list(segs)
                v[i], v[j] = v[j], v[i]  # swap
                variants.append(v)
    variants.append(segs[1:] + segs[:1])  # rotate
    for v in variants:
        assert_refused(run(b"".join([begin, *v, seal])), {"sequence"})


@pytest.mark.parametrize("deferred", MODES)
def test_truncation_everywhere(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    stream = _frames_stream(frames)
    for cut in range(0, len(stream)):
        assert_refused(run(stream[:cut]), {"framing", "aborted"})


@pytest.mark.parametrize("deferred", MODES)
def test_second_begin_and_ack_from_producer(deferred):
    m, frames, *_ = build_transfer(deferred=deferred)
    ack = frame_bytes(Ack(m.transfer_id, m.generation))
    for k in range(1, len(frames)):
        err = assert_refused(run(b"".join(frames[:k] + [frames[0]] + frames[k:])), {"state"})
        assert "begin" in err.message
        err = assert_refused(run(b"".join(frames[:k] + [ack] + frames[k:])), {"state"})
        assert "ack" in err.message
    # Anything but a begin first.
    for f in frames[1:]:
        assert_refused(run(f), {"state"})


@pytest.mark.parametrize("deferred", MODES)
def test_keys_epochs_clock_replay(deferred):
    _, frames, *_ = build_transfer(deferred=deferred)
    stream = b"".join(frames)
    assert_refused(run(stream, key=bytes(32)), {"authentication"})
    assert_refused(run(stream, key_id="other-key"), {"key"})
    assert_refused(run(stream, minimum_epoch=2), {"key"})
    assert_refused(run(stream, now=EXPIRES + 1), {"expired"})
    assert_refused(run(stream, ledger=MemoryLedger(highest={"loop-key:1": 1})), {"replay"})
    # Same transfer twice through one ledger: the second is a replay.
    ledger = MemoryLedger()
    assert run(stream, ledger=ledger)[3] is None
    ledger.calls.clear()
    assert_refused(run(stream, ledger=ledger), {"replay"})


def test_generation_zero_and_expired_begin():
    _, frames, *_ = build_transfer(deferred=True, generation=0)
    assert_refused(run(b"".join(frames)), {"replay"})
    _, frames, *_ = build_transfer(deferred=True, created=NOW - 10_000, expires=NOW - 1)
    assert_refused(run(b"".join(frames)), {"expired"})


@pytest.mark.parametrize("step", ["begin", "write_segment", "prepare"])
def test_sink_refusals_abort(step):
    _, frames, *_ = build_transfer(deferred=True)
    sink = RecordingSink(refuse=step)
    err = assert_refused(run(b"".join(frames), sink=sink), {"sink"})
    assert step in err.message


def test_failed_commit_is_aborted_not_acked():
    # commit should be infallible; if it fails anyway nothing is acked and the detached
    # generation is discarded (the reserved generation makes a retry a replay).
    _, frames, *_ = build_transfer(deferred=True)
    r, sink, ledger, err, effects = run(b"".join(frames), sink=RecordingSink(refuse="commit"))
    assert err.category == "sink" and sink.live is None and sink.calls[-2:] == ["commit", "abort"]
    assert not any(isinstance(e, Committed) for e in effects) and r.state is ReceiverState.CLOSED


def test_reservation_failure_never_commits():
    _, frames, *_ = build_transfer(deferred=True)
    assert_refused(run(b"".join(frames), ledger=MemoryLedger(refuse_reserve=True)), {"reservation"})


def test_producer_abort():
    _, frames, *_ = build_transfer(deferred=True)
    err = assert_refused(run(b"".join(frames[:3]) + frame_bytes(Abort("producer failure"))), {"aborted"})
    assert "producer failure" in err.message


def test_mode_mismatch_segment_forms():
    _, declared, *_ = build_transfer(deferred=False)
    _, deferred, *_ = build_transfer(deferred=True)
    # Deferred segment frames inside a declared transfer and vice versa (errata M4).
    assert_refused(run(b"".join([declared[0], deferred[1]])), {"sequence"})
    assert_refused(run(b"".join([deferred[0], declared[1]])), {"sequence"})


def test_transfer_id_mismatch_is_pre_admission():
    prompt = tuple(range(100, 121))
    _, frames, *_ = build_transfer(deferred=True, prompt=prompt[:-1], transfer_id="muser-99-0-1")
    r, sink, ledger, err, _ = run(b"".join(frames), exp=expectations(prompt, "muser-1700000000000-0"))
    assert err.category == "identity" and not r.admitted
    assert sink.calls == [] and ledger.calls == []  # nothing touched: the daemon keeps waiting


def test_local_abort_discards():
    _, frames, *_ = build_transfer(deferred=True)
    r, sink, _ = receiver()
    r.receive_data(b"".join(frames[:3]))
    r.abort("timeout")
    assert sink.calls[-1] == "abort" and r.state is ReceiverState.CLOSED
    with pytest.raises(ProtocolError, match="closed"):
        r.receive_data(frames[3])


def test_incomplete_deferred_schedule_refused_at_seal():
    # A producer holding the key seals a stream missing its last scheduled tile: the seal
    # verifies, completeness does not (errata M3).
    from kvpack.handoff.manifest import SealAccumulator, SealManifestV2, seal_tag
    from kvpack.handoff.events import Seal

    m, frames, intents, payloads, s = build_transfer(deferred=True)
    from kvpack.handoff.frames import decode_all

    decoded = decode_all(b"".join(frames[:-2]))
    acc = SealAccumulator()
    for f in decoded[1:]:
        acc.add_descriptor(f.descriptor)
        acc.add_payload(f.payload)
    core = acc.core(m)
    seal = frame_bytes(Seal(SealManifestV2(core, seal_tag(KEY, core))))
    err = assert_refused(run(b"".join(frames[:-2]) + seal), {"delta"})
    assert "incomplete" in err.message


def test_sender_ack_checks():
    m, frames, *_ = build_transfer(deferred=True)

    for bad in (
        frame_bytes(Ack(m.transfer_id, m.generation + 1)),
        frame_bytes(Ack("other", m.generation)),
        frame_bytes(Begin(m)),
        b"KVPKV2\0\0" + struct.pack("<IQ", 5, 1) + b"hello",
    ):
        _, _, _, _, s = build_transfer(deferred=True)
        with pytest.raises(ProtocolError):
            s.receive_data(bad)
        assert s.state is SenderState.CLOSED
    _, _, _, _, s = build_transfer(deferred=True)
    assert s.receive_data(frame_bytes(Ack(m.transfer_id, m.generation))[:10]) is None
    assert s.state is SenderState.AWAIT_ACK
