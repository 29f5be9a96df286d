"""Hybrid sharding (``ShardedStrategy(shard_group_size=...)``): 4 processes as 2 groups of 2 equal one
device at every stage (Adam and SGD, a model that is no Sequential, clipping by the global norm,
uneven final batches), each rank holding half the model state; a backup written as 2 x 2 resumes at 2
processes (one group) and at 4 as 4 x 1 with the uninterrupted run's weights and optimizer state;
group sizes that do not split the job are refused by name before the job is joined."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _equivalence_cases import GLOBAL_BATCH, make_data
from torch import nn

import spread
from spread.cluster import from_torchrun_env
from spread.testing import run_ranks
from spread.train.callbacks import BackupAndRestore, Callback

CONFIGS = ("optimizer", "gradients", "parameters", "parameters/blocks")
OPTIMIZERS = ("adam", "sgd_momentum")
TOLERANCE = 1e-5


class Block(nn.Module):
    """A residual block: the skip connection and the norm make the model no chain of layers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(self.norm(x))))


class ResidualNet(nn.Module):
    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.embed = nn.Linear(10, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _strategy(config: str, shard_group_size) -> spread.ShardedStrategy:
    shard, _, units = config.partition("/")
    return spread.ShardedStrategy(
        shard=shard, units=(Block,) if units == "blocks" else "model", shard_group_size=shard_group_size
    )


def _fit(strategy, optimizer_name: str, *, init_seed: int = 0, callbacks=()) -> dict:
    """Two epochs of 10 steps (the last of each uneven), clipped by the global gradient norm."""
    with strategy.scope():
        torch.manual_seed(init_seed)
        model = ResidualNet()
        optimizer = _optimizer(optimizer_name, model)
    trainer = spread.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        strategy=strategy,
        callbacks=list(callbacks),
        clip_grad_norm=0.5,
    )
    trainer.fit(make_data(), epochs=2, global_batch_size=GLOBAL_BATCH, seed=7, verbose=0)
    return {"weights": strategy.full_state_dict(model), "optimizer": strategy.full_state_dict(optimizer)}


@pytest.fixture(scope="module")
def reference() -> dict:
    return {name: _fit(spread.OneDeviceStrategy("cpu"), name) for name in OPTIMIZERS}


def _assert_close(got: dict, expected: dict, who: str) -> None:
    assert got["weights"].keys() == expected["weights"].keys(), who
    for key, value in expected["weights"].items():
        torch.testing.assert_close(got["weights"][key], value, rtol=TOLERANCE, atol=1e-6, msg=f"{who} {key}")
    assert got["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"], who
    for index, state in expected["optimizer"]["state"].items():
        for key, value in state.items():
            mine = got["optimizer"]["state"][index][key]
            torch.testing.assert_close(mine, value, rtol=1e-4, atol=1e-7, msg=f"{who} state[{index}][{key}]")


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -2, 2.0, True, "two", "nodes"])
def test_a_group_size_that_is_no_size_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"shard_group_size must be None \(every process\), 'node'"):
        spread.ShardedStrategy(shard_group_size=value)


def _cluster(world: int, local: int) -> spread.cluster.ClusterSpec:
    return from_torchrun_env(
        {
            "RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(local),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",  # never reached: refused before joining
        }
    )


@pytest.mark.parametrize(
    "value,local,message",
    [
        (3, 4, r"shard_group_size=3 does not divide the job's 4 processes \(3\)"),
        (8, 4, r"shard_group_size=8 does not divide the job's 4 processes"),
        ("node", 3, r"shard_group_size='node' does not divide the job's 4 processes \('node' is 3 processes"),
    ],
)
def test_groups_that_do_not_split_the_job_are_refused_before_joining_it(value, local, message):
    with pytest.raises(ValueError, match=message):
        spread.ShardedStrategy(shard_group_size=value, cluster=_cluster(4, local))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "options",
    [{"shard_group_size": 2}, {"shard_group_size": "node"}, {"offload": "optimizer"}],
)
def test_recovery_without_restart_with_hybrid_groups_or_offload_is_refused_before_joining(
    options, monkeypatch
):
    """The buddy copy behind --recover covers the plain ring of shards only: refused by name, not a
    recovery that would rebuild the wrong shards."""
    monkeypatch.setenv("SPREAD_RECOVER", "1")
    with pytest.raises(ValueError, match=r"--recover .* is not available for ShardedStrategy with offload="):
        spread.ShardedStrategy(cluster=_cluster(4, 2), **options)
    assert not torch.distributed.is_initialized()


# -- equal to one device -----------------------------------------------------------------------------
def _hybrid_job() -> dict:
    rank = int(os.environ["RANK"])
    out: dict = {}
    owner = None
    try:
        for config in CONFIGS:
            strategy = _strategy(config, "node")  # LOCAL_WORLD_SIZE=2: two "machines" of 2
            owner = owner or strategy
            mesh = strategy.mesh
            assert mesh is not None and mesh.mesh_dim_names == ("replicate", "shard")
            out[config] = {
                "mesh": mesh.mesh.tolist(),
                "shard_rank": strategy.shard_rank,
                "memory": _memory(strategy),  # first: the report counts every model the strategy holds
                **{name: _fit(strategy, name, init_seed=rank * 101) for name in OPTIMIZERS},
            }
            if strategy is not owner:
                strategy.close()
        return out
    finally:
        if owner is not None:
            owner.close()


