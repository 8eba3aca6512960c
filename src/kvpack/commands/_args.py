"""Argument types shared by every command: ranges and files are checked at parse time.

An argparse ``type=`` that raises :class:`argparse.ArgumentTypeError` becomes the usage line
``kvpack: usage: ... argument --days: must be an integer >= 1, got '-5'`` and exit 2 before
any work starts, so no command ever runs with ``--days -5``, ``--threads 0`` or a socket path
the kernel cannot bind. Helpers here also read the small local files commands take
(JSON token lists, host keys) and raise :class:`kvpack.errors.UsageError` with the path and
what is wrong, never a bare ``OSError`` or ``ValueError``.

Only the standard library is imported here: this module loads for ``kvpack --help``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from ..errors import UsageError

#: Linux ``sockaddr_un.sun_path`` holds 108 bytes including the terminating NUL
UNIX_PATH_MAX = 107
#: a prompt longer than this is refused by every engine kvpack ships (2^20 tokens)
MAX_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1


def _int(text: str) -> int:
    try:
        return int(text, 10)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def int_range(lo: int, hi: int | None = None, *, what: str = "an integer") -> Callable[[str], int]:
    """An int in ``[lo, hi]`` (``hi`` None: unbounded above)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}")
        return value

    parse.__name__ = f"int[{lo}..{'' if hi is None else hi}]"
    return parse


positive_int = int_range(1)
nonneg_int = int_range(0)
port = int_range(1, 65535, what="a TCP port")
port_or_zero = int_range(0, 65535, what="a TCP port (0: any free port)")
days = int_range(1, 36500, what="a number of days")
threads = int_range(1, 1024, what="a thread count")
max_new_tokens = int_range(0, 1 << 16, what="a token count")
token_position = int_range(1, MAX_TOKENS, what="a token position")


def float_range(lo: float, hi: float | None = None, *, lo_open: bool = False, what: str = "a number") -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        bad = not math.isfinite(value) or value < lo or (lo_open and value == lo) or (hi is not None and value > hi)
        if bad:
            low = f"> {lo:g}" if lo_open else f">= {lo:g}"
            bound = low if hi is None else f"{low} and <= {hi:g}"
            raise argparse.ArgumentTypeError(f"must be {what} {bound}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


nonneg_float = float_range(0.0)
positive_float = float_range(0.0, lo_open=True)

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def duration(text: str) -> float:
    """Seconds: ``30``, ``2.5``, ``500ms``, ``10s``, ``5m``, ``1h``; > 0 and at most 7 days."""
    match = _DURATION.fullmatch(text or "")
    if not match:
        raise argparse.ArgumentTypeError(f"must be a duration such as 30, 2.5s, 500ms, 5m or 1h, got {text!r}")
    seconds = float(match.group(1)) * _UNIT[match.group(2)]
    if not 0 < seconds <= 7 * 86400:
        raise argparse.ArgumentTypeError(f"must be a duration > 0 and at most 7 days, got {text!r}")
    return seconds


duration.__name__ = "duration"


def duration_at_most(limit_s: float) -> Callable[[str], float]:
    """A :func:`duration` of at most ``limit_s`` seconds (a flag whose consumer has a bound)."""

    def parse(text: str) -> float:
        seconds = duration(text)
        if seconds > limit_s:
            raise argparse.ArgumentTypeError(f"must be a duration of at most {limit_s:g} s, got {text!r}")
        return seconds

    parse.__name__ = "duration"
    return parse


def socket_address(*, allow_port_zero: bool = True) -> Callable[[str], str]:
    """``ip:port`` or ``[ipv6]:port`` (an IP literal); returned as given."""

    def parse(text: str) -> str:
        from ..errors import SecurityError
        from ..security.config import parse_socket_address

        try:
            parse_socket_address(text, "address", allow_port_zero=allow_port_zero)
        except SecurityError as exc:
            raise argparse.ArgumentTypeError(exc.message.replace("address ", "", 1)) from None
        return text

    parse.__name__ = "address"
    return parse


def _unix_path_problem(path: str) -> str | None:
    size = len(os.fsencode(path))
    if size > UNIX_PATH_MAX:
        return f"unix socket path {path!r} is {size} bytes; Linux allows {UNIX_PATH_MAX} (choose a shorter path)"
    return None


def unix_socket_path(text: str) -> str:
    problem = _unix_path_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def refuse_ignored(given: list[tuple[str, bool]], *, because: str) -> None:
    """Options that ``because`` (another option given) would make the command ignore are a
    usage error: ``--no-store --store X`` must not run without the store the operator named."""
    ignored = [name for name, present in given if present]
    if ignored:
        raise UsageError("usage", f"{', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with {because}: drop one")


def check_unix_socket_path(path: str) -> None:
    """Refuse a path the kernel cannot bind or connect to (longer than 107 bytes)."""
    problem = _unix_path_problem(path)
    if problem:
        raise UsageError("usage", problem)


def _kind(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if stat.S_ISREG(st.st_mode):
        return "a regular file"
    return "not a regular file"


def existing_file(text: str) -> str:
    """A path that names an existing regular file (symlinks to one are fine)."""
    try:
        st = os.stat(text)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text!r} does not exist") from None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text!r} is {_kind(st)}, not a file")
    return text


