"""Tensor parallel (``parallelize_module``) with data parallel: 2 x 2 processes equal one device.

Each launch of 4 ranks costs ~20 s of start-up on a 2-core machine, so each launch checks several
things; models and step counts are tiny.
"""

from __future__ import annotations

import os

import pytest
import torch
from _tensor_parallel_cases import (
    copied,
    make_model,
    max_relative_difference,
    train_custom_loop,
    train_with_trainer,
)
from torch import nn

import spread
from spread.errors import SpreadError
from spread.strategies.base import Strategy
from spread.testing import run_ranks

# Tensor parallelism sums a row-parallel layer's partial products in another order than one device's
# matmul: float32 rounding, compounded over the steps (measured: at most 1.6e-7).
TOLERANCE = 1e-5
SHARDED_REFUSAL = "ShardedStrategy with tensor-parallel (DTensor) parameters is not supported yet"


@pytest.fixture(scope="module")
def reference() -> dict:
    one = spread.OneDeviceStrategy("cpu")
    out = {}
    for name in ("mlp", "block"):
        model, optimizer, _ = train_custom_loop(one, name)
        out[name] = copied(model.state_dict())
        out[f"{name}_optimizer"] = optimizer.state_dict()
    trained, out["mlp_history"] = train_with_trainer(
        spread.OneDeviceStrategy("cpu", sync_batchnorm=True), "mlp_batchnorm"
    )
    out["mlp_trainer"] = copied(trained.state_dict())
    return out


def _custom_loops(checkpoints: str) -> dict:
    """The MLP under tensor_parallel=2 (the strategy's mesh), the block under data_mesh= (a mesh the
    script built), each from another initial seed on every rank; then a checkpoint round trip."""
    from torch.distributed.device_mesh import init_device_mesh

    rank = int(os.environ["RANK"])
    out: dict = {}
    strategy = spread.MultiWorkerMirroredStrategy(tensor_parallel=2)
    try:
        assert strategy.num_replicas_in_sync == 2 and strategy.rank == rank
        assert strategy.mesh is not None and strategy.mesh.mesh_dim_names == ("dp", "tp")
        tp_mesh = strategy.mesh["tp"]
        model, optimizer, _ = train_custom_loop(strategy, "mlp", tp_mesh=tp_mesh, seed=rank * 101)
        out["mlp"] = copied(strategy.full_state_dict(model))
        out["mlp_optimizer"] = strategy.full_state_dict(optimizer)
        report = strategy.memory_report(optimizer)
        out["parameter_bytes"] = report.parameter_bytes

        # Checkpoint: the one-device state, written by the chief, read back into another model.
        strategy.save_checkpoint(checkpoints, {"model": model, "optimizer": optimizer}, step=4)
        with strategy.scope():
            other = make_model("mlp", seed=999, tp_mesh=tp_mesh)
            other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.01, weight_decay=0.01)
        strategy.load_checkpoint(checkpoints, {"model": other, "optimizer": other_optimizer})
        out["restored"] = copied(strategy.full_state_dict(other))
        out["restored_optimizer"] = strategy.full_state_dict(other_optimizer)

        # The same job, a mesh of the script's own on the same processes.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
        with spread.MultiWorkerMirroredStrategy(data_mesh=mesh["data"]) as scripted:
            block, _, _ = train_custom_loop(scripted, "block", tp_mesh=mesh["tensor"], seed=rank * 7)
            out["block"] = copied(scripted.full_state_dict(block))
    finally:
        strategy.close()
    return out


@pytest.mark.processes
def test_tensor_parallel_custom_loops_equal_one_device(reference, tmp_path):
    per_rank = run_ranks(_custom_loops, 4, args=(str(tmp_path / "ck"),), timeout=240)
    for rank, out in enumerate(per_rank):
        for name in ("mlp", "block"):
            diff = max_relative_difference(out[name], reference[name])
            worst = {
                k: max_relative_difference({k: out[name][k]}, {k: reference[name][k]}) for k in out[name]
            }
            assert diff <= TOLERANCE, f"rank {rank}, {name}: max relative difference {diff:.2e} {worst}"
        assert max_relative_difference(out["restored"], out["mlp"]) == 0.0
        for key in ("mlp_optimizer", "restored_optimizer"):
            moments = {str(i): s["exp_avg"] for i, s in out[key]["state"].items()}
            expected = {str(i): s["exp_avg"] for i, s in reference["mlp_optimizer"]["state"].items()}
            assert max_relative_difference(moments, expected) <= TOLERANCE, (rank, key)
        # up (8x32 + 32) and down (32x16) split in two, down's bias (16) and the head (16x3 + 3) whole
        assert out["parameter_bytes"] == 4 * ((8 * 32 + 32 + 32 * 16) // 2 + 16 + 16 * 3 + 3)
    # The checkpoint is one device's: a plain model on one device resumes from it.
    plain = make_model("mlp", seed=5)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.01)
    one = spread.OneDeviceStrategy("cpu")
    one.prepare_model(plain)
    restored = one.load_checkpoint(tmp_path / "ck", {"model": plain, "optimizer": optimizer})
    assert restored is not None and restored.step == 4
    assert max_relative_difference(copied(plain.state_dict()), per_rank[0]["mlp"]) == 0.0


