"""Concurrency measurements: replicas slowing each other, optimizer steps at once, thread replicas."""

from __future__ import annotations

import re

import pytest
import torch
from _profiles import toy_profile
from torch import nn

from spread.plan.concurrency import replica_counts
from spread.plan.workload import measure_model


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def test_replica_counts_cover_the_node_without_measuring_every_count():
    assert replica_counts(1) == []
    assert replica_counts(2) == [2]
    assert replica_counts(3) == [2, 3]
    assert replica_counts(8) == [2, 3, 4, 8]
    assert replica_counts(64) == [2, 3, 4, 8, 16, 64]
    assert replica_counts(1000) == [2, 3, 4, 8, 16, 1000]  # at most six, always ending at the node


@pytest.mark.processes  # one-thread replicas are timed in forked processes
def test_contention_is_measured_for_each_replica_count_and_never_below_one():
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    profile = measure_model(model, nn.CrossEntropyLoss(), x, y, threads=(1, 2), concurrency=(2, 3), repeats=2)
    assert sorted(profile.contention) == [2, 3]
    assert all(factor >= 1.0 for factor in profile.contention.values())
    assert profile.contention_factor(1) == 1.0
    assert profile.contention_factor(3) == profile.contention[3]
    assert profile.contention_factor(7) == profile.contention[3]  # past the largest: the largest
    assert sorted(profile.slowest_contention) == [2, 3]
    assert all(profile.slowest_contention[k] >= profile.contention[k] for k in (2, 3))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.processes  # one-thread replicas are timed in forked processes
def test_a_replica_that_fails_while_measuring_contention_raises_in_the_caller():
    import os
    import threading

    profiler = os.getpid()

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # only the concurrent replicas: forked processes, or threads of this one
        if os.getpid() != profiler or threading.current_thread() is not threading.main_thread():
            raise RuntimeError("replica blew up")
        return nn.functional.cross_entropy(out, target)

    with pytest.raises(RuntimeError, match="replica blew up"):
        measure_model(
            _mlp(),
            loss,
            torch.randn(16, 32),
            torch.randint(0, 10, (16,)),
            threads=(2,),
            concurrency=(2,),
            repeats=1,
        )


@pytest.mark.processes  # one-thread replicas are timed in forked processes
def test_optimizer_is_timed_per_thread_count_and_under_concurrency():
    model = _mlp()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
    profile = measure_model(
        model, nn.CrossEntropyLoss(), x, y, optimizer=optimizer, threads=(1, 2), concurrency=(2, 3), repeats=2
    )
    assert sorted(profile.optimizer_by_threads) == [1, 2]
    assert all(seconds > 0 for seconds in profile.optimizer_by_threads.values())
    assert profile.optimizer_seconds == profile.optimizer_by_threads[2]  # the most threads, as before
    assert sorted(profile.optimizer_contention) == [2, 3]
    assert all(factor >= 1.0 for factor in profile.optimizer_contention.values())
    assert sorted(profile.in_process) == [2, 3]
    assert all(factor >= 1.0 for factor in profile.in_process.values())
    # Neither the model nor the user's optimizer was stepped or given state.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(float(state["step"]) == 0 for state in optimizer.state.values())  # Adagrad's eager state


@pytest.mark.processes  # one-thread replicas are timed in forked processes
def test_without_an_optimizer_or_with_structured_inputs_those_factors_are_left_out():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # a dict of inputs is keyword arguments
            return self.body(x)

    inputs = {"x": torch.randn(16, 32)}
    profile = measure_model(
        Pair(),
        nn.CrossEntropyLoss(),
        inputs,
        torch.randint(0, 10, (16,)),
        threads=(1,),
        concurrency=(2,),
        repeats=1,
    )
    assert sorted(profile.contention) == [2]
    assert profile.optimizer_contention == {} and profile.in_process == {}  # nothing to measure with
    assert profile.optimizer_contention_factor(2) == 1.0 and profile.in_process_factor(2) == 1.0


def test_factor_lookup_and_optimizer_time_by_hand():
    profile = toy_profile(
        optimizer_seconds=0.2,
        optimizer_by_threads={1: 0.3, 4: 0.1},
        optimizer_contention={2: 1.5, 4: 2.0},
        in_process={3: 1.2},
    )
    assert profile.optimizer_time() == 0.2  # no thread count: the figure at the most threads
    assert profile.optimizer_time(1) == 0.3
    assert profile.optimizer_time(2) == 0.3  # nearest measured count, ties to the fewer threads
    assert profile.optimizer_time(3) == 0.1
    assert profile.optimizer_time(16) == 0.1
    assert profile.optimizer_contention_factor(1) == 1.0
    assert profile.optimizer_contention_factor(3) == 1.5  # the largest measured count below
    assert profile.optimizer_contention_factor(64) == 2.0
    assert profile.in_process_factor(2) == 1.0  # below every measured count
    assert profile.in_process_factor(3) == 1.2