def _memory(strategy) -> dict:
    """Model-state bytes per rank after one Adam step, and the one-device model's bytes."""
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    strategy.run(lambda: model(torch.randn(4, 64)).square().mean().backward())
    optimizer.step()
    report = strategy.memory_report(optimizer)
    return {
        "parameters": report.parameter_bytes,
        "gradients": report.gradient_bytes,
        "optimizer_state": report.optimizer_state_bytes,
        "model": sum(p.numel() for p in model.parameters()) * 4,
    }


@pytest.mark.processes
def test_two_groups_of_two_equal_one_device_at_every_stage(reference):
    two_machines = {r: {"LOCAL_RANK": str(r % 2), "GROUP_RANK": str(r // 2)} for r in range(4)}
    per_rank = run_ranks(_hybrid_job, 4, env={"LOCAL_WORLD_SIZE": "2"}, rank_env=two_machines, timeout=300)
    for rank, configs in enumerate(per_rank):
        for config, result in configs.items():
            who = f"rank {rank}, {config}"
            assert result["mesh"] == [[0, 1], [2, 3]] and result["shard_rank"] == rank % 2, who
            for name in OPTIMIZERS:
                _assert_close(result[name], reference[name], f"{who}, {name}")
            # Each rank holds half the model state (its group's half), not a quarter, not all of it.
            memory, half = result["memory"], result["memory"]["model"] / 2
            assert memory["optimizer_state"] == pytest.approx(2 * half, rel=0.02), who  # Adam's two moments
            full_parameters = 1 if config.startswith("parameters") else 2
            assert memory["parameters"] == pytest.approx(full_parameters * half, rel=0.02), who
            full_gradients = 2 if config == "optimizer" else 1  # ZeRO-1 keeps the all-reduced ones
            assert memory["gradients"] == pytest.approx(full_gradients * half, rel=0.02), who


# -- resume at another world size and group size -----------------------------------------------------
class _Crash(Callback):
    """Every rank raises after step 10 (backups of steps 3, 6 and 9 written)."""

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 10:
            raise RuntimeError("simulated crash")


def _backed_up_fit(directory: str, shard_group_size, *, crash: bool = False) -> dict:
    strategy = spread.ShardedStrategy(shard="parameters", shard_group_size=shard_group_size)
    try:
        backup = BackupAndRestore(directory, save_freq=3)
        result = _fit(strategy, "adam", callbacks=[backup, *([_Crash()] if crash else [])])
        return {**result, "restored": backup.restored_step, "from": backup.resumed_from_replicas}
    finally:
        strategy.close()


def _crash_job(directory: str) -> None:
    with pytest.raises(RuntimeError, match="simulated crash"):
        _backed_up_fit(directory, 2, crash=True)


@pytest.mark.processes
def test_a_two_by_two_backup_resumes_at_two_processes_and_as_four_by_one(tmp_path, reference):
    """Weights and Adam's state end as the uninterrupted run's (one device's: the test above)."""
    run_ranks(_crash_job, 4, args=(str(tmp_path / "crashed"),), timeout=240)
    for nprocs, size in ((2, None), (4, 1)):
        directory = tmp_path / f"resume-{nprocs}x{size}"
        shutil.copytree(tmp_path / "crashed", directory)  # each resume starts from the same backup
        for rank, result in enumerate(
            run_ranks(_backed_up_fit, nprocs, args=(str(directory), size), timeout=240)
        ):
            who = f"{nprocs} processes, shard_group_size={size}, rank {rank}"
            assert result["restored"] == 9, who
            assert result["from"] == (4 if nprocs != 4 else None), who  # set when the replica count differs
            _assert_close(result, reference["adam"], who)


def _one_process_job() -> dict:
    out = {}
    for size in ("node", 1):  # one group of one process: plain sharding, allowed
        strategy = spread.ShardedStrategy(shard="parameters", shard_group_size=size)
        try:
            assert strategy.mesh is None
            out[size] = _fit(strategy, "adam")
        finally:
            strategy.close()
    return out


@pytest.mark.processes
def test_a_job_of_one_process_is_one_group(reference):
    for size, result in run_ranks(_one_process_job, 1, timeout=120)[0].items():
        _assert_close(result, reference["adam"], f"shard_group_size={size!r}")


# -- hybrid sharding with offload ----------------------------------------------------------------------
def _hybrid_offload_job(directory: str) -> dict:
    out, owner = {}, None  # the first strategy owns the job's group: closed last, as in _hybrid_job
    try:
        for offload in ("optimizer", "parameters"):
            strategy = spread.ShardedStrategy(
                shard="parameters", units=(Block,), shard_group_size=2, offload=offload, offload_dir=directory
            )
            owner = owner or strategy
            out[offload] = _fit(strategy, "adam")
            if strategy is not owner:
                strategy.close()
        return out
    finally:
        if owner is not None:
            owner.close()


@pytest.mark.processes
def test_two_groups_of_two_with_offloaded_shards_equal_one_device(tmp_path, reference):
    """Offload composes with hybrid sharding: each group's shards, in memory-mapped files here, step to
    one device's weights and Adam state."""
    per_rank = run_ranks(_hybrid_offload_job, 4, args=(str(tmp_path),), timeout=300)
    for rank, results in enumerate(per_rank):
        for offload, result in results.items():
            _assert_close(result, reference["adam"], f"rank {rank}, offload={offload}")
