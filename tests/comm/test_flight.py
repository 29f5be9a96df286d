"""The rank a hung job waits for is named, with where it is (issue 37 item 1): a rank stuck in its
own code is named by the ranks waiting for it after ``SPREAD_HANG_REPORT_AFTER`` seconds (30 by
default, not gloo's 300), and the timeout that follows says the same."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

from spread.comm.flight import _Entry, _Record, describe_job, diagnose
from spread.testing import launch_ranks


def test_the_diagnosis_names_ranks_that_never_entered_the_collective_and_where_they_are():
    now = 1000.0
    waiting = _Entry(7, "gradient_exchange", 0, now - 35)

    def done(number, op, ended):  # a finished collective
        return [_Entry(number, op, 0, ended - 1, ended)]

    records = {
        0: _Record(0, 10, "backward of step 31", now - 35, waiting, done(6, "all_reduce", now - 40), now - 1),
        1: _Record(1, 11, "forward of step 31", now - 41, None, done(6, "all_reduce", now - 41), now - 1),
        2: _Record(2, 12, "backward", now - 30, None, done(7, "gradient_exchange", now - 35), now - 1),
        3: _Record(3, 13, "forward of step 31", now - 60, None, done(6, "all_reduce", now - 61), now - 50),
    }
    assert diagnose(waiting, records, now) == (
        "rank 1 never entered gradient_exchange #7: its last collective, #6 (all_reduce), ended 41 s ago; "
        "it is in forward of step 31 (for 41 s); "
        "rank 3 never entered gradient_exchange #7: its last collective, #6 (all_reduce), ended 61 s ago; "
        "it is in forward of step 31 (for 60 s); its last report is 50 s old (stopped or gone?)"
    )


def test_the_job_report_says_where_every_rank_is_and_who_the_furthest_wait_for():
    now = 1000.0
    waiting = _Entry(7, "all_reduce", 4096, now - 12)
    records = {
        0: _Record(
            0, 10, "backward of step 31", now - 12, waiting, [_Entry(6, "reduce", 8, now - 20, now - 19)], now
        ),
        2: _Record(
            2, 12, "forward of step 31", now - 15, None, [_Entry(6, "reduce", 8, now - 20, now - 15)], now - 9
        ),
    }
    assert describe_job(records, 3, now) == [
        "rank 0 (pid 10): waiting in all_reduce #7 for 12 s; in backward of step 31 (for 12 s)",
        "rank 1: no record (not started, not past its strategy's setup, or no watch)",
        "rank 2 (pid 12): not in a collective; its last, #6 (reduce), ended 15 s ago; in forward of step 31 "
        "(for 15 s); its last report is 9 s old (stopped or gone?)",
        "waiting in all_reduce #7: rank 2 never entered all_reduce #7: its last collective, #6 (reduce), "
        "ended 15 s ago; it is in forward of step 31 (for 15 s); its last report is 9 s old (stopped or "
        "gone?); rank(s) 1 published no record",
    ]
    assert describe_job({}, 2, now) == [
        "rank 0: no record (not started, not past its strategy's setup, or no watch)",
        "rank 1: no record (not started, not past its strategy's setup, or no watch)",
    ]


class _StuckOnce(nn.Module):
    def __init__(self, rank: int, stuck_rank: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)
        self.stuck = seconds if rank == stuck_rank else 0.0
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3 and self.stuck:
            time.sleep(self.stuck)  # user code that does not progress
        return self.linear(x)


def _fit_with_a_stuck_rank(seconds: float, communication: str = "native") -> list[str]:
    import spread
    from spread.comm import flight

    if communication == "sharded":  # ShardedStrategy's gathers and reductions are asynchronous
        strategy = spread.ShardedStrategy(shard="parameters")
    else:
        strategy = spread.MultiWorkerMirroredStrategy(communication=communication)
    with strategy.scope():
        model = _StuckOnce(strategy.rank, 1, seconds)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = (torch.randn(64, 8), torch.randint(0, 2, (64,)))
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    trainer.fit(data, epochs=1, global_batch_size=16, shuffle=False, verbose=0)
    assert flight._WATCH is not None
    return list(flight._WATCH.reports)


@pytest.mark.processes
@pytest.mark.parametrize("communication", ["native", "ring", "shm", "hierarchical", "sharded"])
def test_a_rank_stuck_in_its_own_code_is_named_by_the_rank_waiting_for_it(communication: str):
    results = launch_ranks(
        _fit_with_a_stuck_rank,
        2,
        args=(12.0, communication),
        env={"SPREAD_HANG_REPORT_AFTER": "4"},
        collective_timeout=60,
        timeout=180,
    )
    assert all(r.ok for r in results), [r.describe() for r in results]
    waiting, stuck = results[0].value, results[1].value
    assert stuck == []
    assert len(waiting) == 1, waiting
    assert waiting[0].startswith("spread: rank 0 has waited ")
    assert re.search(r"rank 1 never entered [\w.]+ #\d+: its last collective", waiting[0]), waiting[0]
    assert "it is in forward of step 3 (for " in waiting[0]


@pytest.mark.processes
@pytest.mark.parametrize("communication", ["native", "ring", "shm", "hierarchical", "sharded"])
def test_the_timeout_of_a_collective_names_the_rank_it_waited_for(communication: str):
    results = launch_ranks(
        _fit_with_a_stuck_rank,
        2,
        args=(60.0, communication),
        env={"SPREAD_HANG_REPORT_AFTER": "3"},
        collective_timeout=8,
        timeout=180,
        fail_fast_grace=5,
    )
    error = results[0].error or ""
    assert error.startswith("CollectiveTimeout"), results[0].describe()
    assert re.search(r"rank 1 never entered [\w.]+ #\d+: its last collective", error), error
    assert "it is in forward of step 3" in error, error
