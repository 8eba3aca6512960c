"""Progress display for long CLI work (model cache build, prefill, decode, transfers), via rich.

Shown only when stderr is a terminal and the command was not asked for ``--json``: logs and
machine output stay clean, and a pipe never receives spinner frames. Third-party progress bars
(transformers' "Loading weights", huggingface_hub downloads) follow the same rule through
:func:`quiet_third_party`, which the CLI calls before a command runs.

Everything here is a no-op off a terminal, so library code may wrap work in :func:`status` or
:func:`bar` unconditionally; it must never be used for anything a test or a script reads.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_quiet = False
#: rich allows one live display at a time: a display opened inside another is silently skipped
_active = threading.local()


def set_quiet(quiet: bool) -> None:
    """``--json`` (or a library caller) turns kvpack's own progress off even on a terminal."""
    global _quiet
    _quiet = quiet


def interactive() -> bool:
    if _quiet or int(getattr(_active, "depth", 0)):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def quiet_third_party(force: bool = False) -> None:
    """Silence third-party progress bars unless stderr is a terminal (``force``: always)."""
    if not force and interactive():
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TQDM_DISABLE"] = "1"
    tf_logging = sys.modules.get("transformers.utils.logging")
    if tf_logging is not None:  # imported before us: switch its flag directly
        tf_logging.disable_progress_bar()
    hub = sys.modules.get("huggingface_hub.utils")
    if hub is not None and hasattr(hub, "disable_progress_bars"):
        hub.disable_progress_bars()


@contextmanager
def status(message: str) -> Iterator[None]:
    """A spinner with ``message`` and the time elapsed while the block runs (terminal only):
    a wait whose length kvpack cannot count (a model load, a remote prefill) still shows
    that it is alive and for how long."""
    if not interactive():
        yield
        return
    try:
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:  # the node extra is not installed: no spinner, same work
        yield
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with _live(), Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        progress.add_task(message, total=None)
        yield


@contextmanager
def bar(description: str, total: float | None, *, unit: str = "tokens") -> Iterator[Callable[[float], None]]:
    """A progress bar; yields ``advance(n)``. ``unit`` ``bytes`` shows sizes and a rate."""
    if not interactive():
        yield lambda _n: None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn
    except ImportError:
        yield lambda _n: None
        return
    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn(), TextColumn(unit)]
    columns.append(TimeElapsedColumn())
    with _live(), Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)


@contextmanager
def _live() -> Iterator[None]:
    _active.depth = getattr(_active, "depth", 0) + 1
    try:
        yield
    finally:
        _active.depth -= 1
