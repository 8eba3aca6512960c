"""Shared pytest fixtures: where the read-only shared/ tree (spec, conformance vectors) lives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shared_dir() -> Path:
    env = os.environ.get("KVPACK_SHARED")
    if env:
        return Path(env)
    return REPO.parent / "shared"


SHARED = _shared_dir()
CONFORMANCE = SHARED / "conformance"


@pytest.fixture(scope="session")
def conformance_dir() -> Path:
    if not (CONFORMANCE / "production_v1.sha256").is_file():
        pytest.fail(f"conformance vectors not found under {CONFORMANCE} (set KVPACK_SHARED)")
    return CONFORMANCE
