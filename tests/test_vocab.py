"""kvpack.vocab: the shared words (alignment, digests, hex ids, strict JSON, single-writer lock)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from kvpack.vocab import (
    TOKEN_ALIGN,
    FileLock,
    LockHeld,
    StrictJsonError,
    align_tokens_down,
    is_hex64,
    is_token_aligned,
    sha256_hex,
    strict_json_loads,
)


def test_one_token_alignment_everywhere():
    from kvpack.engine.transformers_adapter import REUSE_BLOCK_TOKENS
    from kvpack.format.constants import PREFIX_BLOCK_TOKENS
    from kvpack.handoff.schedule import PREFIX_CUT_ALIGN
    from kvpack.node.wire import TILE_TOKENS

    assert TOKEN_ALIGN == 256
    assert PREFIX_BLOCK_TOKENS is TOKEN_ALIGN and PREFIX_CUT_ALIGN is TOKEN_ALIGN
    assert REUSE_BLOCK_TOKENS is TOKEN_ALIGN and TILE_TOKENS is TOKEN_ALIGN


@pytest.mark.parametrize("n, aligned, down", [(0, True, 0), (1, False, 0), (255, False, 0), (256, True, 256), (257, False, 256), (1023, False, 768)])
def test_alignment_helpers(n, aligned, down):
    assert is_token_aligned(n) is aligned
    assert align_tokens_down(n) == down


def test_sha256_hex_of_bytes_views_and_text():
    want = hashlib.sha256(b"kvpack").hexdigest()
    assert sha256_hex(b"kvpack") == sha256_hex(bytearray(b"kvpack")) == sha256_hex(memoryview(b"kvpack")) == sha256_hex("kvpack") == want


@pytest.mark.parametrize(
    "value, ok",
    [
        ("0" * 64, True),
        ("ab" * 32, True),
        ("0" * 64 + "\n", False),  # `$` would have accepted this one
        ("0" * 63, False),
        ("0" * 65, False),
        ("A" * 64, False),
        (b"0" * 64, False),
        (None, False),
    ],
)
def test_hex64_is_a_full_match(value, ok):
    assert is_hex64(value) is ok


@pytest.mark.parametrize(
    "raw",
    [b'{"a": 1, "a": 2}', b'{"x": {"k": 1, "k": 1}}', b"[NaN]", b'{"v": Infinity}', b"-Infinity", b'"\xff"', b"{", b""],
)
def test_strict_json_refusals(raw):
    with pytest.raises(StrictJsonError):
        strict_json_loads(raw)


def test_strict_json_accepts_plain_json():
    assert strict_json_loads(b'{"a": [1, 2.5, "\xc3\xa9", null, true]}') == {"a": [1, 2.5, "é", None, True]}
    assert strict_json_loads('{"b": {}}') == {"b": {}}


def test_exclusive_lock_refuses_a_second_holder_until_released(tmp_path):
    path = str(tmp_path / "x.lock")
    first = FileLock(path, record_pid=True).acquire()
    with pytest.raises(LockHeld) as info:
        FileLock(path).acquire()  # flock: a second open file description conflicts, same process too
    assert info.value.holder_pid == os.getpid()
    assert not FileLock(path).held
    first.release()
    first.release()  # idempotent
    with FileLock(path) as again:
        assert again.held
    assert not again.held
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_shared_locks_coexist_and_exclude_an_exclusive_one(tmp_path):
    path = str(tmp_path / "rw.lock")
    with FileLock(path, shared=True), FileLock(path, shared=True):
        with pytest.raises(LockHeld):
            FileLock(path).acquire()
    FileLock(path).acquire().release()


def test_lock_dies_with_its_process(tmp_path):
    path = str(tmp_path / "p.lock")
    code = f"from kvpack.vocab import FileLock; FileLock({path!r}).acquire(); print('held', flush=True); import sys; sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld):
            FileLock(path).acquire()
    finally:
        proc.kill()
        proc.wait(timeout=10)
    FileLock(path).acquire().release()


def test_lock_never_follows_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "l.lock"
    link.symlink_to(target)
    with pytest.raises(OSError):
        FileLock(str(link)).acquire()
