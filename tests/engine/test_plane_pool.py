"""The arrays engine's plane pool: an install's planes are carved from buffers earlier
installs used (no fresh pages to fault and zero-fill per transfer), but only once nothing
holds a view of them -- a session, an export, a claimed payload target -- and never past
the pool's byte bound."""

from __future__ import annotations

import numpy as np

from kvpack.engine.arrays import ArrayEngine, PlanePool, array_layout

MIB = 1 << 20


def _root_ids(pool: PlanePool) -> set[int]:
    return {id(r) for roots in pool._roots.values() for r in roots}


def test_a_buffer_is_reused_only_once_no_view_of_it_is_left():
    pool = PlanePool(64 * MIB)
    a = pool.empty((512, 4096))
    a[:] = 7
    view = a[3:5]
    mv = a[10:12].data.cast("B")
    del a
    b = pool.empty((512, 4096))  # the first buffer is still seen through view and mv
    assert pool.stats()["made"] == 2 and pool.stats()["reused"] == 0
    b[:] = 9
    assert bytes(view.tobytes()) == b"\x07" * 2 * 4096 and bytes(mv) == b"\x07" * 2 * 4096
    del view
    c = pool.empty((512, 4096))
    assert pool.stats()["made"] == 3  # mv still holds the first one; b is live
    del mv, b
    d = pool.empty((512, 4096))
    e = pool.empty((500, 4096))  # a smaller plane of the same size class
    assert pool.stats()["reused"] == 2 and pool.stats()["made"] == 3
    assert len({d.__array_interface__["data"][0], e.__array_interface__["data"][0], c.__array_interface__["data"][0]}) == 3


def test_the_bound_and_the_minimum_size_are_kept():
    pool = PlanePool(3 * MIB)
    held = [pool.empty((256, 4096)) for _ in range(5)]  # 1 MiB each: three pooled, two plain
    assert pool.stats()["made"] == 3 and pool.stats()["held_bytes"] == 3 * MIB
    assert all(h.shape == (256, 4096) for h in held)
    small = pool.empty((4, 64))
    assert small.base is None and pool.stats()["made"] == 3  # under min_bytes: never pooled
    off = PlanePool(0)
    assert off.empty((256, 4096)).base is None and off.stats()["made"] == 0


def test_size_classes_bound_the_slack():
    for n in (MIB, MIB + 1, 3 * MIB + 17, 64 * MIB + 4096, 4 * MIB * 1023):
        c = PlanePool.size_class(n)
        assert n <= c <= n + n // 8


def _install(engine, src, tokens):
    s = engine.new_session()
    install = s.begin_install(len(tokens), tokens, engine.identity)
    for layer, role in engine.layout.states():
        lo, hi = install.required_range(layer)
        view = install.claim_rows(layer, role, lo, hi - lo)
        view[:] = bytes(src.export_rows(layer, role, lo, hi))
        install.rows_landed(layer, role, lo, hi - lo)
    return s, install


def _rows_of(session, layout, n):
    return [bytes(session.export_rows(layer, role, 0, n)) for layer, role in layout.states()]


def test_installs_recycle_the_planes_of_sessions_that_moved_on_and_keep_exact_bytes():
    layout = array_layout(2, 2, 64, dtype="f32")  # 512 B rows: 2,048 tokens = 1 MiB planes
    engine = ArrayEngine(layout, plane_pool_bytes=256 * MIB)
    tokens = list(range(5, 2053))
    src = engine.new_session()
    src.prefill(tokens, chunk_size=256)
    first, install = _install(engine, src, tokens)
    install.commit(require_logits=False)
    made = engine.planes.stats()["made"]
    assert made == len(layout.states())
    kept = first.export_rows(0, "k", 0, 10)  # an export keeps one plane busy
    second, install2 = _install(engine, src, tokens)
    assert engine.planes.stats()["made"] == 2 * made  # the first session still holds its planes
    install2.commit(require_logits=False)
    assert _rows_of(second, layout, len(tokens)) == _rows_of(src, layout, len(tokens))
    del first, install  # the committed install keeps no plane of the session it fed
    third, install3 = _install(engine, src, tokens)
    stats = engine.planes.stats()
    assert stats["made"] == 2 * made + 1 and stats["reused"] == made - 1  # all but the exported one
    install3.commit(require_logits=False)
    assert _rows_of(third, layout, len(tokens)) == _rows_of(src, layout, len(tokens)) == _rows_of(second, layout, len(tokens))
    assert bytes(kept) == bytes(src.export_rows(0, "k", 0, 10))


def test_an_aborted_install_gives_its_planes_back():
    layout = array_layout(2, 2, 64, dtype="f32")
    engine = ArrayEngine(layout, plane_pool_bytes=256 * MIB)
    tokens = list(range(5, 2053))
    src = engine.new_session()
    src.prefill(tokens)
    _s, install = _install(engine, src, tokens)
    install.abort()
    made = engine.planes.stats()["made"]
    s2, install2 = _install(engine, src, tokens)
    assert engine.planes.stats()["made"] == made and engine.planes.stats()["reused"] == made
    install2.commit(require_logits=False)
    assert _rows_of(s2, layout, len(tokens)) == _rows_of(src, layout, len(tokens))
    assert np.array_equal(np.frombuffer(s2.export_rows(1, "v", 0, 5), np.uint8), np.frombuffer(src.export_rows(1, "v", 0, 5), np.uint8))


def test_shared_arenas_are_recycled_like_roots_and_bounded():
    """An arena (an install's planes in one memfd) is reused only once no view of it is
    left; another process writes into it through its spec; the bound holds (then None)."""
    import subprocess
    import sys

    pool = PlanePool(3 * MIB)
    a, spec = pool.shared(2 * MIB)
    code = f"import mmap, os; fd = os.open({spec[1]!r}, os.O_RDWR); m = mmap.mmap(fd, {spec[2]}); m[5:8] = b'abc'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    assert bytes(a[5:8]) == b"abc"  # the same pages
    view = a[:16]
    del a
    assert pool.shared(2 * MIB) is None  # held (a view) and no room for another
    small, small_spec = pool.shared(4096)  # under min_bytes: still an arena
    assert small_spec[0] != spec[0] and pool.stats()["made"] == 2
    del view
    again, again_spec = pool.shared(2 * MIB)
    assert again_spec == spec and pool.stats()["reused"] == 1
    assert PlanePool(0).shared(4096) is None


def test_an_install_shares_its_planes_only_before_any_row_is_written():
    layout = array_layout(layers=2, kv_heads=2, head_dim=8)
    eng = ArrayEngine(layout)
    tokens = list(range(40))
    install = eng.new_session().begin_install(len(tokens), tokens, eng.identity)
    assert install.share_planes() and not install.share_planes()  # once
    arena, offset = install.claim_shared_rows(1, "v", 2, 3)
    plane_bytes = -(-(40 + 256 + 40 // 16) * 64 // 4096) * 4096  # rows + spare, page-aligned
    assert offset == 3 * plane_bytes + 2 * 64  # the fourth plane, its third row
    with open(arena[1], "r+b") as fh:  # as a reader process writes it
        fh.seek(offset)
        fh.write(b"\x5a" * 3 * 64)
    install.rows_landed(1, "v", 2, 3)
    assert bytes(install._planes[(1, "v")][2:5].tobytes()) == b"\x5a" * 3 * 64
    assert install.missing() and (1, "v", 37) in install.missing()
    other = eng.new_session().begin_install(len(tokens), tokens, eng.identity)
    other.write_rows(0, "k", 0, bytes(64 * 40))
    assert not other.share_planes()  # a plane already exists: stays private
