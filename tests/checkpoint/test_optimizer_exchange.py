"""Each rank's share of an optimizer's state reaches every rank, typed and placed as it was."""

from __future__ import annotations

import pytest
import torch

import spread
from spread.checkpoint.optimizer_exchange import broadcast_optimizer_state
from spread.testing import run_ranks

pytestmark = pytest.mark.processes


def _exchange() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        c = strategy.collectives
        rank = c.rank
        # rank r owns parameter r's state: a float32 and a float64 tensor and a plain step count
        state = {
            rank: {
                "exp_avg": torch.full((2, 3), float(rank + 1)),
                "exp_avg_sq": torch.full((4,), rank + 0.5, dtype=torch.float64),
                "step": 7 + rank,
                "note": None,
            }
        }
        merged: dict = {}
        for src in range(c.world_size):
            merged.update(broadcast_optimizer_state(c, state, [src], src=src, device=torch.device("cpu")))
        return {
            i: {k: (v.dtype, v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in merged.items()
        }
    finally:
        strategy.close()


def test_every_rank_gets_every_ranks_share():
    results = run_ranks(_exchange, 2, timeout=90)
    for out in results:
        for owner in (0, 1):
            entry = out[owner]
            assert entry["exp_avg"] == (torch.float32, [[float(owner + 1)] * 3] * 2)
            assert entry["exp_avg_sq"] == (torch.float64, [owner + 0.5] * 4)
            assert entry["step"] == 7 + owner and entry["note"] is None


def _refuse() -> str:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        state = {0: {"bad": object()}}
        broadcast_optimizer_state(strategy.collectives, state, [0], src=0, device=torch.device("cpu"))
    except TypeError as exc:
        return str(exc)
    finally:
        strategy.close()
    return "nothing refused"


def test_state_that_json_cannot_describe_is_refused_by_the_sender_before_sending():
    (message,) = run_ranks(_refuse, 1, timeout=60)
    assert message == "optimizer state 0.bad is a object; cannot gather it"
