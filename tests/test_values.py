"""Per-replica values and moving a step's inputs to its replica's device."""

from __future__ import annotations

import torch

from spread.values import PerReplica, on_device, select_replica, stack_replicas


def test_on_device_moves_every_tensor_in_the_structure_and_leaves_the_rest():
    cpu = torch.ones(2)
    moved = on_device({"x": cpu, "pair": (cpu, 3), "name": "batch"}, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["pair"][0].device.type == "meta"
    assert moved["pair"][1] == 3 and moved["name"] == "batch"


def test_on_device_returns_tensors_already_there_unchanged():
    x = torch.ones(2)
    (same,) = on_device((x,), torch.device("cpu"))
    assert same is x


def test_select_and_stack_replicas_round_trip():
    per = stack_replicas([{"a": torch.tensor(0)}, {"a": torch.tensor(1)}])
    assert isinstance(per["a"], PerReplica)
    assert int(select_replica(per, 1)["a"]) == 1
