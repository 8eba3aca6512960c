"""The node wire mapping for layouts with full-attention and windowed classes (no sockets).

* the seed's Muse geometry (what muse-tiny loads) maps to exactly the upstream ``MUSE``
  preset: every C.12 worked check and the seed's byte arithmetic hold through it;
* pack -> scatter round trips through a detached install at positions below, at and above
  the window, for full transfers and for deltas whose held prefix supplies the part of the
  window before the cut: the installed planes equal the producer's, byte for byte;
* a segment of another layout or dtype is refused as ``layout`` (never ``delta``), and a
  known shape at the wrong rows is still ``delta``;
* the resident tier only offers a windowed prefix where its window still holds the cut.
"""

from __future__ import annotations

import pytest

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.errors import EngineError, ProtocolError
from kvpack.handoff.delta import ScheduleWitness, check_declared_schedule, layout_shapes
from kvpack.handoff.schedule import MUSE, class_bytes, muse_schedule_span
from kvpack.node.ladder import ResidentRadix, RowsSource, window_covers
from kvpack.node.wire import TileGeometry, copy_prefix, pack_tile, scatter_tile, span_layout

MUSE_SWA = {i: 2048 for i in range(52) if i % 4 != 3}


def muse_layout(dtype="f16"):
    return array_layout(layers=52, kv_heads=2, head_dim=128, dtype=dtype, windowed=MUSE_SWA, vocab=512)


def test_muse_geometry_is_the_upstream_preset_byte_for_byte():
    span = span_layout(muse_layout())
    assert span == MUSE
    geo = TileGeometry.of(muse_layout())
    # C.12 worked checks, through the node mapping
    s = geo.schedule(2049)
    assert len(s) == 20 and sum(x.role == "swa_tile" for x in s) == 15 and (s[0].logical_start, s[0].logical_count) == (1, 511)
    s = geo.schedule(2049, 1024)
    assert [x.layer for x in s if x.role == "swa_tile"] == [0, 0, 0, 17, 17, 17, 34, 34, 34]
    assert geo.schedule(4096, 512) == muse_schedule_span(4096, 512)
    assert (geo.schedule(257, 256)[0].logical_start, geo.schedule(257, 256)[0].logical_count) == (256, 1)
    # the seed's arithmetic (Table 26.1)
    assert geo.payload_bytes(65535) == 954_190_848
    assert class_bytes(geo.schedule(65535)) == {"swa": 81_788_928, "nope": 872_401_920}
    assert geo.payload_bytes(65535, 32768) == 517_983_232
    assert geo.payload_bytes(32768) == 517_996_544
    # errata L6: the three SWA groups and the NoPE layers, in packing order
    assert {geo.group(x) for x in s} == {
        tuple(range(3, 52, 4)),
        (0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16),
        (17, 18, 20, 21, 22, 24, 25, 26, 28, 29, 30, 32, 33),
        (34, 36, 37, 38, 40, 41, 42, 44, 45, 46, 48, 49, 50),
    }


def test_full_attention_layouts_keep_their_one_class_256_row_tiles():
    span = span_layout(array_layout(layers=4, kv_heads=2, head_dim=8))
    assert span.tile_tokens == 256 and [c.name for c in span.classes] == ["full"] and span.element_type == "f32_le"


@pytest.mark.parametrize(
    "layout, why",
    [
        (array_layout(layers=4, kv_heads=2, head_dim=8, dtype="bf16"), "element type"),
        (array_layout(layers=4, kv_heads=2, head_dim=8, windowed={0: 8, 1: 9}), "different windows"),
    ],
)
def test_unmappable_layouts_are_refused(layout, why):
    with pytest.raises(EngineError, match=why) as err:
        span_layout(layout)
    assert err.value.category == "unsupported"


class _Desc:
    """A descriptor of the fields the witness reads."""

    def __init__(self, seg, **changes):
        self.sequence, self.component_id = seg.sequence, seg.component_id
        self.role, self.layer, self.logical_start, self.logical_count = seg.role, seg.layer, seg.logical_start, seg.logical_count
        self.element_type, self.elements_per_token = seg.element_type, seg.elements_per_token
        self.__dict__.update(changes)