class _VotingProgram:
    """The part of a training program ``run_training_step`` calls: a step whose statistics are
    ``[1, 10]`` on every rank, and a stop vote from rank 3 alone (outside rank 0's data group)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def replica_train_step(self, batch) -> torch.Tensor:
        return torch.tensor([1.0, 10.0])

    def stop_vote(self) -> float:
        return 1.0 if self.rank == 3 else 0.0


def _trainer_and_refusals() -> dict:
    rank = int(os.environ["RANK"])
    out: dict = {}
    # BatchNorm over the global batch: its statistics summed along the data axis only
    strategy = spread.MultiWorkerMirroredStrategy(tensor_parallel=2, sync_batchnorm=True)
    try:
        assert strategy.mesh is not None
        tp_mesh = strategy.mesh["tp"]
        model, out["mlp_history"] = train_with_trainer(
            strategy, "mlp_batchnorm", tp_mesh=tp_mesh, seed=rank * 13
        )
        out["mlp_trainer"] = copied(strategy.full_state_dict(model))
        # A step's statistics count each data-parallel replica once; every rank's stop vote counts.
        out["step_statistics"] = strategy.run_training_step(_VotingProgram(rank), None).tolist()
        out["reduced"] = strategy.reduce("sum", torch.tensor(1.0)).item()

        refusals = {}

        def refused(label: str, make, action) -> None:
            other = make()
            try:
                action(other)
            except (SpreadError, ValueError) as exc:
                refusals[label] = str(exc)
            finally:
                close = getattr(other, "close", None)
                if close is not None:
                    close()

        tp_model = make_model("mlp", 0, tp_mesh)
        refused("sharded", lambda: spread.ShardedStrategy("optimizer"), lambda s: s.prepare_model(tp_model))
        refused("plain", lambda: spread.MultiWorkerMirroredStrategy(), lambda s: s.prepare_model(tp_model))
        refused(
            "pipeline",
            lambda: spread.PipelineStrategy(stages=2, replicas=2),
            lambda s: s.prepare_model(tp_model),
        )
        refused("one_device", lambda: spread.OneDeviceStrategy("cpu"), lambda s: s.prepare_model(tp_model))
        refused(
            "mirrored",
            lambda: spread.MirroredStrategy(num_replicas=2, intra_op_threads=1),
            lambda s: s.prepare_model(tp_model),
        )
        refused(
            "central_storage",
            lambda: spread.CentralStorageStrategy(num_replicas=2, intra_op_threads=1),
            lambda s: s.prepare_model(tp_model),
        )
        try:
            spread.Trainer(
                tp_model, torch.optim.SGD(tp_model.parameters()), None, strategy=strategy, precision="fp16"
            )
        except ValueError as exc:
            refusals["fp16"] = str(exc)
        try:
            spread.MultiWorkerMirroredStrategy(tensor_parallel=3)
        except ValueError as exc:
            refusals["indivisible"] = str(exc)
        try:
            spread.MultiWorkerMirroredStrategy(data_mesh=strategy.mesh)
        except ValueError as exc:
            refusals["two_d_data_mesh"] = str(exc)
        out["refusals"] = refusals
    finally:
        strategy.close()
    return out


@pytest.mark.processes
def test_tensor_parallel_trainer_equals_one_device_and_refusals(reference):
    per_rank = run_ranks(_trainer_and_refusals, 4, timeout=240)
    for rank, out in enumerate(per_rank):
        diff = max_relative_difference(out["mlp_trainer"], reference["mlp_trainer"])
        assert diff <= TOLERANCE, f"rank {rank}: max relative difference {diff:.2e}"
        # the logs are one data-parallel group's statistics, counted once: one device's
        for key, values in reference["mlp_history"].items():
            assert out["mlp_history"][key] == pytest.approx(values, rel=TOLERANCE), (rank, key)
        assert out["step_statistics"] == [2.0, 20.0, 1.0]
        assert out["reduced"] == 2.0
        refusals = out["refusals"]
        assert SHARDED_REFUSAL in refusals["sharded"]
        assert "meets this process's data-parallel group" in refusals["plain"]
        assert "tensor_parallel=N" in refusals["plain"]
        for label, name in (
            ("pipeline", "PipelineStrategy"),
            ("one_device", "OneDeviceStrategy"),
            ("mirrored", "MirroredStrategy"),
            ("central_storage", "CentralStorageStrategy"),
        ):
            assert f"{name} with tensor-parallel (DTensor) parameters is not supported" in refusals[label]
        assert "does not divide the job's 4 processes" in refusals["indivisible"]
        assert "tensor parallelism does not train in precision='fp16'" in refusals["fp16"]
        assert "data_mesh must be a 1-D DeviceMesh" in refusals["two_d_data_mesh"]


def test_every_other_strategy_refuses_tensor_parallel_parameters():
    """Only MultiWorkerMirrored (and its subclasses that say so) overrides the refusal; the
    parameter-server strategy, which needs a cluster of servers to build, inherits it."""
    assert spread.ParameterServerStrategy._check_new_parameters is Strategy._check_new_parameters


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel must be a positive integer"),
        ({"tensor_parallel": True}, "tensor_parallel must be a positive integer"),
        ({"tensor_parallel": 2, "data_mesh": object()}, "not both"),
        ({"data_mesh": object()}, "data_mesh must be a 1-D DeviceMesh"),
        ({"communication": "hierarchical", "tensor_parallel": 2}, "does not combine with tensor parallelism"),
    ],
)
def test_bad_tensor_parallel_arguments_are_refused_before_joining(kwargs, message):
    with pytest.raises(ValueError, match=message):
        spread.MultiWorkerMirroredStrategy(**kwargs)


def test_plain_module_untouched_by_refusal_check():
    """A model without DTensors passes every strategy's check (the refusal costs nothing else)."""
    strategy = spread.OneDeviceStrategy("cpu")
    model = strategy.prepare_model(nn.Linear(2, 2))
    assert model.weight.device.type == "cpu"
