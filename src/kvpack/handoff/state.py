"""Sender and receiver state tables (h2 style: ``(state, input) -> new state``).

All protocol state of both roles lives here as data. The sender and receiver modules do
the checks an input needs and then ask this table for the next state; an input the table
does not list is a ``state`` refusal, and every refusal moves the machine to CLOSED. That
makes "valid state or typed error, then closed" a property of the table, which the
hypothesis tests drive with random (state, input) sequences.

It must never hold I/O or checks: transitions are data; an input the table does not list is a
refusal.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from ..errors import ProtocolError

#: A protocol state enum (sender or receiver): transition tables map into the same type.
S = TypeVar("S", bound=enum.Enum)


class SenderState(enum.Enum):
    IDLE = "idle"  # nothing sent
    STREAMING = "streaming"  # begin sent, segments flowing
    AWAIT_ACK = "await_ack"  # seal sent, exactly one ack expected
    DONE = "done"  # matching ack received: the receiver committed
    CLOSED = "closed"  # aborted or refused: terminal


class ReceiverState(enum.Enum):
    AWAIT_BEGIN = "await_begin"  # first frame must be a begin
    RECEIVING = "receiving"  # admitted; segments land in a detached generation
    DONE = "done"  # sealed, reserved, committed, ack emitted: final (errata H4)
    CLOSED = "closed"  # refused or aborted before commit: terminal, sink aborted


# Sender inputs: local verbs (begin/segment/seal/abort) and the one remote frame (ack).
SENDER_TRANSITIONS: dict[tuple[SenderState, str], SenderState] = {
    (SenderState.IDLE, "begin"): SenderState.STREAMING,
    (SenderState.STREAMING, "segment"): SenderState.STREAMING,
    (SenderState.STREAMING, "seal"): SenderState.AWAIT_ACK,
    (SenderState.AWAIT_ACK, "ack"): SenderState.DONE,
    (SenderState.IDLE, "abort"): SenderState.CLOSED,
    (SenderState.STREAMING, "abort"): SenderState.CLOSED,
    (SenderState.AWAIT_ACK, "abort"): SenderState.CLOSED,
}

# Receiver inputs: frames from the producer, and end of stream. A second begin, an ack from
# the producer, or anything before the begin but a begin, is absent and therefore refused.
# A producer abort is a listed input but leads to CLOSED with an "aborted" refusal.
RECEIVER_TRANSITIONS: dict[tuple[ReceiverState, str], ReceiverState] = {
    (ReceiverState.AWAIT_BEGIN, "begin"): ReceiverState.RECEIVING,
    (ReceiverState.RECEIVING, "segment"): ReceiverState.RECEIVING,
    (ReceiverState.RECEIVING, "seal"): ReceiverState.DONE,
    (ReceiverState.RECEIVING, "abort"): ReceiverState.CLOSED,
}

RECEIVER_INPUTS = ("begin", "segment", "seal", "ack", "abort", "eof")
SENDER_INPUTS = ("begin", "segment", "seal", "ack", "abort")


def transition(table: Mapping[tuple[S, str], S], state: S, event: str, *, remote: bool) -> S:
    """Next state for ``event`` in ``state``, or a ``state`` refusal."""
    try:
        return table[(state, event)]
    except KeyError:
        raise ProtocolError("state", f"{event} not allowed in state {state.value}", remote=remote) from None
