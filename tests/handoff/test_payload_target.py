"""Payloads read straight into a sink's destination pieces (kvpack.handoff.target): the same
checks in the same order, nothing counted before its digest verified, and a refusal aborts
the generation the bytes were written into."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpack.errors import EngineError, ProtocolError
from kvpack.handoff.receiver import Receiver, ReceiverConfig
from kvpack.handoff.target import PayloadTarget

from ._support import KEY, KEY_ID, NOW, TINY, MemoryLedger, RecordingSink, build_transfer


class TargetSink(RecordingSink):
    """Hands out each segment's destination as three uneven pieces of one buffer per
    segment (the detached generation); counts a segment only in ``write_segment``."""

    def __init__(self, refuse=None, fail_target=False):
        super().__init__(refuse=refuse)
        self.fail_target = fail_target
        self.handed: list = []
        self.landed: list = []
        self.places: list[bytearray] = []

    def payload_target(self, d):
        self.calls.append("payload_target")
        if self.fail_target:
            raise EngineError("install", "rows written twice")
        buf = bytearray(d.byte_len)
        self.places.append(buf)
        view = memoryview(buf)
        a, b = d.byte_len // 3, (2 * d.byte_len) // 3 + 1
        target = PayloadTarget([view[:a], view[a:b], view[b:]], token=d)
        self.handed.append(target)
        return target

    def write_segment(self, d, payload):
        assert isinstance(payload, PayloadTarget) and payload.token is d
        self.landed.append(d)
        super().write_segment(d, payload.tobytes())


def _receiver(sink, **kw):
    cfg = ReceiverConfig(key=KEY, key_id=KEY_ID, minimum_epoch=1, layout=TINY)
    return Receiver(cfg, sink, MemoryLedger(), now_unix_ms=NOW, **kw)


def _feed(r, stream: bytes, step: int):
    for i in range(0, len(stream), step):
        r.receive_data(stream[i : i + step])
    r.eof()


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("step", [1, 7, 1 << 20])
@pytest.mark.parametrize("streamed", [False, True])
def test_payloads_land_in_the_targets_and_commit(deferred, step, streamed):
    _m, frames, intents, payloads, _s = build_transfer(position=40, deferred=deferred)
    sink = TargetSink()
    with ThreadPoolExecutor(2) as pool:
        kw = {"stream_hash_min": 1, "stream_hash_chunk": 5, "hash_executor": pool} if streamed else {"stream_hash_min": None}
        r = _receiver(sink, **kw)
        _feed(r, b"".join(frames), step)
    assert sink.committed and sink.live == b"".join(payloads)
    assert [bytes(p) for p in sink.places] == payloads  # read in place, not staged
    assert len(sink.landed) == len(intents)


def test_tampered_payload_written_in_place_is_never_counted_and_aborts():
    _m, frames, intents, payloads, _s = build_transfer(position=40, deferred=True)
    k = 2
    stream = bytearray(b"".join(frames))
    at = stream.index(payloads[k]) + len(payloads[k]) // 2
    stream[at] ^= 0x40
    sink = TargetSink()
    r = _receiver(sink, stream_hash_min=1, stream_hash_chunk=3)
    with pytest.raises(ProtocolError) as info:
        _feed(r, bytes(stream), 11)
    assert info.value.category == "digest"
    assert len(sink.handed) == k + 1 and bytes(sink.places[k]) != payloads[k]  # the bad bytes did land there
    assert len(sink.landed) == k and sink.written == sink.landed  # the tampered segment never counted
    assert sink.calls[-1] == "abort" and not sink.committed and sink.live is None


def test_target_is_asked_only_after_the_segment_header_passed_its_checks():
    _m, frames, intents, payloads, _s = build_transfer(position=40, deferred=True)
    # the second segment first: refused at its header (sequence), before any target
    stream = frames[0] + frames[2]
    sink = TargetSink()
    r = _receiver(sink)
    with pytest.raises(ProtocolError) as info:
        _feed(r, stream, 1 << 20)
    assert info.value.category == "sequence"
    assert "payload_target" not in sink.calls and sink.calls[-1] == "abort"


def test_a_sink_that_cannot_hand_out_its_rows_refuses_the_transfer():
    _m, frames, _intents, _payloads, _s = build_transfer(position=40, deferred=True)
    sink = TargetSink(fail_target=True)
    r = _receiver(sink)
    with pytest.raises(ProtocolError) as info:
        _feed(r, b"".join(frames), 1 << 20)
    assert info.value.category == "sink" and "rows written twice" in info.value.message
    assert sink.calls[-1] == "abort" and not sink.committed and not sink.landed


def test_target_pieces_and_slices():
    buf = bytearray(range(10))
    v = memoryview(buf)
    t = PayloadTarget([v[:3], v[3:3], v[3:7], v[7:]])
    assert t.nbytes == 10 and len(t.pieces) == 3
    assert bytes(t.remaining(0)) == bytes([0, 1, 2]) and bytes(t.remaining(4)) == bytes([4, 5, 6])
    assert t.remaining(10).nbytes == 0
    assert b"".join(bytes(p) for p in t.slices(2, 8)) == bytes(range(2, 8))
    assert t.tobytes() == bytes(buf)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("pooled", [False, True])
def test_a_payload_sent_from_its_pieces_is_the_same_stream(deferred, pooled):
    """The sender hashes and frames a payload held in pieces (a tile's plane rows by
    reference) without joining it: the bytes on the wire and every digest are those of the
    joined payload, and a receiver commits them."""
    from kvpack.handoff.sender import Sender, declare_segments
    from kvpack.handoff.schedule import schedule_span

    from ._support import manifest, payloads_for

    intents = schedule_span(TINY, 40, 0)
    payloads = payloads_for(intents, 3)
    prompt = tuple(range(100, 140))
    m = manifest(prompt, deferred=True) if deferred else manifest(prompt, segments=declare_segments(intents, payloads))
    streams = []
    with ThreadPoolExecutor(2) as pool:
        for split in (False, True):
            kw = {"hash_executor": pool} if pooled else {}
            s = Sender(m, KEY, **kw)
            out = [b"".join(bytes(b) for b in s.begin())]
            for intent, p in zip(intents, payloads):
                view = memoryview(bytearray(p))
                payload = PayloadTarget([view[:5], view[5:9], view[9:]]) if split else view
                out.append(b"".join(bytes(b) for b in s.send_segment(payload, intent if deferred else None)))
            out.append(b"".join(bytes(b) for b in s.seal()))
            streams.append(b"".join(out))
    assert streams[0] == streams[1]
    sink = RecordingSink()
    r = _receiver(sink)
    _feed(r, streams[1], 1 << 20)
    assert sink.committed and sink.live == b"".join(payloads)
