"""Regenerate docs/cli.md from the live argparse parsers (run after adding a command)."""

from __future__ import annotations

import argparse
import io
import os
from contextlib import redirect_stdout

from kvpack.cli import build_parser

HEADER = """# Command line (`kvpack`)

Generated from the parsers by `python3 scripts/gen_cli_doc.py`; every command prints the
same with `--help`. Exit codes everywhere: **0** ok, **1** refused or failed (a refusal is
printed as `refused <category>: <message>`), **2** usage errors (bad arguments, unreadable
or unsafe key files).

"""


def _help(parser: argparse.ArgumentParser) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        parser.print_help()
    return buf.getvalue().rstrip()


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def main() -> None:
    os.environ["COLUMNS"] = "100"
    root = build_parser()
    out = [HEADER, "```", _help(root), "```", ""]
    for name, sub in _subparsers(root):
        out += [f"## kvpack {name}", "", "```", _help(sub), "```", ""]
        for child, subsub in _subparsers(sub):
            out += [f"### kvpack {name} {child}", "", "```", _help(subsub), "```", ""]
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "cli.md")
    with open(path, "w") as fh:
        fh.write("\n".join(out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
