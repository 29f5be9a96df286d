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
