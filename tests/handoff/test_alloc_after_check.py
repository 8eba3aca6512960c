"""Allocate after checking (issue 14): a peer's declared payload length sizes no buffer until
the receiver state machine accepted that segment in its state at exactly its descriptor's
length. Measured with tracemalloc: refusals cost a few KiB, not the declared size."""

from __future__ import annotations

import json
import struct
import tracemalloc

import pytest

from kvpack.errors import ProtocolError
from kvpack.handoff.frames import MAGIC, PREAMBLE
from kvpack.handoff.state import ReceiverState

from ._support import build_transfer, receiver

DECLARED = 512 << 20


def _segment_header(sequence: int, payload_len: int, descriptor: dict | None = None) -> bytes:
    header = {"kind": "segment", "sequence": sequence}
    if descriptor is not None:
        header["descriptor"] = descriptor
    body = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return PREAMBLE.pack(MAGIC, len(body), payload_len) + body


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        _cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _refused(r, data: bytes) -> ProtocolError:
    box = []

    def feed():
        with pytest.raises(ProtocolError) as info:
            r.receive_data(data)
        box.append(info.value)

    assert _peak(feed) < 1 << 20
    assert r.state is ReceiverState.CLOSED
    return box[0]


def test_segment_before_begin_allocates_nothing():
    r, sink, ledger = receiver()
    err = _refused(r, _segment_header(0, DECLARED))
    assert err.category == "state" and sink.calls == [] and ledger.highest == {}


def test_declared_length_other_than_the_descriptor_allocates_nothing():
    _m, frames, _intents, payloads, _s = build_transfer()
    r, sink, _ledger = receiver()
    r.receive_data(frames[0])  # admitted (declared mode)
    assert r.admitted
    err = _refused(r, _segment_header(0, DECLARED))
    assert err.category == "digest" and "descriptor says" in err.message
    assert sink.calls[-1] == "abort"


def test_deferred_descriptor_off_schedule_allocates_nothing():
    _m, frames, _intents, _payloads, _s = build_transfer(deferred=True)
    r, sink, _ledger = receiver()
    r.receive_data(frames[0])
    header_len = struct.unpack_from("<I", frames[1], 8)[0]
    header = json.loads(frames[1][PREAMBLE.size : PREAMBLE.size + header_len])
    d = dict(header["descriptor"])
    count = DECLARED // (d["elements_per_token"] * 4)
    d.update(logical_count=count, byte_len=count * d["elements_per_token"] * 4)
    err = _refused(r, _segment_header(0, d["byte_len"], d))
    assert err.category in ("delta", "manifest") and sink.calls[-1] == "abort"


def test_wrong_sequence_allocates_nothing():
    _m, frames, _intents, _payloads, _s = build_transfer()
    r, _sink, _ledger = receiver()
    r.receive_data(frames[0])
    assert _refused(r, _segment_header(5, DECLARED)).category == "sequence"


@pytest.mark.parametrize("header_len,payload_len", [((1 << 32) - 1, 0), (64, 1 << 32), (64, (1 << 64) - 1)])
def test_preamble_lengths_beyond_the_limits_allocate_nothing(header_len, payload_len):
    r, _sink, _ledger = receiver()
    err = _refused(r, PREAMBLE.pack(MAGIC, header_len, payload_len))
    assert err.category == "framing"


def test_the_valid_transfer_still_commits():
    _m, frames, _intents, _payloads, _s = build_transfer(deferred=True)
    r, sink, _ledger = receiver()
    effects = r.receive_data(b"".join(frames))
    assert type(effects[-1]).__name__ == "Committed" and sink.calls[-1] == "commit"
