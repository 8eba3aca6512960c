"""The span schedule (INTEROP C.12-C.13, errata M3/L6): which rows ship, in which segments.

A layout is a list of *span classes*. Each class is a set of layers that share a rule:

* a **full-span** class (``window=None``; Muse's NoPE layers, or every layer of a plain
  full-attention model) ships rows ``[cut, position)``;
* a **windowed** class (Muse's sliding-window RoPE layers) ships rows
  ``[max(cut, position - window), position)``: a delta re-derives the whole window when the
  suffix outruns it, because RoPE rows are bound to their absolute position (seed §26.3).

Rows are cut on one tile grid anchored at ``cut`` (``tile_tokens`` rows per tile), and each
class's layers are packed ``group_size`` layers per segment (K plane then V plane per layer,
C.13). Classes are emitted in layout order, and inside a class group by group (layer-major),
so that with the Muse preset (windowed SWA groups first, then NoPE tiles) the output is the
upstream ``muse_schedule_span`` sequence exactly: every SWA group is sendable as soon as
its layers exist mid-prefill, and only the NoPE tiles trail (seed §30.9).

``position`` is the number of rows shipped: the prompt length minus the boundary token the
receiver holds back and decodes itself. The schedule is derived, never negotiated: both
sides compute it and the receiver compares (see :mod:`delta`).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, Optional

from ..errors import ProtocolError
from ..vocab import TOKEN_ALIGN
from .manifest import ELEMENT_SIZES

#: Upstream's name for the delta-cut alignment; it is kvpack's one token alignment.
PREFIX_CUT_ALIGN = TOKEN_ALIGN


@dataclass(frozen=True)
class SpanClass:
    """A set of layers sharing one span rule (see module docstring)."""

    name: str
    role: str
    layers: tuple[int, ...]
    window: Optional[int]  # None: full span
    group_size: int
    #: Whether segments name their group's first layer (Muse SWA) or carry ``layer: null``
    #: (Muse NoPE tiles, which always pack every NoPE layer).
    label_group_head: bool

    def groups(self) -> list[tuple[int, ...]]:
        return [self.layers[i : i + self.group_size] for i in range(0, len(self.layers), self.group_size)]


@dataclass(frozen=True)
class SpanLayout:
    """A model's wire layout: its span classes in wire order plus plane geometry."""

    name: str
    classes: tuple[SpanClass, ...]
    tile_tokens: int = 512
    cut_align: int = PREFIX_CUT_ALIGN
    element_type: str = "f16_le"
    plane_elements: int = 256  # kv_heads * head_dim per layer per plane
    planes_per_layer: int = 2  # K and V
    component_id: str = "target"

    def elements_per_token(self, group: tuple[int, ...]) -> int:
        return self.plane_elements * self.planes_per_layer * len(group)


SegmentKey = tuple[str, Optional[int], int, int, str, int]
"""(role, layer, logical_start, logical_count, element_type, elements_per_token): what a
receiver compares between a descriptor and the schedule (errata M3)."""


@dataclass(frozen=True)
class SpanSegment:
    """One scheduled segment: a descriptor without its digest and byte length."""

    sequence: int
    component_id: str
    role: str
    layer: Optional[int]
    logical_start: int
    logical_count: int
    element_type: str
    elements_per_token: int
    span_class: str = ""

    @property
    def byte_len(self) -> int:
        return self.logical_count * self.elements_per_token * ELEMENT_SIZES[self.element_type]

    def key(self) -> SegmentKey:
        """The fields a receiver compares against the schedule (errata M3)."""
        return (self.role, self.layer, self.logical_start, self.logical_count, self.element_type, self.elements_per_token)

    def to_json(self) -> dict[str, Any]:
        return {
            "sequence": self.sequence,
            "component_id": self.component_id,
            "role": self.role,
            "layer": self.layer,
            "logical_start": self.logical_start,
            "logical_count": self.logical_count,
            "element_type": self.element_type,
            "elements_per_token": self.elements_per_token,
            "byte_len": self.byte_len,
            "class": self.span_class,
        }


def check_cut(layout: SpanLayout, position: int, cut: int) -> None:
    """The schedule exists only for ``position > 0`` and an aligned ``cut < position``."""
    if position <= 0:
        raise ProtocolError("manifest", "empty prompt has no span schedule")
    if cut < 0 or cut % layout.cut_align != 0 or cut >= position:
        raise ProtocolError("delta", f"prefix cut {cut} is not a {layout.cut_align}-aligned cut inside the prompt ({position})")


