"""The durable-I/O seam and its fault layer: old-or-new after a crash at every step, EIO
reported with its step, and (regression) a crash restores the old file with its old mode."""

from __future__ import annotations

import os
import time

import pytest

from kvpack.durable import atomic_write, durable_unlink, ensure_dir
from kvpack.errors import DurableIOError
from kvpack.testing.faults import FaultyOps, SimulatedCrash


def read(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def temps(directory) -> list[str]:
    return [n for n in os.listdir(directory) if n.endswith(".tmp")]


def test_atomic_write_replaces_with_mode_0600(tmp_path):
    target = tmp_path / "f"
    atomic_write(target, b"one")
    atomic_write(target, [b"t", memoryview(b"wo")])
    assert read(target) == b"two"
    assert os.stat(target).st_mode & 0o777 == 0o600
    assert temps(tmp_path) == []


@pytest.mark.parametrize("crash_at", range(1, 7))
def test_crash_at_every_step_leaves_old_or_new(tmp_path, crash_at):
    target = tmp_path / "f"
    atomic_write(target, b"old")
    ops = FaultyOps(crash_at=crash_at)
    try:
        atomic_write(target, b"new", ops=ops)
        crashed = False
    except SimulatedCrash:
        crashed = True
    assert crashed == (crash_at <= 5)
    assert read(target) == (b"old" if crashed else b"new")
    # The restored file is the old one in every respect, including its permission bits.
    assert os.stat(target).st_mode & 0o777 == 0o600
    assert temps(tmp_path) == []


def test_fsync_eio_is_reported_and_target_untouched(tmp_path):
    target = tmp_path / "f"
    atomic_write(target, b"old")
    with pytest.raises(DurableIOError) as info:
        atomic_write(target, b"new", ops=FaultyOps(fail_ops={"fsync"}))
    assert info.value.category == "fsync"
    assert read(target) == b"old" and temps(tmp_path) == []


def test_crash_after_unlink_restores_file_and_mode(tmp_path):
    target = tmp_path / "f"
    atomic_write(target, b"keep", mode=0o640)
    ops = FaultyOps(crash_at=2)  # unlink done, crash before the directory fsync
    with pytest.raises(SimulatedCrash):
        durable_unlink(target, ops=ops)
    assert read(target) == b"keep"
    assert os.stat(target).st_mode & 0o777 == 0o640


def test_delay_applies_to_its_step(tmp_path):
    ops = FaultyOps(delays={"dirsync": 0.05})
    start = time.perf_counter()
    atomic_write(tmp_path / "f", b"x", ops=ops)
    assert time.perf_counter() - start >= 0.05
    assert ops.log == ["open", "write", "fsync", "rename", "dirsync"]


def test_ensure_dir_creates_parents(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    ensure_dir(target)
    assert target.is_dir() and os.stat(target).st_mode & 0o777 == 0o700
    ensure_dir(target)  # idempotent
