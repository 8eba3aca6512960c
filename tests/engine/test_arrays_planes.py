"""The NumPy engine's planes: sized once per prompt (a chunked prefill never re-copies what it
already holds, so prefill-while-streaming is linear in the prompt), identical bytes whatever
the chunking, windows respected, and a view handed out by ``export_rows`` never rewritten."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.errors import EngineError

LAYOUTS = {
    "full-f32": array_layout(3, 2, 8),
    "f16-windowed": array_layout(4, 2, 8, dtype="f16", windowed={1: 5, 2: 300}),
    "bf16": array_layout(2, 2, 8, dtype="bf16"),
}


def _session(layout, tokens, chunk=None):
    s = ArrayEngine(layout).new_session()
    s.prefill(tokens, chunk_size=chunk)
    return s


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_chunked_prefill_allocates_each_plane_once(name):
    layout = LAYOUTS[name]
    s = ArrayEngine(layout).new_session()
    buffers: dict = {}

    def seen(sess):
        for key, plane in sess._planes.items():
            buffers.setdefault(key, set()).add(id(plane.buf))

    s.prefill(list(range(1, 2000)), chunk_size=256, on_chunk=seen)
    for (layer, _role), ids in buffers.items():
        # a full-span plane is sized for the whole prompt at the first chunk; a windowed one
        # is re-allocated only when its window slides past its spare room
        assert len(ids) == 1 or layout.layers[layer].window_tokens, (name, layer, len(ids))
        if not layout.layers[layer].window_tokens:
            assert s._planes[(layer, _role)].buf.shape[0] == 1999  # exactly the prompt


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 700), chunk=st.sampled_from([1, 7, 64, 256, None]), name=st.sampled_from(sorted(LAYOUTS)))
def test_bytes_do_not_depend_on_chunking(n, chunk, name):
    layout = LAYOUTS[name]
    tokens = [(7 * i + 3) % 50 for i in range(n)]
    one = _session(layout, tokens)
    other = _session(layout, tokens, chunk)
    assert one.cache_digest() == other.cache_digest()
    for layer, role in layout.states():
        lo, hi = one.retained_range(layer)
        assert lo == max(0, n - layout.layers[layer].window_tokens) if layout.layers[layer].window_tokens else lo == 0
        assert bytes(one.export_rows(layer, role, lo, hi)) == bytes(other.export_rows(layer, role, lo, hi))


def test_exported_views_keep_their_bytes_while_the_session_grows():
    layout = LAYOUTS["f16-windowed"]
    s = _session(layout, list(range(1, 300)), 64)
    views = {k: s.export_rows(k[0], k[1], *s.retained_range(k[0])) for k in layout.states()}
    copies = {k: bytes(v) for k, v in views.items()}
    s.prefill(list(range(5, 900)), chunk_size=256)
    s.decode_greedy(20)
    assert {k: bytes(v) for k, v in views.items()} == copies


def test_rows_are_finite_floats():
    for name, layout in LAYOUTS.items():
        s = _session(layout, list(range(1, 600)), 256)
        for layer, role in layout.states():
            lo, hi = s.retained_range(layer)
            raw = np.frombuffer(s.export_rows(layer, role, lo, hi), dtype=np.uint8)
            if layout.layers[layer].dtype == "f16":
                assert np.isfinite(raw.view(np.float16)).all(), name
            elif layout.layers[layer].dtype == "f32":
                assert np.isfinite(raw.view(np.float32)).all(), name


def test_install_commit_then_growth_matches_an_uninterrupted_session():
    layout = LAYOUTS["f16-windowed"]
    tokens = list(range(3, 900))
    ref = _session(layout, tokens + [11, 12], 256)
    s = ArrayEngine(layout).new_session()
    src = _session(layout, tokens, 100)
    install = s.begin_install(len(tokens), tokens, s.engine.identity)
    for layer, role in layout.states():
        lo, hi = install.required_range(layer)
        install.write_rows(layer, role, lo, src.export_rows(layer, role, lo, hi))
    install.commit(require_logits=False)
    s.prefill([11, 12])
    assert s.cache_digest() == ref.cache_digest()
    assert s.decode_greedy(5)[0] == ref.decode_greedy(5)[0]


def test_an_installed_cache_takes_the_boundary_token_and_decoding_in_place():
    """An install's planes carry spare rows: the decode node's boundary token and the first
    decode steps (or a producer's last prefill chunk) append without copying the cache."""
    layout = LAYOUTS["full-f32"]
    tokens = list(range(3, 1500))
    src = _session(layout, tokens, 256)
    s = ArrayEngine(layout).new_session()
    install = s.begin_install(len(tokens), tokens, s.engine.identity)
    for layer, role in layout.states():
        install.write_rows(layer, role, 0, src.export_rows(layer, role, 0, len(tokens)))
    install.commit(require_logits=False)
    buffers = {key: id(plane.buf) for key, plane in s._planes.items()}
    s.prefill([11])
    s.decode_greedy(8)
    assert {key: id(plane.buf) for key, plane in s._planes.items()} == buffers
    ref = _session(layout, tokens + [11], 256)
    ref.decode_greedy(8)
    assert s.cache_digest() == ref.cache_digest()


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("last_use", [False, True])
def test_a_resident_prefix_is_installed_by_reference_and_continues_exactly(name, last_use):
    """A producer's resident hit: the prefix is lent to the job's install (share_rows), no
    whole-cache copy; the job's prefill then appends after it (or folds a sliding window)
    and computes exactly what an uninterrupted prefill computes; the lent rows never change."""
    from kvpack.node.ladder import RowsSource
    from kvpack.node.wire import TileGeometry, copy_prefix

    layout = LAYOUTS[name]
    engine = ArrayEngine(layout)
    tokens = list(range(3, 700))
    earlier = _session(layout, tokens[:512], 256)
    source = RowsSource.capture(earlier, 512, last_use=last_use)
    lent = {key: bytes(source.export_rows(key[0], key[1], *source.retained_range(key[0]))) for key in source.planes}
    job = engine.new_session()
    install = job.begin_install(512, tokens[:512], engine.identity)
    if name == "full-f32":
        copy_prefix(source, install, TileGeometry.of(layout), 512)
    else:  # no wire mapping for these layouts: lend plane by plane as copy_prefix does
        for spec in layout.layers:
            lo = install.required_range(spec.index)[0]
            for role in layout.roles:
                assert install.share_rows(spec.index, role, lo, source.export_rows(spec.index, role, lo, 512))
    assert set(install._shared) == set(install._shapes) and not install._planes  # every plane by reference
    install.commit(require_logits=False)
    job.prefill(tokens[512:], chunk_size=256)
    job.prefill([5, 6, 7])  # decode-like single rows after the chunk
    reference = _session(layout, tokens + [5, 6, 7], 256)
    assert job.cache_digest() == reference.cache_digest()
    for key in source.planes:
        assert bytes(source.export_rows(key[0], key[1], *source.retained_range(key[0]))) == lent[key]
    # the job's prompt remembered in turn: by reference, lent head and own rows as parts;
    # the next job is lent its aligned prefix (inside the head) again without a copy
    again = RowsSource.capture(job, job.position, last_use=last_use)
    for spec in layout.layers:
        for role in layout.roles:
            lo = again.retained_range(spec.index)[0]
            assert bytes(again.export_rows(spec.index, role, lo, job.position)) == bytes(reference.export_rows(spec.index, role, lo, job.position))
    if name == "f16-windowed":
        return  # its windows at 700 no longer hold the rows a cut at 512 needs
    nxt = engine.new_session()
    install = nxt.begin_install(512, tokens[:512], engine.identity)
    for spec in layout.layers:
        lo = install.required_range(spec.index)[0]
        for role in layout.roles:
            rows = again.export_rows(spec.index, role, lo, 512)
            if not install.share_rows(spec.index, role, lo, rows):
                install.write_rows(spec.index, role, lo, rows)
    if last_use and name == "full-f32":
        assert set(install._shared) == set(install._shapes) and not install._planes
    install.commit(require_logits=False)
    nxt.prefill(tokens[512:] + [5, 6, 7], chunk_size=256)
    assert nxt.cache_digest() == reference.cache_digest()


def test_share_rows_takes_only_a_whole_plane_and_never_twice():
    layout = LAYOUTS["full-f32"]
    engine = ArrayEngine(layout)
    src = _session(layout, list(range(1, 300)))
    install = engine.new_session().begin_install(299, list(range(1, 300)), engine.identity)
    assert not install.share_rows(0, "k", 0, src.export_rows(0, "k", 0, 298))  # not the whole range
    install.write_rows(0, "v", 0, src.export_rows(0, "v", 0, 10))
    with pytest.raises(EngineError):
        install.share_rows(0, "v", 0, src.export_rows(0, "v", 0, 299))
    assert install.share_rows(0, "k", 0, src.export_rows(0, "k", 0, 299))
    with pytest.raises(EngineError):
        install.write_rows(0, "k", 0, src.export_rows(0, "k", 0, 1))
    install.abort()
    assert install._shared == {} and install._planes == {}
