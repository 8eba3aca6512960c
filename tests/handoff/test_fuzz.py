"""Frame-decoder fuzzing (C.2): arbitrary and mutated byte streams, fed in random splits,
only ever produce frames or a typed ProtocolError, and never make the decoder hold more
than one frame's limits. >= 100,000 inputs in the ``fuzz`` run, deterministic seeds."""

import random
import struct

import pytest
from hypothesis import given, settings, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff.control import ControlDecoder, ControlRequestV1
from kvpack.handoff.events import Abort, Ack
from kvpack.handoff.frames import MAGIC, FrameDecoder, FrameLimits, frame_bytes

from ._support import build_transfer, receiver

LIMITS = FrameLimits(max_header=8192, max_payload=4096)


def _corpus() -> list[bytes]:
    out = []
    for deferred in (False, True):
        for position in (1, 9, 20):
            m, frames, *_ = build_transfer(position=position, deferred=deferred, seed=position)
            out.append(b"".join(frames))
            out.extend(frames)
    out.append(frame_bytes(Ack("muser-1-0-1", 1)) + frame_bytes(Abort("producer failure")))
    return out


CORPUS = _corpus()
BOUNDARY_U32 = [0, 1, 2, 19, 20, 4095, 4096, 4097, 8191, 8192, 8193, 2**31, 2**32 - 1]
BOUNDARY_U64 = BOUNDARY_U32 + [2**63, 2**64 - 1]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and b:  # flip
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # overwrite with a random byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2 and b:  # truncate
            del b[rng.randrange(len(b)) :]
        elif op == 3:  # insert junk
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 4 and len(b) > 1:  # delete a run
            i = rng.randrange(len(b))
            del b[i : i + rng.randint(1, 16)]
        elif op == 5 and len(b) >= 20:  # lie in the preamble lengths
            struct.pack_into("<IQ", b, 8, rng.choice(BOUNDARY_U32), rng.choice(BOUNDARY_U64))
        elif op == 6:  # splice another corpus entry
            other = rng.choice(CORPUS)
            i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
            b = b[:i] + other[j:]
        else:  # pure noise behind a valid magic
            b = bytearray(MAGIC + rng.randbytes(rng.randint(0, 64)))
    return bytes(b)


def _decode_in_splits(rng: random.Random, data: bytes) -> int:
    dec = FrameDecoder(LIMITS)
    frames = 0
    pos = 0
    try:
        while pos < len(data):
            n = rng.choice((1, 3, 20, 64, 1024, len(data)))
            frames += len(dec.feed(data[pos : pos + n]))
            pos += n
            # Never holds more than the current frame, itself bounded by the limits.
            assert dec.buffered_bytes <= max(LIMITS.max_header, LIMITS.max_payload)
        dec.eof()
    except ProtocolError as exc:
        assert exc.category in ProtocolError.CATEGORIES
    return frames


@pytest.mark.fuzz
def test_frame_decoder_fuzz_100k():
    rng = random.Random(0x4B56504B)
    inputs = 0
    decoded = 0
    for _ in range(100_000):
        base = rng.choice(CORPUS)
        data = _mutate(rng, base) if rng.random() < 0.9 else rng.randbytes(rng.randint(0, 200))
        decoded += _decode_in_splits(rng, data)
        inputs += 1
    assert inputs >= 100_000
    assert decoded > 5_000  # many mutations leave leading frames valid: the parse goes deep


@pytest.mark.fuzz
def test_receiver_fuzz():
    """Mutated streams through the whole receiver: refused with a typed error, or (only if
    the mutation left the stream intact) committed."""
    rng = random.Random(7)
    full = [c for c in CORPUS if c.count(MAGIC) > 3]
    for _ in range(10_000):
        base = rng.choice(full)
        data = _mutate(rng, base)
        r, sink, _ = receiver()
        try:
            r.receive_data(data)
            r.eof()
        except ProtocolError:
            assert "commit" not in sink.calls or sink.calls[-1] == "commit"
            continue
        assert data.startswith(base) and "commit" in sink.calls


@pytest.mark.fuzz
def test_control_decoder_fuzz():
    rng = random.Random(11)
    good = ControlRequestV1("r", 2, (1, 2), "h", 1).encode()
    for _ in range(20_000):
        data = _mutate(rng, good)
        dec = ControlDecoder(max_len=4096)
        try:
            dec.feed(data)
            dec.eof()
        except ProtocolError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(1, 50), max_size=10))
def test_decoder_arbitrary_bytes(data, splits):
    dec = FrameDecoder(LIMITS)
    try:
        pos = 0
        for n in splits + [len(data)]:
            dec.feed(data[pos : pos + n])
            pos += n
        dec.eof()
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_decoder_after_valid_magic(tail):
    try:
        FrameDecoder(LIMITS).feed(MAGIC + tail)
    except ProtocolError:
        pass
