"""Steps timed in forked one-thread processes: results, errors, timeouts, and no child left behind."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from spread.plan import _forked
from spread.plan._forked import ForkedStepError, busy_processes, can_fork, forked_rounds

pytestmark = [
    pytest.mark.processes,  # every test forks children
    pytest.mark.skipif(not can_fork(), reason="needs os.fork and no CUDA context"),
]


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True) if child.status() != "zombie"}


def test_each_round_times_the_alone_step_then_the_others_at_once():
    before = _children()
    weights = torch.randn(64, 64)

    def alone() -> None:
        time.sleep(0.01)

    def together() -> None:
        (weights @ weights).sum()  # torch works in the child (one thread)
        time.sleep(0.03)

    alone_times, rounds = forked_rounds(alone, [together, together, together], repeats=3)
    # Lower bounds only: a sleep lasts at least its time; a busy machine may stretch it any amount.
    assert len(alone_times) == 3 and all(t > 0.009 for t in alone_times)
    assert len(rounds) == 3 and all(len(r) == 3 for r in rounds)
    assert all(t > 0.029 for r in rounds for t in r)
    assert _children() == before  # every child killed and reaped


def test_a_step_that_raises_in_a_child_raises_in_the_caller_with_its_message():
    before = _children()

    def broken() -> None:
        raise ValueError("shapes do not match\nsecond line")

    with pytest.raises(ForkedStepError, match="replica 2 during round 0's step together: ValueError: shapes"):
        forked_rounds(lambda: None, [lambda: None, broken], repeats=1)
    assert _children() == before


def test_a_child_that_never_answers_times_out_and_is_killed():
    before = _children()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="forked replica 1 did not finish round 0's step together"):
        forked_rounds(lambda: None, [lambda: time.sleep(60)], repeats=1, step_timeout=0.5)
    assert time.monotonic() - started < 10
    assert _children() == before


def test_the_children_never_change_the_callers_state():
    state = torch.zeros(4)
    threads = torch.get_num_threads()

    def mutate() -> None:
        state.add_(1)

    forked_rounds(mutate, [mutate, mutate], repeats=2)
    assert torch.equal(state, torch.zeros(4))  # copy-on-write: the children changed their copies
    assert torch.get_num_threads() == threads


def test_busy_processes_compute_while_the_block_runs_and_are_reaped_after_it():
    before = _children()
    with busy_processes(2) as started:
        assert started == 2
        busy = [psutil.Process(pid) for pid in _children() - before]
        assert len(busy) == 2
        deadline = time.monotonic() + 120  # on a busy machine they may wait long for a core
        while not all(sum(p.cpu_times()[:2]) > 0.05 for p in busy) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(sum(p.cpu_times()[:2]) > 0.05 for p in busy)  # they compute, not sleep
    assert _children() == before


def test_busy_processes_are_reaped_when_the_block_raises():
    before = _children()
    with pytest.raises(RuntimeError, match="measuring failed"), busy_processes(1):
        raise RuntimeError("measuring failed")
    assert _children() == before


def test_busy_processes_start_none_where_forking_is_not_possible(monkeypatch):
    monkeypatch.setattr(_forked, "can_fork", lambda: False)
    before = _children()
    with busy_processes(3) as started:
        assert started == 0 and _children() == before
