"""Names and ids checked by a regular expression are matched whole: a trailing newline (which
Python's ``$`` accepts) is refused everywhere, not only in the migration API's route ids."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from kvpack.commands._args import duration, hex_id
from kvpack.errors import KvpackError
from kvpack.migrate.bundle import encode_bundle
from kvpack.migrate.storage_tier import host_key_fingerprint
from kvpack.onboard.ssh import parse_destination

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOv2"


def test_whole_inputs_still_accepted() -> None:
    assert parse_destination("kv@node-1") == ("kv", "node-1")
    assert host_key_fingerprint(KEY).startswith("SHA256:")
    assert duration("10s") == 10.0
    assert hex_id(2)("abcd") == "abcd"
    assert encode_bundle({"v": 1}, {"pack/a": b"x"})


@pytest.mark.parametrize(
    "call",
    [
        lambda: parse_destination("kv\n@node-1"),
        lambda: parse_destination("kv@node-1\n"),
        lambda: encode_bundle({"v": 1}, {"pack/a\n": b"x"}),
    ],
)
def test_trailing_newline_refused_with_a_category(call: Callable[[], object]) -> None:
    with pytest.raises(KvpackError):
        call()


@pytest.mark.parametrize("parse,text", [(hex_id(2), "abcd\n"), (hex_id(2), "abcd\n\n")])
def test_cli_parsers_refuse_trailing_newline(parse: Callable[[str], str], text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)
