"""Regenerate docs/cli.md from the live argparse parsers and the error contract (run after
adding or changing a command; tests/test_cli_docs.py checks the file is current)."""

from __future__ import annotations

import argparse
import io
import os
import sys
from contextlib import redirect_stdout

from kvpack.cli import build_parser, subparsers_of
from kvpack.cli_errors import EXIT_CODES

HEADER = """# Command line (`kvpack`)

Generated from the parsers by `python3 scripts/gen_cli_doc.py`; every command prints the
same with `--help`. Do not edit by hand.

## The error contract

Every command either succeeds or prints **one line on stderr**:

    kvpack: <category>: <message>

and exits with one of the codes below. The category is the typed refusal's category
(`authentication`, `replay`, `secret_file`, `no_store`, `address_in_use`, `unreachable`,
`missing_extra`, ...); the message names the file, address or id concerned. No command
prints a Python traceback unless it is given `--debug` (then the traceback comes first and
the line last). Argument values are checked when the command line is parsed (ranges, ports,
durations, days >= 1, existing files, socket path length), so a bad value costs nothing;
so are options another option would make the command ignore (`--no-store --store DIR`,
`--no-metrics --metrics-port N`, `request --tokens-file F --raw`, `transcode --out F --hex`).
Results go to stdout; with `--json` a command that produces a result prints it as one JSON
document. A report that finds problems (`kvpack store verify`, `kvpack ledger show`,
`kvpack probe-volume`, `kvpack verdict`) prints the report on stdout and then the one error
line; every other failure leaves stdout empty.

| exit | meaning | when |
| --- | --- | --- |
"""

GLOBALS = """
## Global options

`--json`, `--log-level {debug,info,warning,error}`, `--log-file PATH` and `--debug` are
accepted before the command (`kvpack --json store ls S`) or after it (`kvpack store ls S
--json`). Logs are JSON lines (one object per line: `ts`, `level`, `logger`, `event`, fields;
docs/operations.md, "Logs"), on stderr unless `--log-file` is given; the daemons log at
`info` by default (one line per transfer with its receipt id), every other command at
`warning`. Progress bars and spinners appear only when stderr is a terminal and `--json` is
not given; third-party bars (transformers' "Loading weights") are silenced otherwise.

"""


def _help(parser: argparse.ArgumentParser) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        parser.print_help()
    return buf.getvalue().rstrip()


def render() -> str:
    os.environ["COLUMNS"] = "100"
    root = build_parser()
    out = [HEADER.rstrip("\n")]
    for code, name, meaning in EXIT_CODES:
        out.append(f"| **{code}** | {name} | {meaning} |")
    out += [GLOBALS, "```", _help(root), "```", ""]
    for name, sub in subparsers_of(root):
        out += [f"## kvpack {name}", "", "```", _help(sub), "```", ""]
        for child, subsub in subparsers_of(sub):
            out += [f"### kvpack {name} {child}", "", "```", _help(subsub), "```", ""]
    return "\n".join(out)


def doc_path() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "cli.md")


def main() -> None:
    text = render()
    if "--check" in sys.argv[1:]:
        with open(doc_path(), encoding="utf-8") as fh:
            sys.exit(0 if fh.read() == text else 1)
    with open(doc_path(), "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {doc_path()}")


if __name__ == "__main__":
    main()
