"""The engine side's one lazy ``torch`` import.

Why it exists: importing torch costs seconds, so the engine modules import it on first use;
they used to get that function from ``transformers_adapter``, which itself imports ``cuda``
and ``device_verify`` lazily: an import cycle through the adapter. This leaf module breaks it.

What it must never do: import another kvpack module than kvpack.errors (it is the leaf the
engine modules import) or import torch at module import time.
"""

from __future__ import annotations

from typing import Any

from ..errors import EngineError


def load_torch() -> Any:
    """The ``torch`` module, imported on first call; a missing install is an ``install`` error."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - install problem
        raise EngineError("install", f"torch is not installed: {exc}") from exc
    return torch


__all__ = ["load_torch"]
