"""A peer killed mid-training is named by rank on the ranks that lose it, without any launcher (issue
40 item 5: gloo said only ``Connection closed by peer [127.0.0.1]:25267``)."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

from spread.testing import launch_ranks


def _train_until_rank_1_is_killed(communication: str) -> None:
    import spread

    strategy = spread.MultiWorkerMirroredStrategy(communication=communication)
    with strategy.scope():
        model = nn.Linear(64, 64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000):
        if step == 3 and strategy.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        strategy.run(lambda: model(torch.randn(8, 64)).square().mean().backward())
        optimizer.step()


@pytest.mark.processes
@pytest.mark.parametrize("communication", ["native", "ring", "shm"])
def test_a_killed_rank_is_named_by_the_rank_that_loses_it(communication):
    first, second = launch_ranks(
        _train_until_rank_1_is_killed, 2, args=(communication,), collective_timeout=30, timeout=120
    )
    assert second.exitcode == -signal.SIGKILL, second.describe()
    assert first.error is not None and first.error.startswith("PeerLostError"), first.describe()
    error = first.error
    if communication == "shm":  # its own barrier sees the socket close, and says who exited
        assert "rank 1 left" in error and "exited on this host: rank 1 (pid " in error, error
    else:
        assert "a peer process went away: rank 1 (pid " in error and ") exited" in error, error


def test_without_recorded_processes_the_message_stays_generic():
    from spread.comm import peers
    from spread.comm.ops import classify_error

    saved = dict(peers._job_processes)
    peers._job_processes.clear()
    try:
        error = classify_error(0, "all_reduce", 3, RuntimeError("Connection closed by peer [127.0.0.1]:1"))
    finally:
        peers._job_processes.update(saved)
    assert str(error) == (
        "rank 0: all_reduce #3 failed: a peer process went away (Connection closed by peer [127.0.0.1]:1)"
    )
