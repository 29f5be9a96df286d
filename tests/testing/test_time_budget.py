"""Test budgets stretch on a busy machine (a load average of 11-17 on 2 cores failed 4 tests on
fixed timeouts), and only there."""

from __future__ import annotations

import pytest

from spread.testing.time_budget import SCALE_ENV, budget, busy_machine_scale, time_scale


def test_the_scale_follows_the_load_per_core():
    assert busy_machine_scale(load=0.5, cores=2) == 1.0  # idle: the budgets as written
    assert busy_machine_scale(load=14.0, cores=2) == 7.0  # the busy machine of the report
    assert busy_machine_scale(load=1000.0, cores=2) == 20.0  # past that it is a hang


def test_budgets_stretch_by_the_scale_set_for_the_session(monkeypatch):
    monkeypatch.setenv(SCALE_ENV, "3.5")
    assert time_scale() == 3.5 and budget(100) == 350
    monkeypatch.delenv(SCALE_ENV)
    assert budget(100) == 100


@pytest.mark.parametrize("bad", ["fast", "0.5", "100"])
def test_a_bad_scale_is_refused_naming_the_variable(monkeypatch, bad):
    monkeypatch.setenv(SCALE_ENV, bad)
    with pytest.raises(ValueError, match=SCALE_ENV):
        time_scale()


@pytest.mark.timeout(10)
def test_this_tests_timeout_is_stretched_by_the_session_scale(request):
    marker = request.node.get_closest_marker("timeout")
    assert marker.args[0] == pytest.approx(10 * time_scale())
