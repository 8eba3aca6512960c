"""Shared pytest fixtures: where the read-only shared/ tree (spec, conformance vectors) lives;
the lifeline (kvpack.testing.lifeline): every process this run starts dies with it, and the
strays of an earlier run that was killed outright are swept before any test starts; and the
Hypothesis profile every property test runs under (kvpack.testing.hypothesis_profile)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpack.testing import hypothesis_profile, lifeline

# before any test module builds its settings(...): kvpack.testing.hypothesis_profile says why
hypothesis_profile.load()

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


_swept: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    # sweep first: the strays of a killed run hold ports and CPU this run's tests need
    _swept.extend(lifeline.sweep())
    lifeline.install()


def pytest_report_header(config: pytest.Config) -> str:
    return f"lifeline: children die with this run; swept {len(_swept)} stray process(es) of earlier killed runs" + (f": {_swept}" if _swept else "")
