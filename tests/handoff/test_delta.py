"""C.11 prefix-cut rules, the schedule witness and the reuse-ladder classifier."""

import dataclasses

import pytest

from kvpack.errors import ProtocolError
from kvpack.handoff.delta import (
    ReuseAction,
    ScheduleWitness,
    classify_reuse,
    lift_prefix_cut,
    validate_prefix_cut,
)
from kvpack.handoff.schedule import MUSE, muse_schedule_span
from kvpack.handoff.sender import declare_segments

from ._support import manifest, payloads_for


@pytest.mark.parametrize("raw,cut", [({}, 0), ({"prefix_cut": 0}, 0), ({"prefix_cut": 256}, 256), ({"prefix_cut": 2**64 - 1}, 2**64 - 1)])
def test_lift_accepts_unsigned(raw, cut):
    assert lift_prefix_cut(raw) == cut


@pytest.mark.parametrize("value", [None, "256", 256.0, -256, True, False, 2**64, [256]])
def test_lift_refuses(value):
    with pytest.raises(ProtocolError) as e:
        lift_prefix_cut({"prefix_cut": value})
    assert e.value.category == "delta"


PROMPT = tuple(range(1000, 1300))  # position 300


def test_validate_prefix_cut_ok_and_noop():
    m = manifest(PROMPT, deferred=True)
    validate_prefix_cut(m, 0, None, MUSE)
    validate_prefix_cut(m, 256, PROMPT[:256], MUSE)
    validate_prefix_cut(m, 256, PROMPT, MUSE)  # holding more than the cut is fine


@pytest.mark.parametrize(
    "cut,held,why",
    [
        (128, PROMPT, "aligned"),
        (512, PROMPT, "inside"),
        (256, None, "does not hold"),
        (256, PROMPT[:255], "does not hold"),
        (256, PROMPT[:255] + (7,), "does not hold"),
        (256, (9,) + PROMPT[1:256], "does not hold"),
    ],
)
def test_validate_prefix_cut_refusals(cut, held, why):
    m = manifest(PROMPT, deferred=True)
    with pytest.raises(ProtocolError, match=why) as e:
        validate_prefix_cut(m, cut, held, MUSE)
    assert e.value.category == "delta"


def test_declared_segments_must_equal_schedule():
    intents = muse_schedule_span(300, 256)
    segs = declare_segments(intents, payloads_for(intents))
    validate_prefix_cut(manifest(PROMPT, segments=segs), 256, PROMPT, MUSE)
    # A declared schedule for the full span is not the schedule of the cut.
    full = muse_schedule_span(300, 0)
    bad = declare_segments(full, payloads_for(full))
    with pytest.raises(ProtocolError, match="differ"):
        validate_prefix_cut(manifest(PROMPT, segments=bad), 256, PROMPT, MUSE)
    # One field off (layer of the second SWA group head).
    shifted = list(segs)
    shifted[1] = dataclasses.replace(shifted[1], layer=18)
    with pytest.raises(ProtocolError, match="differs"):
        validate_prefix_cut(manifest(PROMPT, segments=shifted), 256, PROMPT, MUSE)


def test_witness_fail_fast_and_completeness():
    intents = muse_schedule_span(300, 256)
    descs = declare_segments(intents, payloads_for(intents))
    w = ScheduleWitness(intents, "target")
    for d in descs[:-1]:
        w.observe(d)
    with pytest.raises(ProtocolError, match="incomplete"):
        w.finish()
    w.observe(descs[-1])
    w.finish()
    with pytest.raises(ProtocolError, match="beyond"):
        w.observe(descs[0])
    w2 = ScheduleWitness(intents, "target")
    with pytest.raises(ProtocolError, match="differs"):
        w2.observe(dataclasses.replace(descs[0], logical_start=0))
    # Other components are not the witness's business.
    ScheduleWitness(intents, "target").observe(dataclasses.replace(descs[0], component_id="dflash", logical_start=0))


@pytest.mark.parametrize(
    "matched,prompt,tier,action",
    [
        (2047, 2048, "resident", ReuseAction.SERVE_LOCAL),
        (2048, 2048, "live", ReuseAction.SERVE_LOCAL),
        (1024, 2048, "resident", ReuseAction.ARM_DELTA),
        (1024, 2048, "durable", ReuseAction.ARM_DELTA),
        (32768, 65536, "remote", ReuseAction.ARM_DELTA),
        (1024, 2048, "live", ReuseAction.FULL_TRANSFER),  # live continuation: not armed
        (1000, 2048, "resident", ReuseAction.FULL_TRANSFER),  # unaligned partial
        (0, 2048, "resident", ReuseAction.FULL_TRANSFER),
        (1, 1, "resident", ReuseAction.FULL_TRANSFER),  # prompt < 2
        (256, 258, "resident", ReuseAction.ARM_DELTA),
        (256, 257, "resident", ReuseAction.SERVE_LOCAL),
    ],
)
def test_classify_reuse(matched, prompt, tier, action):
    assert classify_reuse(matched, prompt, tier) is action


def test_classify_reuse_exhaustive_small():
    for prompt in range(0, 700):
        for matched in range(0, prompt + 2):
            a = classify_reuse(matched, prompt, "durable")
            if prompt >= 2 and matched >= prompt - 1:
                assert a is ReuseAction.SERVE_LOCAL
            elif a is ReuseAction.ARM_DELTA:
                # An armed cut is always a valid prefix_cut for position = prompt - 1.
                assert matched % 256 == 0 and 0 < matched < prompt - 1
                muse_schedule_span(prompt - 1, matched)
    with pytest.raises(ValueError):
        classify_reuse(1, 2, "elsewhere")