def test_another_layout_or_dtype_is_a_layout_refusal_never_delta():
    muse_f32 = TileGeometry.of(muse_layout("f32"))
    assert muse_f32.span.element_type == "f32_le" and muse_f32.span != MUSE
    f16_segments = muse_schedule_span(1000, 0)
    # an f16 Muse producer at an f32 receiver of the same geometry: layout, at segment 0
    witness = ScheduleWitness(muse_f32.schedule(1000), "target")
    with pytest.raises(ProtocolError) as err:
        witness.observe(_Desc(f16_segments[0]))
    assert err.value.category == "layout" and "f16_le" in err.value.message
    # the Muse schedule at a one-class (SmolLM2-like) receiver: layout, not delta
    one_class = TileGeometry.of(array_layout(layers=30, kv_heads=3, head_dim=64))
    with pytest.raises(ProtocolError) as err:
        ScheduleWitness(one_class.schedule(1000), "target").observe(_Desc(f16_segments[0]))
    assert err.value.category == "layout"
    # a known shape at the wrong rows breaks the span rules: delta
    witness = ScheduleWitness(f16_segments, "target")
    with pytest.raises(ProtocolError) as err:
        witness.observe(_Desc(f16_segments[0], logical_start=1))
    assert err.value.category == "delta"


def test_a_stripe_share_knows_every_shape_of_its_layout():
    # stripe 1 of 4 of a Muse schedule: its share may not hold every group, but a segment of
    # the layout that belongs to another stripe is a span-rule break (delta), not a layout
    full = muse_schedule_span(1000, 0)
    share = full[1::4]
    missing = [s for s in full if (s.role, s.layer) not in {(x.role, x.layer) for x in share}]
    assert missing  # the share lacks a group
    assert len(layout_shapes(MUSE)) == 4  # three SWA groups + the NoPE group
    witness = ScheduleWitness(share, "target", layout_shapes(MUSE))
    with pytest.raises(ProtocolError) as err:
        witness.observe(_Desc(missing[0]))
    assert err.value.category == "delta"


def test_declared_mode_classifies_layout_before_counting():
    class _Manifest:
        position = 1000
        segments = [_Desc(s) for s in muse_schedule_span(1000, 0)]

    with pytest.raises(ProtocolError) as err:
        check_declared_schedule(_Manifest(), TileGeometry.of(array_layout(layers=30, kv_heads=3, head_dim=64)).span, 0)
    assert err.value.category == "layout"
    _Manifest.segments = _Manifest.segments[:-1]
    with pytest.raises(ProtocolError) as err:
        check_declared_schedule(_Manifest(), MUSE, 0)
    assert err.value.category == "delta"


WINDOW = 40  # rows a windowed layer retains in the small two-class layout below
SMALL = {0: WINDOW, 1: WINDOW, 2: WINDOW, 4: WINDOW, 5: WINDOW, 6: WINDOW}  # full: 3, 7


def small_engine():
    return ArrayEngine(array_layout(layers=8, kv_heads=2, head_dim=4, dtype="f16", windowed=SMALL, vocab=64), name="small-two-class")


def _transfer(engine, position, cut=0, held=None):
    """Producer: a session at ``position``; its schedule packed. Receiver: an install at
    ``position`` filled from the wire (and the held prefix before the cut)."""
    geo = TileGeometry.of(engine.layout)
    tokens = [(7 * i + 3) % 64 for i in range(position)]
    src = engine.new_session()
    src.prefill(tokens)
    dst = engine.new_session()
    install = dst.begin_install(position, tokens, engine.identity)
    copied = copy_prefix(held, install, geo, cut) if cut else 0
    wire = 0
    for seg in geo.schedule(position, cut):
        payload = pack_tile(src, geo, seg)
        assert len(payload) == seg.byte_len
        scatter_tile(install, geo, seg, memoryview(payload))
        wire += len(payload)
    assert install.missing() == []
    install.commit(require_logits=False)
    for layer, role in engine.layout.states():
        assert dst.retained_range(layer) == src.retained_range(layer)
        assert dst.state_digest(layer, role) == src.state_digest(layer, role)
    return wire, copied, tokens


