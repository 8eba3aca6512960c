"""Every property test runs under the suite's Hypothesis profile
(kvpack.testing.hypothesis_profile): random examples each run, no per-example deadline, no
health check that judges generation luck or speed. A false property still fails; a slow
example does not (and, as a control, would under Hypothesis' defaults)."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import DeadlineExceeded
from hypothesis.stateful import RuleBasedStateMachine, rule

from kvpack.testing import hypothesis_profile


def _settings_of(item) -> settings | None:
    """The settings a collected property test runs with: a @given function's, or those of the
    TestCase a RuleBasedStateMachine makes (its runTest names the machine); None otherwise."""
    fn = getattr(item, "obj", None)
    if getattr(fn, "_hypothesis_state_machine_class", None) is not None:
        return item.cls.settings
    return getattr(fn, "_hypothesis_internal_use_settings", None)


def test_the_profile_is_loaded_and_keeps_full_power():
    assert settings._current_profile == hypothesis_profile.NAME
    assert hypothesis_profile.violations(settings.default) == []
    assert settings.default.max_examples >= 100  # Hypothesis' own default: never fewer


def test_every_collected_property_test_follows_the_profile(request):
    bad = []
    for item in request.session.items:
        s = _settings_of(item)
        if s is not None:
            bad += [f"{item.nodeid}: {v}" for v in hypothesis_profile.violations(s)]
    assert not bad, "property tests that can fail on the box, not the code:\n" + "\n".join(bad)


class _Machine(RuleBasedStateMachine):
    @rule()
    def step(self):
        pass


_Machine.TestCase.settings = settings(max_examples=1, deadline=1000)


class _Item:
    """The two attributes of a collected pytest item _settings_of reads."""

    def __init__(self, obj, cls=None):
        self.obj, self.cls = obj, cls


def test_the_collection_check_sees_both_kinds_and_a_deadline():
    """The check above can fail: it finds @given and stateful settings, and flags a deadline."""
    assert _settings_of(_Item(_slow_property)).max_examples == 3
    assert hypothesis_profile.violations(_settings_of(_Item(_Machine.TestCase().runTest, _Machine.TestCase))) == ["deadline=0:00:01"]
    assert _settings_of(_Item(test_the_profile_is_loaded_and_keeps_full_power)) is None


@given(st.integers())
def _false_property(n):
    assert n < 1000


@settings(max_examples=3)
@given(st.integers(0, 3))
def _slow_property(n):
    time.sleep(0.25)  # past Hypothesis' default 200 ms deadline on any box


def test_a_false_property_still_fails():
    with pytest.raises(AssertionError):
        _false_property()


def test_a_slow_example_is_no_failure():
    _slow_property()
    control = settings(max_examples=1, deadline=200, database=None)(given(st.integers(0, 3))(lambda n: time.sleep(0.25)))
    with pytest.raises(DeadlineExceeded):
        control()
