"""Hypothesis drives both state machines with random (state, input) sequences: after every
input the machine is in a valid state, or it raised a typed ProtocolError and is CLOSED
(and stays closed). The receiver commits only for the one valid sequence."""

import pytest
from hypothesis import example, given, settings, strategies as st

from kvpack.errors import ProtocolError
from kvpack.handoff.events import Abort, Ack
from kvpack.handoff.frames import decode_all
from kvpack.handoff.manifest import SealManifestV2
from kvpack.handoff.sender import Sender
from kvpack.handoff.state import (
    RECEIVER_TRANSITIONS,
    SENDER_TRANSITIONS,
    ReceiverState,
    SenderState,
    transition,
)

from ._support import KEY, build_transfer, receiver

_M, _FRAMES, _INTENTS, _PAYLOADS, _S = build_transfer(deferred=True)
_DECODED = decode_all(b"".join(_FRAMES))
_BAD_SEAL = type(_DECODED[-1])(SealManifestV2(_DECODED[-1].manifest.core, "0" * 64))
# The input alphabet: every real frame, plus hostile ones.
RECEIVER_INPUTS = (
    [("frame", f) for f in _DECODED]
    + [("frame", _BAD_SEAL), ("frame", Ack(_M.transfer_id, 1)), ("frame", Abort("producer failure"))]
    + [("eof", None), ("bytes", b"\x00" * 5), ("abort", None)]
)
VALID_STATES = set(ReceiverState)


def _apply(r, item):
    kind, value = item
    if kind == "frame":
        return r.receive_frame(value)
    if kind == "bytes":
        return r.receive_data(value)
    if kind == "eof":
        return r.eof()
    return r.abort("local")


@settings(max_examples=400, deadline=None)  # too_slow: off in the suite profile (tests/conftest.py)
@given(st.lists(st.sampled_from(range(len(RECEIVER_INPUTS))), max_size=16))
@example(list(range(len(_DECODED))))
@example(list(range(len(_DECODED))) + [len(_DECODED) + 2, len(_DECODED) + 3])
@example(list(range(len(_DECODED) - 1)) + [len(_DECODED)])
def test_receiver_random_sequences(indices):
    r, sink, ledger = receiver()
    closed_by = None
    for i in indices:
        before = r.state
        try:
            _apply(r, RECEIVER_INPUTS[i])
        except ProtocolError as exc:
            assert r.state is ReceiverState.CLOSED
            if closed_by is None:
                closed_by = exc
            else:
                assert exc.category == "state"  # once closed, every input is refused
            continue
        assert r.state in VALID_STATES
        if before is ReceiverState.CLOSED:
            # Only a local abort is silently accepted on a closed machine.
            assert RECEIVER_INPUTS[i][0] == "abort"
    committed = "commit" in sink.calls
    # Commit happens only when the exact valid prefix was delivered in order.
    valid = list(range(len(_DECODED)))
    assert committed == (indices[: len(valid)] == valid)
    if committed:
        assert r.state is ReceiverState.DONE and "abort" not in sink.calls
    elif "begin" in sink.calls and r.state is ReceiverState.CLOSED:
        assert sink.calls.count("abort") == 1


SENDER_VERBS = ("begin", "segment", "seal", "ack_good", "ack_bad", "abort", "bytes_garbage")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(SENDER_VERBS), max_size=20))
def test_sender_random_sequences(verbs):
    s = Sender(_M, KEY)
    k = 0
    ever_closed = False
    for verb in verbs:
        try:
            if verb == "begin":
                s.begin()
            elif verb == "segment":
                i = min(k, len(_INTENTS) - 1)
                s.send_segment(_PAYLOADS[i], _INTENTS[i])
                k += 1
            elif verb == "seal":
                s.seal()
            elif verb == "ack_good":
                s.receive_frame(Ack(_M.transfer_id, _M.generation))
            elif verb == "ack_bad":
                s.receive_frame(Ack(_M.transfer_id, _M.generation + 1))
            elif verb == "abort":
                out = s.abort()
                assert s.state in (SenderState.CLOSED, SenderState.DONE)
                if out:
                    assert decode_all(b"".join(bytes(b) for b in out)) == [Abort("producer failure")]
            else:
                s.receive_data(b"KVPKV2\0\0" + b"\xff" * 12)
        except ProtocolError:
            assert s.state is SenderState.CLOSED
            ever_closed = True
        assert s.state in set(SenderState)
        if ever_closed:
            assert s.state is SenderState.CLOSED


def test_tables_only_name_real_states_and_refuse_the_rest():
    for table, states, inputs in (
        (RECEIVER_TRANSITIONS, ReceiverState, ("begin", "segment", "seal", "ack", "abort", "eof")),
        (SENDER_TRANSITIONS, SenderState, ("begin", "segment", "seal", "ack", "abort")),
    ):
        for state in states:
            for event in inputs:
                if (state, event) in table:
                    assert table[(state, event)] in set(states)
                else:
                    with pytest.raises(ProtocolError) as e:
                        transition(table, state, event, remote=True)
                    assert e.value.category == "state"
        # Terminal states accept nothing.
        assert not [k for k in table if k[0].value in ("done", "closed")]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_roundtrip_sender_receiver_any_position(data):
    """Sender -> bytes -> receiver for random geometry, mode and cut: always commits the
    exact payload bytes, and the sender accepts the receiver's ack."""
    position = data.draw(st.integers(1, 80))
    deferred = data.draw(st.booleans())
    m, frames, intents, payloads, s = build_transfer(position=position, deferred=deferred, seed=position)
    r, sink, _ = receiver()
    effects = r.receive_data(b"".join(frames))
    assert sink.live == b"".join(payloads)
    assert s.receive_data(effects[-1].ack).generation == m.generation