def test_paired_slowdown_compares_with_the_alone_step_of_the_same_rounds(monkeypatch):
    import threading
    from types import SimpleNamespace

    from spread.plan import concurrency
    from spread.plan.concurrency import paired_slowdowns

    # Each thread's own clock, moved only by the steps: the arithmetic is checked, not this machine's
    # scheduler (a busy machine stretched real sleeps past any tolerance).
    clock = threading.local()

    def now() -> float:
        return getattr(clock, "t", 0.0)

    def spend(seconds: float) -> None:
        clock.t = now() + seconds

    monkeypatch.setattr(concurrency, "time", SimpleNamespace(perf_counter=now))
    calls = {"alone": 0, "together": 0}

    def alone() -> None:
        calls["alone"] += 1
        spend(0.02)

    def together() -> None:
        calls["together"] += 1
        spend(0.06)  # each of the steps run at once takes 3x the alone step

    threads = {"threads": 1, "processes": False}
    assert paired_slowdowns(alone, [together, together], repeats=3, cores=2, **threads).each == pytest.approx(
        3.0
    )
    assert calls == {"alone": 1 + 3, "together": 2 * (1 + 3)}  # one warm-up each, then one per round
    # four at once on two cores: half of the 3x is time-slicing, not contention
    four = paired_slowdowns(alone, [together] * 4, repeats=2, cores=2, **threads).each
    assert four == pytest.approx(1.5)
    faster_together = paired_slowdowns(together, [alone, alone], repeats=2, cores=2, **threads)
    assert faster_together.each == 1.0  # never below one


@pytest.mark.processes  # one-thread replicas are timed in forked processes
def test_paired_slowdown_in_forked_processes_compares_the_same_way():
    import time

    from spread.plan.concurrency import paired_slowdowns

    def alone() -> None:
        time.sleep(0.02)

    def together() -> None:
        time.sleep(0.06)

    factor = paired_slowdowns(alone, [together, together], threads=1, repeats=2, cores=2, processes=True).each
    assert factor == pytest.approx(3.0, rel=0.3)
    assert paired_slowdowns(alone, [together] * 4, threads=1, repeats=2, cores=2, processes=True).each == (
        pytest.approx(1.5, rel=0.3)
    )


def test_one_thread_replicas_are_measured_as_processes_by_default(monkeypatch):
    import spread.plan.concurrency as concurrency

    used = []

    def fake_forked_rounds(alone, together, repeats):
        used.append(len(together))
        return [1.0] * repeats, [[1.2] * len(together)] * repeats

    monkeypatch.setattr(concurrency, "forked_rounds", fake_forked_rounds)
    factor = concurrency.paired_slowdowns(print, [print, print], threads=1, repeats=2, cores=2).each
    assert factor == pytest.approx(1.2)
    assert used == [2]
    concurrency.paired_slowdowns(lambda: None, [lambda: None] * 2, threads=2, repeats=1, cores=4)
    assert used == [2]  # two threads per replica: a forked child cannot run them (GNU OpenMP), threads do


def test_the_slowest_replica_of_each_round_is_measured_beside_the_typical_one(monkeypatch):
    import spread.plan.concurrency as concurrency

    # alone 1.0 s; together 1.0, 1.2 and 1.6 s in every round: each (median) 1.2x, the slowest 1.6x
    def fake(alone, together, repeats):
        return [1.0] * repeats, [[1.0, 1.6, 1.2]] * repeats

    monkeypatch.setattr(concurrency, "forked_rounds", fake)
    measured = concurrency.paired_slowdowns(print, [print] * 3, threads=1, repeats=3, cores=4)
    assert measured == (pytest.approx(1.2), pytest.approx(1.6))
    assert concurrency.paired_slowdowns(
        print, [print] * 3, threads=1, repeats=3, cores=4
    ).each == pytest.approx(1.2)
    # three on two cores: 1.5x is time-slicing, none of it contention for the typical one; the
    # slowest still finishes 1.6 / 1.2 after its round's median
    on_two = concurrency.paired_slowdowns(print, [print] * 3, threads=1, repeats=3, cores=2)
    assert on_two == (1.0, pytest.approx(1.6 / 1.2))


def test_contention_rounds_for_the_slowest_are_more_than_for_a_median(monkeypatch):
    import spread.plan.concurrency as concurrency

    rounds_asked = []

    def fake(alone, together, repeats):
        rounds_asked.append(repeats)
        return [1.0] * repeats, [[1.0] * len(together)] * repeats

    monkeypatch.setattr(concurrency, "forked_rounds", fake)
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    slowdown = concurrency.measure_contention(
        toy_profile(batch=8), model, nn.functional.mse_loss, x, y, 2, 2, repeats=3
    )
    assert rounds_asked == [7]
    assert slowdown == (1.0, 1.0)


@pytest.mark.parametrize(
    "failure",
    [
        TimeoutError("forked replica 1 did not finish round 0's step together in time"),
        BlockingIOError(11, "Resource temporarily unavailable"),  # fork refused
    ],
)
def test_a_stuck_or_unforkable_replica_falls_back_to_threads_with_a_warning(monkeypatch, failure):
    import spread.plan.concurrency as concurrency

    def fails(alone, together, repeats):
        raise failure

    monkeypatch.setattr(concurrency, "forked_rounds", fails)
    with pytest.warns(RuntimeWarning, match=re.escape(failure.args[-1]) + ".*with threads instead"):
        factor = concurrency.paired_slowdowns(
            lambda: None, [lambda: None] * 2, threads=1, repeats=1, cores=2
        ).each
    assert factor >= 1.0


@pytest.mark.processes  # one-thread replicas are timed in forked processes
def test_profiling_with_thread_replicas_leaves_the_thread_count_as_it_was():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
        profile = measure_model(
            _mlp(), nn.CrossEntropyLoss(), x, y, threads=(1, 2), concurrency=(2,), repeats=1
        )
        assert sorted(profile.in_process) == [2]
        assert torch.get_num_threads() == 2  # MirroredStrategy set 1 per replica while measuring
    finally:
        torch.set_num_threads(previous)
