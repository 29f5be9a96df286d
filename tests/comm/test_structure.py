"""Recovery hands survivors one rank's optimizer state and loop position: as JSON and tensors, never a
pickle (a pickle runs what it names when loaded)."""

from __future__ import annotations

import math

import pytest
import torch

from spread.comm.structure import _decode, _encode, broadcast_structure
from spread.testing import launch_ranks

_VALUE = {
    "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).reshape(2, 3)}},
    "param_groups": [{"params": [0], "lr": 0.01, "betas": (0.9, 0.999), "amsgrad": False, "name": None}],
    "epoch": 2,
    "sums": torch.tensor([1.5, 4.0], dtype=torch.float64),
    "best": float("inf"),
    "missing": float("nan"),
}


def _check(received: dict) -> None:
    assert received["state"][0]["step"].item() == 3.0 and received["state"][0]["step"].device.type == "cpu"
    assert torch.equal(received["state"][0]["exp_avg"], torch.arange(6.0).reshape(2, 3))
    assert received["param_groups"] == [
        {"params": [0], "lr": 0.01, "betas": (0.9, 0.999), "amsgrad": False, "name": None}
    ]
    assert received["sums"].dtype == torch.float64 and received["epoch"] == 2
    assert received["best"] == math.inf and math.isnan(received["missing"])


def test_a_structure_round_trips_through_its_encoding():
    tensors: list[torch.Tensor] = []
    _check(_decode(_encode(_VALUE, tensors), tensors))


@pytest.mark.parametrize("bad", [object(), {(1, 2): 3}, {1, 2}, b"bytes"])
def test_what_json_and_tensors_cannot_carry_is_refused_by_name(bad):
    with pytest.raises(TypeError, match=r"cannot send a"):
        _encode({"x": bad}, [])


def _broadcast_from_rank_1() -> bool:
    import spread

    strategy = spread.MultiWorkerMirroredStrategy(communication="native")
    received = broadcast_structure(
        strategy.collectives, _VALUE if strategy.rank == 1 else None, src=1, name="test"
    )
    _check(received)
    return True


@pytest.mark.processes
def test_every_rank_receives_the_source_rank_structure():
    results = launch_ranks(_broadcast_from_rank_1, 2, timeout=120)
    assert all(r.ok and r.value for r in results), [r.describe() for r in results]
