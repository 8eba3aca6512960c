"""docs/cli.md documents every command the CLI has (regenerate with scripts/gen_cli_doc.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpack.cli import build_parser


def test_every_command_is_documented():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    root = build_parser()
    commands = [a for a in root._actions if isinstance(a, argparse._SubParsersAction)][0].choices
    missing = [name for name in commands if f"## kvpack {name}\n" not in doc]
    assert not missing, f"regenerate docs/cli.md (python3 scripts/gen_cli_doc.py): missing {missing}"
