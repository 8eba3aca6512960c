"""The ``kvpack`` command line.

Each command group lives in its own module under :mod:`kvpack.commands` and exposes
``register(subparsers)``; this module discovers them, adds the global options to every
command, parses, runs, and turns every exception into the error contract of
:mod:`kvpack.cli_errors` (one line ``kvpack: <category>: <message>`` on stderr, one exit code
from its table, never a traceback unless ``--debug``). Command modules are imported lazily
per command, so ``kvpack inspect`` does not pay for importing torch.

Global options (accepted before or after the command): ``--json`` (one JSON document on
stdout for commands that produce a result), ``--log-level``, ``--log-file`` (JSON-lines logs,
:mod:`kvpack.logs`) and ``--debug``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import traceback
from collections.abc import Iterator

from . import cli_errors
from . import commands as _commands_pkg
from .errors import UsageError
from .logs import LEVELS

GLOBAL_HELP = "global options (also accepted after the command)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for options with a real default (not for flags or None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS, []) or action.nargs == 0:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


class KvpackParser(argparse.ArgumentParser):
    """argparse with the error contract: a usage error raises instead of printing and exiting."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        raise UsageError("usage", f"{self.prog}: {message} (see '{self.prog} --help')")


def _add_global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The same four options at the top level (with defaults) and on every command (SUPPRESS,
    so a value given before the command is not overwritten by the command's default)."""
    existing = {s for a in parser._actions for s in a.option_strings}
    group = parser.add_argument_group(GLOBAL_HELP) if suppress else parser

    def default(value):
        return argparse.SUPPRESS if suppress else value

    if "--json" in existing:  # a command that declared its own --json: share the top-level value
        for action in parser._actions:
            if "--json" in action.option_strings:
                action.default = argparse.SUPPRESS
    else:
        group.add_argument("--json", action="store_true", default=default(False), help="print the result as one JSON document on stdout")
    if "--log-level" not in existing:
        group.add_argument(
            "--log-level",
            choices=LEVELS,
            default=default(None),
            help="JSON-lines log level (default: info for the daemons, warning otherwise)",
        )
    if "--log-file" not in existing:
        group.add_argument("--log-file", metavar="PATH", default=default(None), help="append logs to PATH (created 0600) instead of stderr")
    if "--debug" not in existing:
        group.add_argument("--debug", action="store_true", default=default(False), help="print a traceback with any error")


def subparsers_of(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def leaf_parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every runnable command as (words, parser), e.g. (("store", "ls"), <parser>)."""
    children = list(subparsers_of(parser))
    if not children and prefix:
        yield prefix, parser
    for name, child in children:
        yield from leaf_parsers(child, prefix + (name,))


def build_parser() -> argparse.ArgumentParser:
    parser = KvpackParser(
        prog="kvpack",
        description="Persist, move and migrate LLM KV caches exactly and provably.",
        epilog="Errors print one line 'kvpack: <category>: <message>' on stderr; exit codes are listed in docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"kvpack {__import__('kvpack').__version__}")
    _add_global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(_commands_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_commands_pkg.__name__}.{info.name}")
        module.register(sub)
    for _words, leaf in leaf_parsers(parser):
        _add_global_options(leaf, suppress=True)
    return parser


def _command_name(argv: list[str]) -> str | None:
    words = [a for a in argv if not a.startswith("-")]
    return " ".join(words[:2]) if words else None


def _silence_stdout() -> None:
    """After EPIPE on stdout: point fd 1 at /dev/null so the interpreter's final flush does
    not print 'Exception ignored ... BrokenPipeError'."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _report(outcome: cli_errors.Outcome) -> None:
    if outcome.code == cli_errors.BROKEN_PIPE:
        _silence_stdout()
        return
    try:
        print(outcome.line(), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _prepare(args: argparse.Namespace) -> None:
    """Logging, progress and third-party quieting, before the command runs."""
    from . import logs, progress

    level = args.log_level or getattr(args, "log_default", None) or "warning"
    try:
        logs.configure(level, args.log_file)
    except OSError as exc:
        raise UsageError("file", f"--log-file {args.log_file!r}: {exc.strerror}") from None
    progress.set_quiet(bool(args.json))
    progress.quiet_third_party(force=bool(args.json))
    # a command that always needs an extra says so before it starts (all of them at once)
    missing = cli_errors.missing_extras(getattr(args, "extras", ()))
    if missing:
        from .errors import MissingExtraError

        names = " and ".join(f"'{e}'" for e in missing)
        raise MissingExtraError(
            "missing_extra",
            f"kvpack {' '.join([args.command, *_subcommand_words(args)])} needs the {names} extra{'s' if len(missing) > 1 else ''}: "
            f"pip install 'kvpack[{','.join(missing)}]'",
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    command = _command_name(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = " ".join(w for w in (args.command, *_subcommand_words(args)) if w)
        _prepare(args)
        rc = args.func(args)
        sys.stdout.flush()
        return int(rc or 0)
    except SystemExit as exc:  # --help, --version (argparse exits after printing)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else cli_errors.USAGE)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
            return cli_errors.BROKEN_PIPE
        return code
    except BaseException as exc:  # noqa: BLE001 - the contract: every failure is one line
        if debug and not isinstance(exc, BrokenPipeError):
            traceback.print_exc(file=sys.stderr)
        try:
            outcome = cli_errors.classify(exc, command=command)
        except Exception:  # noqa: BLE001 - the mapping itself must never end in a traceback
            outcome = cli_errors.Outcome("internal", f"{type(exc).__name__} (run again with --debug for the traceback)", cli_errors.INTERNAL)
        _report(outcome)
        return outcome.code
    finally:
        from .logs import reset

        reset()


def _subcommand_words(args: argparse.Namespace) -> list[str]:
    return [v for k, v in sorted(vars(args).items()) if k.endswith("_command") and isinstance(v, str)]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
