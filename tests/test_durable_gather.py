"""Gathered writes through the durable seam: an object given as parts (header, payload,
padding) is written by one ``FileOps.write`` (``writev``), byte-exact even when the kernel
takes fewer bytes per call, and counts as one ``write`` step in the fault-injecting layer
(so crash-point numbering is the same as for one joined buffer)."""

from __future__ import annotations

import os

import pytest

from kvpack.durable import REAL_OPS, atomic_write
from kvpack.errors import DurableIOError
from kvpack.testing.faults import FaultyOps, SimulatedCrash

PARTS = (b"H" * 4096, bytearray(b"f" * 16), memoryview(bytes(range(256)) * 300), b"", b"\0" * 1000)
WHOLE = b"".join(PARTS)


def test_parts_are_written_in_order(tmp_path):
    target = tmp_path / "obj"
    assert atomic_write(target, PARTS, replace=False)
    assert target.read_bytes() == WHOLE
    assert atomic_write(target, iter(PARTS[::-1]))  # any iterable of buffers
    assert target.read_bytes() == b"".join(PARTS[::-1])


def test_short_writev_calls_still_write_every_byte(tmp_path, monkeypatch):
    real = os.writev
    calls = []

    def short(fd, buffers):
        calls.append(len(buffers))
        first = bytes(buffers[0])[:777]  # the kernel may take fewer bytes than offered
        return real(fd, [first])

    monkeypatch.setattr(os, "writev", short)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        REAL_OPS.write(fd, list(PARTS))
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == WHOLE
    assert len(calls) > len(PARTS)


def test_a_multi_part_object_is_one_write_step(tmp_path):
    ops = FaultyOps()
    atomic_write(tmp_path / "a", PARTS, ops=ops)
    assert ops.log == ["open", "write", "fsync", "rename", "dirsync"]


def test_crash_before_the_gathered_write_leaves_nothing(tmp_path):
    ops = FaultyOps(crash_at=2)  # open, then power loss before the write
    with pytest.raises(SimulatedCrash):
        atomic_write(tmp_path / "a", PARTS, ops=ops)
    assert os.listdir(tmp_path) == []


def test_a_failed_gathered_write_refuses_and_installs_nothing(tmp_path):
    ops = FaultyOps(fail_ops={"write"})
    with pytest.raises(DurableIOError) as err:
        atomic_write(tmp_path / "a", PARTS, ops=ops)
    assert err.value.category == "write"
    assert os.listdir(tmp_path) == []
