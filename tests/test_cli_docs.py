"""docs/cli.md is exactly what scripts/gen_cli_doc.py renders from the live parsers, and every
argument of every command carries help text (so `--help` and the doc explain every flag)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from kvpack.cli import build_parser, leaf_parsers

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_doc", ROOT / "scripts" / "gen_cli_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_doc_is_current(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    expected = _generator().render()
    doc = (ROOT / "docs" / "cli.md").read_text()
    assert doc == expected, "docs/cli.md is stale: run python3 scripts/gen_cli_doc.py and commit the result"


def test_every_argument_has_help():
    missing = []
    for words, parser in leaf_parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip():
                missing.append(f"kvpack {' '.join(words)} {action.option_strings or action.dest}")
    assert not missing, "arguments without help text: " + "; ".join(missing)


def test_exit_code_table_is_in_the_doc():
    from kvpack.cli_errors import EXIT_CODES

    doc = (ROOT / "docs" / "cli.md").read_text()
    for code, name, _meaning in EXIT_CODES:
        assert f"| **{code}** | {name} |" in doc
