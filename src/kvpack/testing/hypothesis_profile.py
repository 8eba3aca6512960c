"""The Hypothesis profile every property test in tests/ runs under (loaded by tests/conftest.py).

Random examples on every run: a real bug found on a rare example must fail CI, so the profile
never derandomizes and never lowers ``max_examples``. What it removes is failing for the box
rather than the code:

- no per-example deadline: a 2-core CI box under the suite's load runs an example far past
  Hypothesis' default 200 ms (``DeadlineExceeded``, or ``Flaky`` when the replay is quick);
- the health checks that judge generation speed or luck are off: ``too_slow`` (timing),
  ``data_too_large`` and ``filter_too_much`` (how many draws of this seed overran or were
  filtered). The others (fixtures, return values, nesting) are about how a test is written and
  fail on every run, so they stay on.

The failing example's blob is printed, so a CI failure replays with ``@reproduce_failure``.
:func:`load` must run before the test modules are imported: a ``settings(...)`` object takes
its unset values from the profile loaded when it is built. ``tests/test_hypothesis_profile.py``
checks every collected property test against :func:`violations`. Never used by production code.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

NAME = "kvpack"
UNLUCKY = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much)


def load() -> None:
    settings.register_profile(NAME, deadline=None, suppress_health_check=UNLUCKY, print_blob=True, derandomize=False)
    settings.load_profile(NAME)


def violations(s: settings) -> list[str]:
    """What in ``s`` lets a test fail on an unlucky or slow run ([] when nothing)."""
    out = []
    if s.deadline is not None:
        out.append(f"deadline={s.deadline}")
    if s.derandomize:
        out.append("derandomize=True (the same examples every run: no power added by CI)")
    missing = [h.name for h in UNLUCKY if h not in s.suppress_health_check]
    if missing:
        out.append(f"health checks on: {missing}")
    return out
