"""The striped install's write path (kvpack.node.striping): segments written on the install
pool while the next one is read, several stripes at once into an install that allows it,
and every failure or abort leaving nothing installed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvpack.engine.arrays import ArrayEngine, array_layout
from kvpack.errors import EngineError, ProtocolError
from kvpack.node.striping import SharedInstall, StripeSink

ROWS = 64


class _Manifest:
    """The fields SharedInstall.join compares between stripes."""

    position = ROWS
    prompt_token_ids = tuple(range(1, ROWS + 1))
    identity = components = hmac = None


def _setup(count: int, scatter=None):
    engine = ArrayEngine(array_layout(layers=2, kv_heads=1, head_dim=4))
    session = engine.new_session()
    reference = engine.new_session()
    reference.prefill(list(_Manifest.prompt_token_ids))

    def open_install(manifest, cut):
        return session.begin_install(manifest.position, list(manifest.prompt_token_ids), engine.identity)

    def write(install, rows, payload):  # rows: (layer, role, start, stop) of one plane
        install.write_rows(rows[0], rows[1], rows[2], payload)

    shared = SharedInstall(count, open_install, scatter or write, time.monotonic() + 30)
    return engine, session, reference, shared


def _pieces(reference, stripe: int, count: int):
    out = []
    for layer in (0, 1):
        for role in ("k", "v"):
            for start in range(stripe * 16, ROWS, 16 * count):
                out.append(((layer, role, start, start + 16), reference.export_rows(layer, role, start, start + 16)))
    return out


def test_stripes_write_at_once_on_the_pool_and_commit_once():
    engine, session, reference, shared = _setup(2)
    with ThreadPoolExecutor(4) as pool:
        sinks = [StripeSink(shared, i, pool) for i in range(2)]
        for sink in sinks:
            sink.begin(_Manifest, 0)
        assert shared.concurrent  # the arrays install takes disjoint rows from several threads
        threads = []
        for i, sink in enumerate(sinks):

            def run(sink=sink, i=i) -> None:
                for rows, payload in _pieces(reference, i, 2):
                    sink.write_segment(rows, payload)
                sink.prepare()
                sink.commit()

            threads.append(threading.Thread(target=run))
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert shared.committed and session.position == ROWS
    for layer in (0, 1):
        for role in ("k", "v"):
            assert bytes(session.export_rows(layer, role, 0, ROWS)) == bytes(reference.export_rows(layer, role, 0, ROWS))


def test_a_failed_background_write_refuses_the_stripe_and_installs_nothing():
    engine, session, reference, shared = _setup(1)
    with ThreadPoolExecutor(2) as pool:
        sink = StripeSink(shared, 0, pool)
        sink.begin(_Manifest, 0)
        sink.write_segment((0, "k", ROWS - 8, ROWS + 8), np.zeros(16 * 16, np.uint8).data)  # rows past the install
        with pytest.raises(EngineError):
            sink.prepare()  # the write's failure is this stripe's refusal
        sink.abort()
    assert shared.failed is not None and not shared.committed
    assert session.position == 0  # nothing installed
    with pytest.raises(ProtocolError):
        shared.write((0, "k", 0, 16), reference.export_rows(0, "k", 0, 16))


def test_an_abort_waits_for_the_write_in_flight_before_dropping_the_install():
    started, release, order = threading.Event(), threading.Event(), []
    engine, session, reference, shared = _setup(2)

    def slow_write(install, rows, payload):
        started.set()
        release.wait(10)
        install.write_rows(rows[0], rows[1], rows[2], payload)
        order.append("write ended")

    shared._scatter = slow_write
    with ThreadPoolExecutor(2) as pool:
        sink = StripeSink(shared, 0, pool)
        sink.begin(_Manifest, 0)
        sink.write_segment((0, "k", 0, 16), reference.export_rows(0, "k", 0, 16))
        assert started.wait(10)
        failer = threading.Thread(target=lambda: (shared.fail("stripe 1 refused"), order.append("failed")))
        failer.start()
        time.sleep(0.2)
        assert order == []  # the abort waits for the write
        release.set()
        failer.join(10)
    assert order == ["write ended", "failed"]
    assert shared.install.state == "aborted" and session.position == 0


def test_the_payload_buffer_pool_keeps_at_most_its_budget_and_lends_each_buffer_once():
    from kvpack.node.inbound import PayloadBufferPool

    pool = PayloadBufferPool(300)
    a, b, c = bytearray(100), bytearray(150), bytearray(200)
    pool.give([a, b, c])  # the largest first, within the budget: c (200) and a (100)
    assert pool.idle_bytes == 300
    taken = pool.take(2)
    assert {id(x) for x in taken} == {id(a), id(c)} and pool.idle_bytes == 0
    assert pool.take(2) == []


def test_a_refused_receiver_keeps_its_payload_buffers():
    """Only a committed transfer hands its buffers back (a refused one may still have a
    cancelled digest lane reading them)."""
    from kvpack.handoff.receiver import Receiver, ReceiverConfig

    class _Gate:
        def admit(self, *a):
            pass

        def reserve(self, *a):
            pass

    rx = Receiver(ReceiverConfig(b"k" * 32, "kid", 1, layout=None), None, _Gate(), now_unix_ms=0, reuse_buffers=[bytearray(64)])
    rx.abort("test")
    assert rx.release_payload_buffers() == []


def _in_place_setup(position: int):
    from kvpack.node.wire import TileGeometry

    engine = ArrayEngine(array_layout(layers=2, kv_heads=1, head_dim=4, dtype="f32"))
    geometry = TileGeometry.of(engine.layout)
    session, reference = engine.new_session(), engine.new_session()
    reference.prefill(list(range(1, position + 1)))

    class M(_Manifest):
        prompt_token_ids = tuple(range(1, position + 1))

    M.position = position

    shared = _in_place_shared(engine, session, geometry)
    sink = StripeSink(shared, 0)
    sink.begin(M, 0)
    return geometry, session, reference, shared, sink


def _in_place_shared(engine, session, geometry) -> SharedInstall:
    """One stripe's shared install that reads segments straight into the session's rows."""
    from kvpack.node.wire import tile_landed, tile_target

    def open_install(manifest, cut):
        return session.begin_install(manifest.position, list(manifest.prompt_token_ids), engine.identity)

    return SharedInstall(
        1,
        open_install,
        lambda *_a: pytest.fail("an in-place install never scatters"),
        time.monotonic() + 30,
        lambda install, seg: tile_target(install, geometry, seg),
        lambda install, seg: tile_landed(install, geometry, seg),
    )


def _fill(target, payload: bytes) -> None:
    at = 0
    for piece in target.pieces:  # what recv_into does, piece by piece
        piece[:] = payload[at : at + piece.nbytes]
        at += piece.nbytes


def test_segments_read_into_the_install_rows_commit_without_a_scatter():
    from kvpack.node.wire import pack_tile

    geometry, session, reference, shared, sink = _in_place_setup(600)
    segments = geometry.schedule(600)
    assert len(segments) == 3
    for seg in segments:
        target = sink.payload_target(seg)
        assert target is not None and len(target.pieces) == 4 and target.nbytes == seg.byte_len
        _fill(target, bytes(pack_tile(reference, geometry, seg)))
        sink.write_segment(seg, target)
    sink.prepare()
    sink.commit()
    assert shared.committed and session.position == 600
    for layer in (0, 1):
        for role in ("k", "v"):
            assert bytes(session.export_rows(layer, role, 0, 600)) == bytes(reference.export_rows(layer, role, 0, 600))


def test_rows_written_in_place_count_only_once_landed_and_an_abort_releases_them():
    from kvpack.handoff.target import PayloadTarget
    from kvpack.node.wire import pack_tile

    geometry, session, reference, shared, sink = _in_place_setup(600)
    first, second, _third = geometry.schedule(600)
    target = sink.payload_target(first)
    _fill(target, bytes(pack_tile(reference, geometry, first)))
    sink.write_segment(first, target)
    install = shared.install
    # claimed rows: refused to every other claim and write, and not counted before landing
    bad = sink.payload_target(second)
    _fill(bad, b"\xff" * second.byte_len)  # bytes that would fail their digest
    with pytest.raises(EngineError):
        install.claim_rows(0, "k", second.logical_start, 1)
    with pytest.raises(EngineError):
        install.write_rows(0, "k", second.logical_start, b"\0" * geometry.row_bytes)
    assert any(left for _l, _r, left in install.missing())
    with pytest.raises(ProtocolError):  # a target this install did not hand out
        sink.write_segment(second, PayloadTarget(list(bad.pieces), token=first))
    # the refusal: the receiver aborts the sink; nothing was installed, the planes are gone
    sink.abort()
    assert shared.failed is not None and install.state == "aborted" and install._planes == {}
    assert session.position == 0
    with pytest.raises(ProtocolError):
        sink.payload_target(second)


@pytest.mark.parametrize("tamper", [False, True])
def test_the_receiver_reads_segments_into_the_install_and_a_tampered_one_installs_nothing(tamper):
    """The whole in-place chain in process: the handoff receiver, the stripe sink, the arrays
    install's claimed rows. A payload byte flipped in plaintext (its digest fails) was read
    into the install's rows, is never counted, and the refusal aborts the install."""
    from kvpack.handoff.receiver import Receiver, ReceiverConfig
    from kvpack.handoff.sender import Sender
    from kvpack.node.wire import TileGeometry, pack_tile
    from tests.handoff._support import KEY, KEY_ID, NOW, MemoryLedger, manifest

    engine = ArrayEngine(array_layout(layers=2, kv_heads=1, head_dim=4, dtype="f32"))
    geometry = TileGeometry.of(engine.layout)
    prompt = tuple(range(100, 700))
    session, reference = engine.new_session(), engine.new_session()
    reference.prefill(list(prompt))
    m = manifest(prompt, deferred=True)
    sender = Sender(m, KEY)
    stream = bytearray(b"".join(bytes(b) for b in sender.begin()))
    payloads = []
    for seg in geometry.schedule(len(prompt)):
        payloads.append(bytes(pack_tile(reference, geometry, seg)))
        stream += b"".join(bytes(b) for b in sender.send_segment(payloads[-1], seg))
    stream += b"".join(bytes(b) for b in sender.seal())
    if tamper:
        stream[stream.index(payloads[1]) + 1000] ^= 0x01

    shared = _in_place_shared(engine, session, geometry)
    sink = StripeSink(shared, 0)
    ledger = MemoryLedger()
    with ThreadPoolExecutor(2) as pool:
        rx = Receiver(ReceiverConfig(key=KEY, key_id=KEY_ID, minimum_epoch=1, layout=geometry.span), sink, ledger, now_unix_ms=NOW, hash_executor=pool)
        try:
            for i in range(0, len(stream), 4096):
                rx.receive_data(stream[i : i + 4096])
            rx.eof()
        except ProtocolError as exc:
            assert tamper and exc.category == "digest"
    if not tamper:
        assert shared.committed and sink.in_place == 3 and session.position == len(prompt)
        for layer in (0, 1):
            for role in ("k", "v"):
                assert bytes(session.export_rows(layer, role, 0, 600)) == bytes(reference.export_rows(layer, role, 0, 600))
        return
    install = shared.install
    assert sink.in_place == 1  # the first segment landed; the tampered second never counted
    assert install.state == "aborted" and install._planes == {}  # released with the refusal
    assert session.position == 0 and not shared.committed
    assert ("reserve", 1) not in ledger.calls


