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