def existing_dir(text: str) -> str:
    try:
        st = os.stat(text)
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text!r} does not exist") from None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise argparse.ArgumentTypeError(f"{text!r} is {_kind(st)}, not a directory")
    return text


def not_a_file(text: str) -> str:
    """A directory to create or use: refuses a path that exists and is not a directory, or
    that lies below a file (``file.txt/sub``); s3:// locations pass through unchanged."""
    if text.startswith("s3://"):
        return text
    if not text:
        raise argparse.ArgumentTypeError("must be a directory path, got ''")
    if os.path.exists(text):
        if not os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
        return text
    parent = os.path.dirname(os.path.abspath(text))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r} lies below {parent!r}, which is not a directory")
    return text


not_a_file.__name__ = "directory"


def hex_id(nbytes: int) -> Callable[[str], str]:
    pattern = re.compile(rf"^[0-9a-f]{{{2 * nbytes}}}$")

    def parse(text: str) -> str:
        if not pattern.fullmatch(text):
            raise argparse.ArgumentTypeError(f"must be {2 * nbytes} lowercase hex digits, got {text!r}")
        return text

    parse.__name__ = "id"
    return parse


def read_small_file(path: str, *, what: str, max_bytes: int, binary: bool = False) -> Any:
    """A small local input file, as text (or bytes), with every failure a UsageError('file')."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError("file", f"{what} {path!r} is {_kind(st)}, not a file")
        if st.st_size > max_bytes:
            raise UsageError("file", f"{what} {path!r} is {st.st_size} bytes; at most {max_bytes} are accepted")
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise UsageError("file", f"cannot read {what} {path!r}: {exc.strerror}") from None
    if binary:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("file", f"{what} {path!r} is not UTF-8 text") from None


def read_token_ids(path: str, *, stdin_text: str | None = None) -> list[int]:
    """A JSON list of token ids (``-``: stdin), each an int in ``[0, 2^31)``; 1..2^20 of them."""
    text = stdin_text if path == "-" and stdin_text is not None else read_small_file(path, what="tokens file", max_bytes=64 << 20)
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError("file", f"tokens file {path!r} is not JSON: {exc}") from None
    if not isinstance(value, list) or not value:
        raise UsageError("file", f"tokens file {path!r} must hold a non-empty JSON list of token ids")
    if len(value) > MAX_TOKENS:
        raise UsageError("file", f"tokens file {path!r} holds {len(value)} tokens; at most {MAX_TOKENS}")
    for i, tok in enumerate(value):
        if type(tok) is not int or not 0 <= tok <= MAX_TOKEN_ID:
            raise UsageError("file", f"tokens file {path!r}: item {i} is {tok!r}, not a token id (an integer in 0..{MAX_TOKEN_ID})")
    return value


def engine_spec(text: str) -> str:
    """An ``--engine`` value the engine registry accepts (parsed without loading anything)."""
    from ..engine.registry import parse_spec
    from ..errors import EngineError

    try:
        return parse_spec(text).text
    except EngineError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


engine_spec.__name__ = "engine"
