"""Delta handoff rules (INTEROP C.11, errata L1/M3, seed §26.2-26.4).

A delta handoff ships only ``[cut, position)`` (plus a freshly re-derived window for
windowed layers) onto a receiving session that already holds ``cut`` tokens. Four pieces:

* :func:`lift_prefix_cut` -- ``prefix_cut`` travels as raw JSON next to the typed begin
  manifest (which drops it, so it is never hashed); only an unsigned integer is accepted,
  absent means 0, ``null`` is refused.
* :func:`validate_prefix_cut` -- the admission proof: aligned, inside the prompt, the
  session holds exactly those tokens, and in declared mode the declared target segments
  equal the span schedule.
* :class:`ScheduleWitness` -- for deferred mode (and, per errata M3, every mode): the
  observed target segments, compared one by one against the schedule as they arrive and
  for completeness at prepare.
* :func:`classify_reuse` -- the reuse-ladder classifier that *proposes* a delta before any
  of the above runs (``ServeLocal`` / ``ArmDelta`` / ``FullTransfer``).

Arming is a proposal and admission is the proof: a wrong guess upstream costs a full
transfer, never a wrong answer.
"""

from __future__ import annotations

import enum
from typing import Any, Optional, Sequence

from ..errors import ProtocolError
from . import canonical_json as cj
from .manifest import BeginManifestV2, SegmentDescriptorV2
from ..vocab import is_token_aligned
from .schedule import PREFIX_CUT_ALIGN, SegmentKey, SpanLayout, SpanSegment, check_cut, schedule_span


def lift_prefix_cut(raw_manifest: Any) -> int:
    """``prefix_cut`` from the raw begin manifest object: absent -> 0, else a u64.

    Strings, floats, negatives, booleans and ``null`` are refused (C.3, errata L1).
    """
    if not isinstance(raw_manifest, dict) or "prefix_cut" not in raw_manifest:
        return 0
    value = raw_manifest["prefix_cut"]
    if type(value) is not int or value < 0 or value > cj.U64_MAX:
        raise ProtocolError("delta", "prefix_cut is not an unsigned integer")
    return value


def validate_prefix_cut(
    manifest: BeginManifestV2,
    cut: int,
    held_token_ids: Optional[Sequence[int]],
    layout: Optional[SpanLayout],
) -> None:
    """``identity.rs::validate_prefix_cut`` for ``cut != 0`` (a no-op for 0).

    ``held_token_ids`` are the tokens the receiving session holds; ``None`` means the
    receiver holds nothing, so every nonzero cut is refused.
    """
    if cut == 0:
        return
    position = manifest.position
    if not is_token_aligned(cut) or cut >= position:
        raise ProtocolError("delta", "delta prefix cut is not a 256-aligned cut inside the prompt")
    if held_token_ids is None or len(held_token_ids) < cut:
        raise ProtocolError("delta", "delta prefix cut names a prefix the receiving session does not hold")
    held = tuple(held_token_ids[:cut])
    if held != manifest.prompt_token_ids[:cut]:
        raise ProtocolError("delta", "delta prefix cut names a prefix the receiving session does not hold")
    if layout is not None:
        check_cut(layout, position, cut)
        if not manifest.deferred_segments:
            check_declared_schedule(manifest, layout, cut)


def check_declared_schedule(manifest: BeginManifestV2, layout: SpanLayout, cut: int) -> None:
    """Declared mode: the target segments, in order, equal the schedule (7 fields; byte_len
    and sha are not compared because the schedule has none)."""
    expected = schedule_span(layout, manifest.position, cut)
    target = [d for d in manifest.segments if d.component_id == layout.component_id]
    shapes = layout_shapes(layout)
    foreign = [d for d in target if descriptor_shape(d) not in shapes]
    if foreign:
        d = foreign[0]
        raise ProtocolError(
            "layout", f"declared segment {d.sequence} {descriptor_shape(d)} differs from every segment shape of this cache layout {sorted(shapes, key=str)}"
        )
    if len(target) != len(expected):
        raise ProtocolError("delta", f"declared target segments ({len(target)}) differ from the span schedule ({len(expected)})")
    for d, e in zip(target, expected):
        if d.sequence != e.sequence or descriptor_key(d) != e.key():
            raise ProtocolError("delta", f"declared segment {d.sequence} differs from the span schedule")


def descriptor_key(d: SegmentDescriptorV2) -> SegmentKey:
    return (d.role, d.layer, d.logical_start, d.logical_count, d.element_type, d.elements_per_token)


SegmentShape = tuple[str, Optional[int], str, int]
"""(role, layer label, element_type, elements_per_token): which planes a segment packs and
in what dtype -- the cache layout's part of a segment, without its rows."""