@pytest.mark.parametrize("position", [WINDOW - 15, WINDOW, WINDOW + 1, 3 * WINDOW + 7, 700])
def test_full_transfer_scatters_into_every_window(position):
    engine = small_engine()
    wire, _, _ = _transfer(engine, position)
    assert wire == TileGeometry.of(engine.layout).payload_bytes(position)


@pytest.mark.parametrize(
    "held_at, cut, position",
    [
        (256, 256, 270),  # suffix shorter than the window: the held prefix supplies the rest of it
        (256, 256, 256 + WINDOW),  # suffix exactly one window: nothing of the window is held
        (256, 256, 700),  # suffix beyond the window: the whole window is re-sent (seed 26.3)
        (30, 0, 35),  # below the window, full
    ],
)
def test_delta_takes_the_window_part_before_the_cut_from_the_held_prefix(held_at, cut, position):
    engine = small_engine()
    tokens = [(7 * i + 3) % 64 for i in range(position)]
    s = engine.new_session()
    s.prefill(tokens[:held_at])
    held = RowsSource.capture(s, held_at)
    assert held.covers(held_at) and (cut == 0 or held.covers(cut))
    wire, copied, _ = _transfer(engine, position, cut, held)
    geo = TileGeometry.of(engine.layout)
    assert wire == geo.payload_bytes(position, cut)
    window_before_cut = max(0, cut - max(0, position - WINDOW)) if cut else 0
    row = engine.layout.layers[0].row_bytes
    assert copied == (cut * 2 * 2 + window_before_cut * 2 * 6) * row  # full layers 3, 7; six windowed


def test_windowed_prefix_is_offered_only_where_its_window_holds_the_cut():
    engine = small_engine()
    layout = engine.layout
    assert window_covers(layout, 30, 30) and window_covers(layout, 30, 10)  # within the first window
    assert window_covers(layout, 300, 300) and not window_covers(layout, 300, 256)  # deeper: slid out
    full_only = array_layout(layers=2, kv_heads=2, head_dim=4)
    assert window_covers(full_only, 300, 256) and not window_covers(full_only, 300, 301)
    tokens = [(5 * i + 1) % 64 for i in range(600)]
    s = engine.new_session()
    s.prefill(tokens[:512])
    radix = ResidentRadix()
    radix.insert(b"id", RowsSource.capture(s, 512))
    # exact end: offered; a shallower aligned cut of the same (windowed) entry: not
    assert radix.lookup(b"id", tokens[:513]).matched == 512
    assert radix.lookup(b"id", tokens[:257] + [99]) is None
    with pytest.raises(EngineError):
        RowsSource.capture(s, 256)  # the window ending at 256 slid out of the session


def test_tile_pieces_are_the_packed_tile_by_reference_and_only_from_stable_rows():
    """The producer sends a tile from its plane rows (no packed copy) only where those rows
    never change under the views: an arrays session while it keeps prefilling, a resident
    entry; the bytes are exactly pack_tile's."""
    from kvpack.engine.arrays import ArrayEngine, array_layout
    from kvpack.node.ladder import RowsSource
    from kvpack.node.wire import TileGeometry, pack_tile, tile_pieces

    engine = ArrayEngine(array_layout(layers=3, kv_heads=2, head_dim=4, dtype="f32"))
    geometry = TileGeometry.of(engine.layout)
    session = engine.new_session()
    session.prefill(list(range(1, 600)), chunk_size=256)
    seg = geometry.schedule(599)[1]
    packed = bytes(pack_tile(session, geometry, seg))
    pieces = tile_pieces(session, geometry, seg)
    assert pieces is not None and len(pieces.pieces) == 6 and pieces.tobytes() == packed
    session.prefill(list(range(600, 1200)), chunk_size=256)  # grows the planes: the views keep their bytes
    assert pieces.tobytes() == packed
    held = tile_pieces(RowsSource.capture(session, 1199), geometry, seg)
    assert held is not None and held.tobytes() == packed

    class Unstable:  # an engine that does not promise stable export_rows views
        def __init__(self, inner):
            self.inner = inner

        def export_rows(self, *a):
            return self.inner.export_rows(*a)

    assert tile_pieces(Unstable(session), geometry, seg) is None
    assert bytes(pack_tile(Unstable(session), geometry, seg)) == packed