def schedule_span(layout: SpanLayout, position: int, cut: int = 0) -> tuple[SpanSegment, ...]:
    """The ordered target segments for ``[cut, position)`` (``muse_schedule_span``)."""
    check_cut(layout, position, cut)
    step = layout.tile_tokens
    tiles = [(s, min(step, position - s)) for s in range(cut, position, step)]
    out: list[SpanSegment] = []
    for cls in layout.classes:
        start = cut if cls.window is None else max(cut, position - cls.window, 0)
        for group in cls.groups():
            ept = layout.elements_per_token(group)
            layer = group[0] if cls.label_group_head else None
            for s, n in tiles:
                if s + n <= start:
                    continue
                cs = max(s, start)
                out.append(SpanSegment(len(out), layout.component_id, cls.role, layer, cs, s + n - cs, layout.element_type, ept, cls.name))
    return tuple(out)


def first_tile_complete_after_tokens(layout: SpanLayout, position: int, cut: int = 0) -> int:
    """How many prompt rows must exist before the first full-span tile can ship."""
    return min(cut + layout.tile_tokens, position)


def dflash_schedule(
    position: int,
    layers: int,
    sink: int,
    window: int,
    width: int,
    *,
    component_id: str = "dflash",
    first_sequence: int = 0,
) -> tuple[SpanSegment, ...]:
    """The optional DFlash draft-context segments, appended after the target (C.12).

    A draft layer keeps its attention sink ``[0, sink)`` and its recent window; when the
    prompt fits in ``sink + window`` the whole prompt is one range.
    """
    if position <= 0:
        raise ProtocolError("manifest", "empty prompt has no DFlash schedule")
    if position <= sink + window:
        ranges = [(0, position)]
    else:
        ranges = [(0, sink), (position - window, window)]
    out: list[SpanSegment] = []
    for layer in range(layers):
        for role in ("dflash_key", "dflash_value"):
            for s, n in ranges:
                out.append(SpanSegment(first_sequence + len(out), component_id, role, layer, s, n, "f32_le", width, "dflash"))
    return tuple(out)


def class_bytes(segments: tuple[SpanSegment, ...] | list[SpanSegment]) -> dict[str, int]:
    """Payload bytes per span class (e.g. ``{"swa": ..., "nope": ...}``)."""
    out: dict[str, int] = {}
    for seg in segments:
        out[seg.span_class] = out.get(seg.span_class, 0) + seg.byte_len
    return out


def payload_bytes(segments: Iterable[SpanSegment]) -> int:
    return sum(seg.byte_len for seg in segments)


# --- presets ---------------------------------------------------------------------------

MUSE_LAYERS = 52
MUSE_NOPE_LAYERS = tuple(range(3, MUSE_LAYERS, 4))
MUSE_SWA_LAYERS = tuple(layer for layer in range(MUSE_LAYERS) if layer % 4 != 3)
MUSE_SWA_WINDOW = 2048
MUSE_NOPE_TILE = 512
MUSE_SWA_GROUP = 13
MUSE_PACKED_PLANES = 26

#: The upstream Muse layout (52 layers; every 4th layer full-attention NoPE, the rest
#: sliding-window RoPE with a 2,048-token window), in upstream wire order.
MUSE = SpanLayout(
    name="muse",
    classes=(
        SpanClass("swa", "swa_tile", MUSE_SWA_LAYERS, MUSE_SWA_WINDOW, MUSE_SWA_GROUP, True),
        SpanClass("nope", "nope_tile", MUSE_NOPE_LAYERS, None, len(MUSE_NOPE_LAYERS), False),
    ),
    tile_tokens=MUSE_NOPE_TILE,
)


def full_attention_layout(name: str, n_layers: int, plane_elements: int, *, tile_tokens: int = 512) -> SpanLayout:
    """The one-class case (SmolLM2, Llama): every layer full-span, one packed tile per row
    range with all layers in it."""
    return SpanLayout(
        name=name,
        classes=(SpanClass("full", "nope_tile", tuple(range(n_layers)), None, n_layers, False),),
        tile_tokens=tile_tokens,
        plane_elements=plane_elements,
    )


PRESETS = {"muse": MUSE}


def muse_intents(position: int) -> tuple[SpanSegment, ...]:
    """The full Muse schedule (cut 0), upstream's Python name."""
    return schedule_span(MUSE, position, 0)


def muse_schedule_span(position: int, cut: int) -> tuple[SpanSegment, ...]:
    return schedule_span(MUSE, position, cut)
