"""Key-file contract (C.10, errata L10/M7): each violation refused with its own message, and the
file itself is left exactly as it was."""

from __future__ import annotations

import os

import pytest

from kvpack.errors import SecurityError
from kvpack.security.secret_files import (
    load_hmac_key,
    load_private_key_pem,
    parse_hmac_key,
    read_protected_file,
)

KEY = bytes(range(32))


def write(path, data: bytes, mode: int = 0o600) -> str:
    with open(path, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)
    return str(path)


def refused(path, **kw) -> str:
    before = _snapshot(path)
    with pytest.raises(SecurityError) as info:
        load_hmac_key(path, **kw)
    assert info.value.category == "secret_file"
    assert _snapshot(path) == before  # a refusal never rewrites or re-links the file
    return info.value.message


def _snapshot(path):
    st = os.lstat(path)
    if os.path.isfile(path):
        with open(path, "rb") as fh:
            return st.st_ino, st.st_mode, fh.read()
    return st.st_ino, st.st_mode, None


def test_accepted_forms(tmp_path):
    assert load_hmac_key(write(tmp_path / "raw", KEY)) == KEY
    assert load_hmac_key(write(tmp_path / "hex", KEY.hex().encode())) == KEY
    assert load_hmac_key(write(tmp_path / "hexnl", KEY.hex().encode() + b"\n")) == KEY
    assert load_hmac_key(write(tmp_path / "hexcrlf", KEY.hex().encode() + b"\r\n")) == KEY
    # A raw key whose bytes happen to end in a newline is still a raw key (exactly 32 bytes).
    raw_nl = bytes(31) + b"\n"
    assert load_hmac_key(write(tmp_path / "rawnl", raw_nl)) == raw_nl


def test_each_violation_has_its_own_message(tmp_path):
    messages: dict[str, str] = {}

    target = write(tmp_path / "real.key", KEY.hex().encode() + b"\n")
    link = tmp_path / "link.key"
    os.symlink(target, link)
    messages["symlink"] = refused(str(link))

    messages["group_readable"] = refused(write(tmp_path / "group.key", KEY, 0o640))
    messages["other_readable"] = refused(write(tmp_path / "other.key", KEY, 0o604))

    swapped = write(tmp_path / "swap.key", KEY)
    impostor = write(tmp_path / "impostor.key", bytes(32))

    def swap(path: str) -> None:
        os.replace(impostor, path)  # same name, new inode, between lstat and open

    with pytest.raises(SecurityError) as info:
        load_hmac_key(swapped, before_open=swap)
    assert info.value.category == "secret_file"
    messages["swapped"] = info.value.message
    assert "replaced between lstat and open" in messages["swapped"]

    racy = write(tmp_path / "racy.key", KEY)
    elsewhere = write(tmp_path / "elsewhere.key", bytes(32))

    def to_symlink(path: str) -> None:
        os.unlink(path)
        os.symlink(elsewhere, path)

    with pytest.raises(SecurityError) as info:
        load_hmac_key(racy, before_open=to_symlink)
    messages["symlink_race"] = info.value.message
    assert "O_NOFOLLOW" in messages["symlink_race"]

    messages["oversize"] = refused(write(tmp_path / "big.key", b"0" * 4097))
    messages["uppercase"] = refused(write(tmp_path / "upper.key", KEY.hex().upper().encode() + b"\n"))
    messages["short31"] = refused(write(tmp_path / "short.key", bytes(31)))
    messages["nonhex"] = refused(write(tmp_path / "nonhex.key", b"g" * 64))
    messages["leading_space"] = refused(write(tmp_path / "space.key", b" " + KEY.hex().encode()))
    messages["not_utf8"] = refused(write(tmp_path / "bin.key", b"\xff" * 33))
    os.mkfifo(tmp_path / "fifo.key", 0o600)
    messages["not_regular"] = refused(str(tmp_path / "fifo.key"))
    with pytest.raises(SecurityError) as info:
        load_hmac_key(tmp_path / "missing.key")
    messages["missing"] = info.value.message

    # Every rule names itself: no two violations share a message shape.
    shapes = {k: m.split("'", 2)[-1] for k, m in messages.items()}
    assert len(set(shapes.values())) == len(shapes), shapes
    assert "symlink" in shapes["symlink"]
    assert "group/other" in shapes["group_readable"] and "chmod 600" in shapes["group_readable"]
    assert "4096-byte limit" in shapes["oversize"]
    assert "uppercase" in shapes["uppercase"]
    assert "31 bytes" in shapes["short31"]


def test_private_key_bound_and_mode(tmp_path):
    ok = write(tmp_path / "k.pem", b"-----BEGIN PRIVATE KEY-----\n")
    assert load_private_key_pem(ok).startswith(b"-----BEGIN")
    with pytest.raises(SecurityError) as info:
        load_private_key_pem(write(tmp_path / "k2.pem", b"x", 0o644))
    assert "TLS private key" in info.value.message and "group/other" in info.value.message
    with pytest.raises(SecurityError) as info:
        load_private_key_pem(write(tmp_path / "k3.pem", b"x" * ((1 << 20) + 1)))
    assert "limit" in info.value.message


def test_reader_category_is_configurable(tmp_path):
    with pytest.raises(SecurityError) as info:
        read_protected_file(write(tmp_path / "l.json", b"{}", 0o644), what="replay ledger", max_size=10, category="ledger")
    assert info.value.category == "ledger"


def test_parse_rules_directly():
    assert parse_hmac_key(KEY.hex().encode() + b"\n\r\n") == KEY  # only trailing CR/LF trimmed
    with pytest.raises(SecurityError):
        parse_hmac_key(KEY.hex().encode() + b"\t\n")
    with pytest.raises(SecurityError):
        parse_hmac_key(b"")
