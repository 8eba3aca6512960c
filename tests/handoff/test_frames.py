"""KVPKV2 frame codec (C.2-C.3): layout, limits before allocation, split feeding."""

import struct
import tracemalloc

import pytest
from hypothesis import given, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff.events import Abort, Ack, Begin, Seal, Segment
from kvpack.handoff.frames import (
    MAGIC,
    FrameDecoder,
    FrameLimits,
    decode_all,
    encode_frame,
    frame_bytes,
)
from kvpack.handoff.manifest import SealCoreV2, SealManifestV2

from ._support import build_transfer, manifest


def _raw(header: bytes, payload: bytes = b"", plen=None) -> bytes:
    return struct.pack("<8sIQ", MAGIC, len(header), len(payload) if plen is None else plen) + header + payload


def test_preamble_layout():
    data = frame_bytes(Abort("producer failure"))
    assert data[:8] == b"KVPKV2\0\0"
    hlen, plen = struct.unpack("<IQ", data[8:20])
    assert plen == 0 and hlen == len(data) - 20
    assert data[20:] == b'{"kind":"abort","reason":"producer failure"}'


def test_segment_payload_by_reference():
    payload = bytearray(b"xyz")
    bufs = encode_frame(Segment(0, memoryview(payload)))
    assert len(bufs) == 2 and bufs[1].obj is payload  # the caller's buffer, not a copy


def test_roundtrip_all_frame_kinds():
    m = manifest((5, 6), deferred=True)
    core = SealCoreV2("t", 1, "1" * 64, "2" * 64, "3" * 64, 1, 2)
    frames = [
        Begin(m, 0),
        Begin(m, 256),
        Segment(3, memoryview(b"\x00\x01")),
        Seal(SealManifestV2(core, "4" * 64)),
        Ack("t", 1),
        Abort("producer failure"),
    ]
    data = b"".join(frame_bytes(f) for f in frames)
    assert decode_all(data) == frames


def test_header_key_order_is_free():
    # Rust sends kind first then declaration order: not canonical, still accepted.
    hdr = b'{"kind":"ack","transfer_id":"t","generation":7}'
    assert decode_all(_raw(hdr)) == [Ack("t", 7)]


@pytest.mark.parametrize(
    "data,match",
    [
        (b"KVPKV3\0\0" + bytes(12), "magic"),
        (_raw(b""), "header length"),
        (_raw(b'{"kind":"abort","reason":"x"}', b"p"), "carries a payload"),
        (_raw(b'{"kind":"segment","sequence":0}'), "empty segment"),
        (_raw(b'{"kind":"nope"}'), "unknown frame kind"),
        (_raw(b'{"kind":1}'), "kind"),
        (_raw(b"[1]"), "object"),
        (_raw(b'{"kind":"ack","transfer_id":"t","generation":1,"x":0}'), "unknown field"),
        (_raw(b'{"kind":"ack","transfer_id":"t","generation":1.0}'), "integer"),
        (
            _raw(
                b'{"kind":"segment","sequence":1,"descriptor":{"sequence":2,"component_id":"t","role":"swa_tile","layer":0,"logical_start":0,"logical_count":1,"element_type":"f16_le","elements_per_token":1,"byte_len":2,"sha256":"'
                + b"0" * 64
                + b'"}}',
                b"ab",
            ),
            "descriptor sequence",
        ),
    ],
)
def test_reader_refusals(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode_all(data)


def test_segment_null_descriptor_is_declared_form():
    (f,) = decode_all(_raw(b'{"kind":"segment","sequence":0,"descriptor":null}', b"ab"))
    assert f.descriptor is None and bytes(f.payload) == b"ab"


def test_truncation_named():
    data = frame_bytes(Segment(0, memoryview(b"abcdef")))
    for cut in range(1, len(data)):
        with pytest.raises(ProtocolError, match="truncated") as e:
            decode_all(data[:cut])
        assert e.value.category == "framing"
    with pytest.raises(ProtocolError, match="truncated segment payload"):
        decode_all(data[:-1])


def test_limits_checked_before_allocation():
    tracemalloc.start()
    try:
        for hlen, plen in ((8 * 1024 * 1024 + 1, 0), (10, 512 * 1024 * 1024 + 1), (2**32 - 1, 2**64 - 1)):
            dec = FrameDecoder()
            tracemalloc.reset_peak()
            with pytest.raises(ProtocolError, match="length"):
                dec.feed(struct.pack("<8sIQ", MAGIC, hlen, plen))
            assert tracemalloc.get_traced_memory()[1] < 64 * 1024
        # A control frame claiming a large payload: refused after its header, before the
        # payload buffer exists.
        dec = FrameDecoder()
        tracemalloc.reset_peak()
        with pytest.raises(ProtocolError, match="carries a payload"):
            dec.feed(_raw(b'{"kind":"abort","reason":"x"}', plen=500 * 1024 * 1024))
        assert tracemalloc.get_traced_memory()[1] < 64 * 1024
        # A malformed segment header with a large payload: refused before allocation too.
        dec = FrameDecoder()
        tracemalloc.reset_peak()
        with pytest.raises(ProtocolError):
            dec.feed(_raw(b'{"kind":"segment","sequence":-1}', plen=500 * 1024 * 1024))
        assert tracemalloc.get_traced_memory()[1] < 64 * 1024
    finally:
        tracemalloc.stop()


def test_wanted_never_exceeds_current_frame():
    _, frames, *_ = build_transfer(deferred=True)
    stream = b"".join(frames)
    dec = FrameDecoder()
    pos = 0
    out = []
    while pos < len(stream):
        want = dec.wanted()
        n = min(len(want), 7)
        want[:n] = stream[pos : pos + n]
        pos += n
        # Everything the decoder asked for so far lies within the frame being decoded.
        assert dec.buffered_bytes <= max(len(f) for f in frames)
        f = dec.advance(n)
        if f is not None:
            out.append(f)
    dec.eof()
    assert len(out) == len(frames) and dec.at_boundary


@given(st.data())
def test_any_split_gives_same_frames(data):
    _, frames, *_ = build_transfer(deferred=data.draw(st.booleans()))
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=30)))
    dec = FrameDecoder()
    got = []
    prev = 0
    for c in cuts + [len(stream)]:
        got.extend(dec.feed(stream[prev:c]))
        prev = c
    dec.eof()
    assert got == decode_all(stream)


