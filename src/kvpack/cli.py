"""The ``kvpack`` command line.

Each command group lives in its own module under :mod:`kvpack.commands` and exposes
``register(subparsers)``; this module only discovers them, parses, and maps errors to exit
codes (0 ok, 1 refused / failed, 2 usage). Modules are imported lazily per command so that
``kvpack inspect`` does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from . import commands as _commands_pkg
from .errors import KvpackError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpack",
        description="Persist, move and migrate LLM KV caches exactly and provably.",
    )
    parser.add_argument("--version", action="version", version=f"kvpack {__import__('kvpack').__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(_commands_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_commands_pkg.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except KvpackError as exc:
        print(f"refused {exc.category}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        # a full disk (ENOSPC), a failing one (EIO), a vanished path: one line, never a trace
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        print(f"refused io: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
