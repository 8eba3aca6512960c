"""A stripe of a striped handoff (kvpack extension): the receiver expects exactly the
schedule's ``[index::count]`` share, in order, deferred mode only; another share, a missing
segment or a declared-mode stripe is refused, and nothing is committed."""

from __future__ import annotations

import pytest

from kvpack.errors import ProtocolError
from kvpack.handoff.receiver import Committed, Receiver, ReceiverConfig
from kvpack.handoff.schedule import schedule_span
from kvpack.handoff.sender import Sender, declare_segments

from ._support import KEY, KEY_ID, NOW, TINY, MemoryLedger, RecordingSink, manifest, payloads_for

POSITION = 40


def _stripe_stream(index: int, count: int, *, drop_last=False, deferred=True) -> bytes:
    intents = schedule_span(TINY, POSITION, 0)[index::count]
    payloads = payloads_for(intents, seed=index + 1)
    if drop_last:
        intents, payloads = intents[:-1], payloads[:-1]
    prompt = tuple(range(100, 100 + POSITION))
    if deferred:
        m = manifest(prompt, deferred=True, generation=index + 1, transfer_id=f"muser-1-2-{index + 1}-s{index}.{count}")
    else:
        m = manifest(prompt, segments=declare_segments(intents, payloads), generation=index + 1)
    s = Sender(m, KEY)
    out = b"".join(bytes(b) for b in s.begin())
    for intent, p in zip(intents, payloads):
        out += b"".join(bytes(b) for b in s.send_segment(p, intent if deferred else None))
    return out + b"".join(bytes(b) for b in s.seal())


def _run(stream: bytes, stripe):
    sink = RecordingSink()
    r = Receiver(ReceiverConfig(KEY, KEY_ID, 1, layout=TINY, stripe=stripe), sink, MemoryLedger(), now_unix_ms=NOW)
    try:
        effects = r.receive_data(stream)
    except ProtocolError as exc:
        return exc, sink
    return effects, sink


@pytest.mark.parametrize("count", [2, 3, 5])
def test_each_share_commits_as_its_own_transfer(count):
    n = len(schedule_span(TINY, POSITION, 0))
    for index in range(min(count, n)):
        effects, sink = _run(_stripe_stream(index, count), (index, count))
        assert isinstance(effects[-1], Committed), effects
        assert sink.calls[-1] == "commit"


def test_another_share_is_refused_before_anything_is_committed():
    err, sink = _run(_stripe_stream(1, 3), (0, 3))
    assert isinstance(err, ProtocolError) and err.category == "delta"
    assert "commit" not in sink.calls


def test_a_share_missing_its_last_segment_is_refused_at_the_seal():
    err, sink = _run(_stripe_stream(0, 2, drop_last=True), (0, 2))
    assert isinstance(err, ProtocolError) and err.category == "delta" and "incomplete" in err.message
    assert "commit" not in sink.calls and sink.calls[-1] == "abort"


def test_a_declared_mode_stripe_is_refused():
    err, sink = _run(_stripe_stream(0, 2, deferred=False), (0, 2))
    assert isinstance(err, ProtocolError) and err.category == "manifest"
    assert sink.calls == []


def test_a_whole_transfer_is_refused_as_a_stripe():
    err, _sink = _run(_stripe_stream(0, 1), (0, 2))
    assert isinstance(err, ProtocolError) and err.category == "delta"