def descriptor_shape(d: SegmentDescriptorV2) -> SegmentShape:
    return (d.role, d.layer, d.element_type, d.elements_per_token)


def segment_shape(e: SpanSegment) -> SegmentShape:
    return (e.role, e.layer, e.element_type, e.elements_per_token)


def layout_shapes(layout: SpanLayout) -> frozenset[SegmentShape]:
    """Every segment shape ``layout`` can schedule, whatever the position, cut or stripe."""
    return frozenset(
        (c.role, g[0] if c.label_group_head else None, layout.element_type, layout.elements_per_token(g)) for c in layout.classes for g in c.groups()
    )


class ScheduleWitness:
    """Observed target segments versus the expected span schedule (the delta witness).

    ``observe`` refuses the first segment that deviates (fail fast, before it is written to
    the sink); ``finish`` refuses an incomplete stream at prepare (errata M3: the seal only
    authenticates what was sent, so completeness must be checked separately).

    A segment whose *shape* (role, layer label, element type, elements per token) is not
    one of the schedule's is a different cache layout or dtype: category ``layout``. One of
    a known shape at the wrong rows, or in the wrong order, breaks the span rules: ``delta``.
    """

    def __init__(self, expected: Sequence[SpanSegment], component_id: str, shapes: Optional[frozenset[SegmentShape]] = None) -> None:
        self.expected = tuple(expected)
        self.component_id = component_id
        #: the layout's shapes (:func:`layout_shapes`); a stripe's share may not show them all
        self.shapes = shapes if shapes is not None else frozenset(segment_shape(e) for e in self.expected)
        self.observed: list[SegmentKey] = []

    def peek(self, d: SegmentDescriptorV2) -> None:
        """Refuse ``d`` if :meth:`observe` would, without recording it (the receiver checks a
        segment header before it reads, or allocates, the payload)."""
        self._check(d)

    def observe(self, d: SegmentDescriptorV2) -> None:
        if self._check(d):
            self.observed.append(descriptor_key(d))

    def _check(self, d: SegmentDescriptorV2) -> bool:
        if d.component_id != self.component_id:
            return False
        k = len(self.observed)
        if descriptor_shape(d) not in self.shapes:
            raise ProtocolError(
                "layout",
                f"segment {d.sequence}: {descriptor_shape(d)} differs from every segment shape of this cache layout {sorted(self.shapes, key=str)}",
            )
        if k >= len(self.expected):
            raise ProtocolError("delta", f"segment {d.sequence}: target segment beyond the span schedule")
        if descriptor_key(d) != self.expected[k].key():
            raise ProtocolError(
                "delta",
                f"segment {d.sequence}: {descriptor_key(d)} differs from scheduled {self.expected[k].key()}",
            )
        return True

    def finish(self) -> None:
        if len(self.observed) != len(self.expected):
            raise ProtocolError("delta", f"target incomplete: {len(self.observed)} of {len(self.expected)} scheduled segments")


# --- reuse ladder ----------------------------------------------------------------------


class ReuseAction(enum.Enum):
    """What the reuse ladder can do for a prompt a remote producer would otherwise prefill."""

    SERVE_LOCAL = "serve_local"  # held prefix reaches prompt-1: skip the transfer
    ARM_DELTA = "arm_delta"  # aligned strict prefix from a fetched tier: ship [cut, position)
    FULL_TRANSFER = "full_transfer"  # nothing the handoff can build on


#: Tiers a held prefix can come from. Only *fetched* tiers arm a delta: a live-session
#: continuation prefills its own suffix locally for less than a handoff costs (seed §26.4).
FETCHED_TIERS = frozenset({"resident", "durable", "remote"})
TIERS = FETCHED_TIERS | {"live"}


def classify_reuse(matched: int, prompt: int, tier: str, cut_align: int = PREFIX_CUT_ALIGN) -> ReuseAction:
    """``reuse.rs::remote_action`` plus the fetched-tier filter of ``arm_remote_delta``.

    ``matched`` tokens of a ``prompt``-token request are held in ``tier``.
    """
    if tier not in TIERS:
        raise ValueError(f"unknown reuse tier {tier!r}")
    if matched < 0 or prompt < 0:
        raise ValueError("negative token count")
    if prompt < 2:
        return ReuseAction.FULL_TRANSFER
    if matched >= prompt - 1:
        return ReuseAction.SERVE_LOCAL
    if (
        tier in FETCHED_TIERS and matched > 0 and cut_align > 0 and matched % cut_align == 0 and matched + 1 < prompt  # a nonempty transferable suffix
    ):
        return ReuseAction.ARM_DELTA
    return ReuseAction.FULL_TRANSFER