def test_dead_after_error():
    dec = FrameDecoder()
    with pytest.raises(ProtocolError):
        dec.feed(b"X" * 20)
    with pytest.raises(ProtocolError):
        dec.feed(frame_bytes(Abort("x")))


def test_encoder_refuses_what_decoder_refuses():
    with pytest.raises(ProtocolError):
        encode_frame(Segment(0, memoryview(b"")))
    with pytest.raises(ProtocolError):
        encode_frame(Segment(0, memoryview(b"abc")), FrameLimits(max_payload=2))
    with pytest.raises(ProtocolError):
        encode_frame(Abort("x" * 100), FrameLimits(max_header=50))


def test_reused_payload_buffers_alternate_and_a_view_outlives_the_next_segment():
    """``payload_buffers=2``: a segment's payload view is untouched while the next segment
    is decoded (a sink may still be writing from it), and its buffer serves the one after."""
    payloads = [bytes([i + 1]) * (1002 - i) for i in range(3)]
    stream = b"".join(frame_bytes(Segment(i, memoryview(p))) for i, p in enumerate(payloads))
    dec = FrameDecoder(reuse_payload_buffer=True, payload_buffers=2)
    views = []
    for frame in dec.feed(stream[: len(stream) * 2 // 3 + 50]):  # the first two frames, and part of the third
        views.append(frame.payload)
    assert [bytes(v) for v in views] == payloads[:2]  # the first survived the second
    views += [f.payload for f in dec.feed(stream[len(stream) * 2 // 3 + 50 :])]
    assert bytes(views[2]) == payloads[2] and views[2].obj is views[0].obj  # buffers taken in turn
    assert dec.buffered_bytes >= 1002
    with pytest.raises(ValueError):
        FrameDecoder(reuse_payload_buffer=True, payload_buffers=0)


def test_payload_buffers_of_an_earlier_stream_are_reused_and_released():
    kept = bytearray(4096)
    dec = FrameDecoder(reuse_payload_buffer=True, reuse_buffers=[kept])
    (frame,) = dec.feed(frame_bytes(Segment(0, memoryview(b"a" * 1000))))
    assert frame.payload.obj is kept and bytes(frame.payload) == b"a" * 1000
    assert dec.release_payload_buffers() == [kept]
    (frame,) = dec.feed(frame_bytes(Segment(1, memoryview(b"b" * 10))))
    assert frame.payload.obj is not kept  # released: the decoder no longer writes into it
    small = FrameDecoder(reuse_payload_buffer=True, reuse_buffers=[bytearray(8)])
    (frame,) = small.feed(frame_bytes(Segment(0, memoryview(b"c" * 100))))
    assert bytes(frame.payload) == b"c" * 100  # too small a kept buffer is replaced
