"""BufferAverager: buffers become the weighted average (integer ones rounded), and a buffer no rank
changed stays bit for bit what it was."""

from __future__ import annotations

import pytest
import torch

import spread
from spread.comm.buffers import BufferAverager
from spread.testing import run_ranks

CONSTANT = torch.linspace(-1, 1, 7) / 3  # values whose weighted sums round


def _average() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        rank = strategy.rank
        running = torch.zeros(4)
        constant = CONSTANT.clone()
        half = torch.zeros(3, dtype=torch.bfloat16)
        count = torch.tensor(5)
        averager = BufferAverager([running, constant, half, count], strategy.collectives)
        assert averager.num_elements == 4 + 7 + 3 + 1
        weight = 0.3 if rank == 0 else 0.7
        for step in range(3):
            running.add_(float(rank + 1))  # rank 0 adds 1, rank 1 adds 2
            half.fill_(10.0 * (rank + 1))
            count.add_(1 + rank * step)  # rank 1 runs ahead: 0.3 * 1 + 0.7 * (1 + step), rounded
            averager.sync(weight)
        return {"running": running, "constant": constant, "half": half, "count": int(count)}
    finally:
        strategy.close()


@pytest.mark.processes
def test_weighted_average_and_rounded_integers():
    per_rank = run_ranks(_average, 2, timeout=60)
    for result in per_rank:
        # Each step moves the average by 0.3 * 1 + 0.7 * 2 = 1.7.
        torch.testing.assert_close(result["running"], torch.full((4,), 3 * 1.7))
        assert torch.equal(result["constant"], CONSTANT)  # nobody changed it: no rounding drift
        torch.testing.assert_close(result["half"], torch.full((3,), 17.0, dtype=torch.bfloat16))
        assert result["count"] == 5 + 1 + 2 + 2  # 1.0, 1.7 -> 2, 2.4 -> 2
    assert torch.equal(per_rank[0]["running"], per_rank[1]["running"])


def test_one_process_is_a_no_op():
    class One:
        world_size = 1

    running = torch.ones(2)
    BufferAverager([running], One()).sync(1.0)  # type: ignore[arg-type]
    assert torch.equal(running, torch.ones(2))


def test_complex_buffers_are_refused():
    class One:
        world_size = 1

    with pytest.raises(TypeError, match="does not average complex buffers"):
        BufferAverager([torch.zeros(2, dtype=torch.complex64)], One())  # type: ignore[arg-type]
