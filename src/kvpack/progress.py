"""Progress display for long CLI work (model loading, transfers), on stderr, via rich.

Quiet when stderr is not a terminal, so logs and JSON output stay clean.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from collections.abc import Iterator


@contextmanager
def status(message: str) -> Iterator[None]:
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield
