"""kvpack.testing.ports: ports handed to services before they bind are outside the
ephemeral range, distinct, and free."""

from __future__ import annotations

import socket

from kvpack.testing import ports


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    low = ports.ephemeral_low()
    got = ports.free_ports(20)
    assert len(set(got)) == 20
    for port in got:
        assert ports.FLOOR <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # nothing holds it


def test_a_held_port_is_never_handed_out(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:
        taken = held.getsockname()[1]
        seq = iter([taken, taken, taken])
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 60000)
        monkeypatch.setattr(ports._rng, "randrange", lambda a, b: next(seq, 20001))
        ports._given.discard(20001)
        assert ports.free_port() == 20001
    finally:
        held.close()


def test_no_room_below_the_range_falls_back_to_port_zero(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.FLOOR + 10)
    port = ports.free_port()
    assert port > 0


def test_an_unreadable_range_reads_as_the_kernel_default(tmp_path):
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768
    bad = tmp_path / "range"
    bad.write_text("garbage\n")
    assert ports.ephemeral_low(str(bad)) == 32768
    bad.write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(bad)) == 40000