def test_striped_installs_into_recycled_planes_hold_exactly_each_transfers_rows():
    """With the arrays engine's plane pool on (every plane pooled), the third striped install
    of a session is written into the planes of the first (the session moved on from them),
    by two stripes at once, and holds exactly that transfer's rows; a view of the second
    transfer's rows taken before keeps its bytes."""
    from kvpack.engine.arrays import PlanePool

    engine = ArrayEngine(array_layout(layers=2, kv_heads=1, head_dim=4))
    engine.planes = PlanePool(1 << 30, min_bytes=1)
    session = engine.new_session()
    kept = None
    for round_ in range(3):
        reference = engine.new_session()
        reference.prefill([100 * round_ + t for t in range(1, ROWS + 1)])
        shared = SharedInstall(
            2,
            lambda m, cut: session.begin_install(m.position, list(m.prompt_token_ids), engine.identity),
            lambda install, rows, payload: install.write_rows(rows[0], rows[1], rows[2], payload),
            time.monotonic() + 30,
        )
        with ThreadPoolExecutor(4) as pool:
            sinks = [StripeSink(shared, i, pool) for i in range(2)]
            for sink in sinks:
                sink.begin(_Manifest, 0)

            def run(sink, i, reference=reference) -> None:
                for rows, payload in _pieces(reference, i, 2):
                    sink.write_segment(rows, payload)
                sink.prepare()
                sink.commit()

            threads = [threading.Thread(target=run, args=(sink, i)) for i, sink in enumerate(sinks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
        assert shared.committed
        for layer in (0, 1):
            for role in ("k", "v"):
                assert bytes(session.export_rows(layer, role, 0, ROWS)) == bytes(reference.export_rows(layer, role, 0, ROWS))
        if round_ == 1:
            kept = (session.export_rows(1, "v", 0, ROWS), bytes(reference.export_rows(1, "v", 0, ROWS)))
        del shared, sinks, threads
    assert engine.planes.stats()["reused"] == 4  # the third install took the first one's 4 planes
    assert kept is not None and bytes(kept[0]) == kept[1]
