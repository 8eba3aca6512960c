"""kvpack's own progress display: the decode bar shown on a terminal decodes exactly what the
plain path decodes (same tokens, same final cache), and off a terminal nothing is drawn."""

from __future__ import annotations

import pytest

from kvpack import generate, progress
from kvpack.engine.registry import load_engine


def _session(engine, prompt: list[int]):
    session = engine.new_session()
    session.prefill(prompt)
    return session


@pytest.mark.parametrize("n", [1, 7, 9])
def test_decode_bar_decodes_what_the_plain_path_decodes(monkeypatch, capsys, n):
    engine = load_engine("arrays:4:2:8")
    prompt = list(range(3, 40))
    plain = _session(engine, prompt)
    expected, _rows = plain.decode_greedy(n)
    stop = expected[len(expected) // 2]  # a stop token met part-way through

    monkeypatch.setattr(progress, "interactive", lambda: True)
    shown = _session(engine, prompt)
    assert generate.decode_with_progress(shown, n, []) == expected
    assert shown.position == plain.position and shown.cache_digest() == plain.cache_digest()
    stopped = _session(engine, prompt)
    reference = _session(engine, prompt).decode_greedy(n, stop_token_ids=[stop])[0]
    assert generate.decode_with_progress(stopped, n, [stop]) == reference


def test_no_bar_off_a_terminal(capsys):
    engine = load_engine("arrays:4:2:8")
    assert not progress.interactive()  # pytest captures stderr: not a terminal
    tokens = generate.decode_with_progress(_session(engine, [5, 6, 7]), 5, [])
    assert len(tokens) == 5 and capsys.readouterr().err == ""
