"""The interleaved timer behind the model profile: order, warm-up, and drift hitting all settings alike."""

from __future__ import annotations

import pytest

from spread.plan import _timing
from spread.plan._timing import interleaved_medians


class _DriftingClock:
    """A fake ``perf_counter``: a call of cost ``c`` takes ``c * speed`` seconds, the machine slowing
    by ``drift`` per call (a VM whose speed changes within minutes)."""

    def __init__(self, drift: float) -> None:
        self.now = 0.0
        self.speed = 1.0
        self.drift = drift

    def perf_counter(self) -> float:
        return self.now

    def work(self, cost: float):
        def call() -> None:
            self.now += cost * self.speed
            self.speed += self.drift

        return call


def test_each_call_warmed_up_then_timed_once_per_round_in_rotating_order() -> None:
    order: list[str] = []
    before: list[str] = []
    calls = {k: (lambda k=k: order.append(k)) for k in ("a", "b", "c")}
    medians = interleaved_medians(calls, repeats=3, before=before.append)
    assert set(medians) == {"a", "b", "c"}
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert before == order  # the untimed set-up ran before every call


def test_drift_hits_every_setting_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _DriftingClock(drift=0.05)
    monkeypatch.setattr(_timing.time, "perf_counter", clock.perf_counter)
    medians = interleaved_medians({"one": clock.work(1.0), "two": clock.work(2.0)}, repeats=5)
    # timed as blocks (all of "one", then all of "two") the same drift gives 2.9 / 1.15 = 2.5
    assert medians["two"] / medians["one"] == pytest.approx(2.0, rel=0.1)


def test_no_calls_and_no_repeats() -> None:
    assert interleaved_medians({}, repeats=3) == {}
    with pytest.raises(ValueError, match="repeats"):
        interleaved_medians({"a": lambda: None}, repeats=0)


class _SlowStartClock:
    """A fake ``perf_counter``: a call of cost ``c`` takes ``1.5 * c`` seconds for the first
    ``slow_for`` seconds (a neighbour busy at that moment), then ``c``."""

    def __init__(self, slow_for: float) -> None:
        self.now = 0.0
        self.slow_for = slow_for
        self.calls = 0

    def perf_counter(self) -> float:
        return self.now

    def work(self, cost: float):
        def call() -> None:
            self.calls += 1
            self.now += cost * (1.5 if self.now < self.slow_for else 1.0)

        return call


def test_rounds_go_on_until_they_span_min_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _SlowStartClock(slow_for=0.0)
    monkeypatch.setattr(_timing.time, "perf_counter", clock.perf_counter)
    interleaved_medians({"a": clock.work(1.0), "b": clock.work(1.0)}, repeats=3, min_seconds=10.0)
    assert clock.calls == 2 + 2 * 5  # the warm-up round, then rounds of 2 s until 10 s had passed
    clock.calls = 0
    interleaved_medians({"a": clock.work(1.0), "b": clock.work(1.0)}, repeats=3, min_seconds=1.0)
    assert clock.calls == 2 + 2 * 3  # never fewer than ``repeats`` rounds


def test_a_longer_span_takes_the_typical_speed_not_the_moments(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _SlowStartClock(slow_for=20.0)
    monkeypatch.setattr(_timing.time, "perf_counter", clock.perf_counter)
    short = interleaved_medians({"a": clock.work(1.0), "b": clock.work(2.0)}, repeats=3)
    assert short == {"a": 1.5, "b": 3.0}  # every setting at the busy moment's speed: ratios kept
    clock.now = 0.0
    long = interleaved_medians({"a": clock.work(1.0), "b": clock.work(2.0)}, repeats=3, min_seconds=40.0)
    # 4 rounds in the busy 20 s, 8 after
    assert long == {"a": 1.0, "b": 2.0}


def test_negative_min_seconds_is_refused() -> None:
    with pytest.raises(ValueError, match="min_seconds"):
        interleaved_medians({"a": lambda: None}, repeats=1, min_seconds=-1.0)
