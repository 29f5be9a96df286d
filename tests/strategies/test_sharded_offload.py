"""ShardedStrategy(offload=...) on a CPU: optimizer state (and with "parameters" the parameter shards) in
memory-mapped files; equal to one device with SGD+momentum, Adam and AdamW at every stage it applies
to; its state is the real one through the state seam (gathered, and resumed from a backup); the files
are gone at the end; and a model whose Adam state exceeds a process's memory limit trains with it and
not without it. (Pinned host memory beside a GPU: tests/gpu/test_sharded_offload_on_gpu.py.)
"""

from __future__ import annotations

import os
import resource

import pytest
import torch
from _equivalence_cases import GLOBAL_BATCH, STEPS, make_data, make_model
from torch import nn

import spread
from spread.errors import SpreadError
from spread.memory.host_store import DiskStore, is_offloaded
from spread.strategies import sharded_offload
from spread.testing import launch_ranks, run_ranks
from spread.train.callbacks import BackupAndRestore, Callback

WORLD = 2
TOLERANCE = 1e-5
# (shard, offload): offload="parameters" needs shard="parameters"
CONFIGS = (
    ("optimizer", "optimizer"),
    ("gradients", "optimizer"),
    ("parameters", "optimizer"),
    ("parameters", "parameters"),
)
OPTIMIZERS = ("sgd_momentum", "adam", "adamw")


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def _loop(strategy, optimizer_name: str, *, init_seed: int = 0) -> dict:
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = _optimizer(optimizer_name, model)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, shuffle=True, seed=7)
    steps = 0
    while steps < STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(lambda x, y: loss_fn(model(x), y).backward(), args=(x, y))
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    placed = {}
    if isinstance(strategy, spread.ShardedStrategy) and strategy.offload:
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        placed = {
            "state_offloaded": all(
                is_offloaded(v) for p in shards for k, v in optimizer.state[p].items() if k != "step"
            ),
            "shards_offloaded": [is_offloaded(p) for p in shards],
            "report": strategy.memory_report(optimizer),
        }
    return {
        "weights": strategy.full_state_dict(model),
        "optimizer": strategy.full_state_dict(optimizer),
        **placed,
    }


@pytest.fixture(scope="module")
def reference() -> dict:
    return {name: _loop(spread.OneDeviceStrategy("cpu"), name) for name in OPTIMIZERS}


def _equivalence_job(root: str) -> dict:
    sharded_offload.STEP_CHUNK_BYTES = 600  # several chunks a step, each with its own new state
    rank = int(os.environ["RANK"])
    out = {}
    owner = None
    try:
        for shard, offload in CONFIGS:
            strategy = spread.ShardedStrategy(shard, offload=offload, offload_dir=root)
            owner = owner or strategy
            directory = strategy._offload.directory
            for name in OPTIMIZERS:  # non-chief ranks start from other weights: the chief's win
                out[(shard, offload, name)] = _loop(strategy, name, init_seed=rank * 101)
            out[(shard, offload, "files")] = os.listdir(directory)  # unlinked once mapped
            if strategy is not owner:
                strategy.close()
                out[(shard, offload, "removed")] = not os.path.exists(directory)
        return out
    finally:
        if owner is not None:
            owner.close()


def _assert_close(got: dict, expected: dict, who: str) -> None:
    for key, value in expected.items():
        diff = float((got[key] - value).abs().max())
        assert diff <= TOLERANCE, f"{who} {key}: {diff:.2e}"


@pytest.mark.processes
def test_offload_equals_one_device_with_its_state_in_files(reference, tmp_path):
    results = run_ranks(_equivalence_job, WORLD, args=(str(tmp_path),), timeout=300)
    for rank, result in enumerate(results):
        for shard, offload in CONFIGS:
            for name in OPTIMIZERS:
                who = f"rank {rank} shard={shard} offload={offload} {name}"
                got, expected = result[(shard, offload, name)], reference[name]
                _assert_close(got["weights"], expected["weights"], who)
                assert got["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys(), who
                for index, state in expected["optimizer"]["state"].items():
                    _assert_close(got["optimizer"]["state"][index], state, f"{who} state[{index}]")
                assert got["state_offloaded"], who
                assert all(got["shards_offloaded"]) == (offload == "parameters"), who
                report = got["report"]
                expected_off = report.optimizer_state_bytes + (
                    report.parameter_bytes if offload == "parameters" else 0
                )
                # "step" counts stay in memory (a few bytes each)
                assert 0 <= expected_off - report.offloaded_bytes <= 64 * 8, who
            assert result[(shard, offload, "files")] == [], who
            if (shard, offload) != CONFIGS[0]:
                assert result[(shard, offload, "removed")], who
    assert os.listdir(tmp_path) == []  # every rank's directory is gone


# -- checkpoints: a backup of offloaded state resumes with the real values -------------------------
N, BATCH = 96, 16


class _Crash(Callback):
    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 10:
            raise RuntimeError("simulated crash")


def _fit(strategy, backup_dir: str | None, *, crash: bool = False) -> dict:
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks: list[Callback] = [] if backup_dir is None else [BackupAndRestore(backup_dir, save_freq=3)]
    if crash:
        callbacks.append(_Crash())
    g = torch.Generator().manual_seed(1)
    data = torch.randn(N, 16, generator=g), torch.randint(0, 4, (N,), generator=g)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
    trainer.fit(data, epochs=2, global_batch_size=BATCH, seed=7, verbose=0)
    return {"weights": strategy.full_state_dict(model), "optimizer": strategy.full_state_dict(optimizer)}


def _resume_job(shard: str, offload: str | None, backup_dir: str | None) -> dict:
    strategy = spread.ShardedStrategy(shard, offload=offload)
    try:
        if backup_dir is not None:
            with pytest.raises(RuntimeError, match="simulated crash"):
                _fit(strategy, backup_dir, crash=True)
        return _fit(strategy, backup_dir)
    finally:
        strategy.close()


@pytest.mark.processes
@pytest.mark.parametrize(("shard", "offload"), [("gradients", "optimizer"), ("parameters", "parameters")])
def test_a_backup_of_offloaded_state_resumes_equal_to_an_uninterrupted_run(shard, offload, tmp_path):
    (expected, _) = run_ranks(_resume_job, WORLD, args=(shard, None, None), timeout=180)
    resumed = run_ranks(_resume_job, WORLD, args=(shard, offload, str(tmp_path)), timeout=180)
    for rank, got in enumerate(resumed):
        _assert_close(got["weights"], expected["weights"], f"rank {rank}")
        for index, state in expected["optimizer"]["state"].items():
            assert float(state["exp_avg_sq"].abs().max()) > 0  # real moments, not zeros
            _assert_close(got["optimizer"]["state"][index], state, f"rank {rank} state[{index}]")


# -- bad input --------------------------------------------------------------------------------------
def test_an_unknown_offload_is_refused_by_name():
    with pytest.raises(ValueError, match=r"offload must be None, 'optimizer' or 'parameters', got 'cpu'"):
        spread.ShardedStrategy("parameters", offload="cpu")


@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_offloading_parameters_below_shard_parameters_is_refused(shard):
    with pytest.raises(ValueError, match=rf"offload='parameters' needs shard='parameters'.*{shard!r}"):
        spread.ShardedStrategy(shard, offload="parameters")


def test_offload_dir_without_offload_is_refused():
    with pytest.raises(ValueError, match=r"offload_dir= .* offload is None"):
        spread.ShardedStrategy("parameters", offload_dir="/tmp/x")


def _closure_job() -> str:
    strategy = spread.ShardedStrategy("parameters", offload="optimizer")
    try:
        with strategy.scope():
            model = nn.Linear(4, 2)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def closure():
            optimizer.zero_grad()
            loss = model(torch.ones(1, 4)).sum()
            strategy.run(lambda: loss.backward())
            return loss

        with pytest.raises(SpreadError, match=r"cannot re-run a closure"):
            optimizer.step(closure)
        return "refused"
    finally:
        strategy.close()


@pytest.mark.processes
def test_a_step_with_a_closure_is_refused_under_offload():
    assert run_ranks(_closure_job, 1, timeout=60) == ["refused"]


def test_the_disk_store_unlinks_its_files_and_removes_its_directory(tmp_path):
    store = DiskStore(tmp_path, rank=3)
    t = store.empty(1000, torch.float32)
    t.fill_(2.0)
    assert is_offloaded(t) and not is_offloaded(torch.zeros(3))
    assert os.path.basename(store.directory).startswith("spread-offload-rank3-")
    assert os.listdir(store.directory) == []
    store.close()
    assert not os.path.exists(store.directory)
    assert float(t.sum()) == 2000.0  # the mapping outlives the file's name
    with pytest.raises(RuntimeError, match="closed"):
        store.empty(1, torch.float32)


# -- a per-process memory limit -----------------------------------------------------------------------
# 16 x Linear(1024, 1024): 16.8 M parameters, 67 MB; at 2 processes and shard="parameters" a rank holds
# 34 MB of parameter shards, 34 MB of gradient shards and 67 MB of Adam state. The limit, RLIMIT_DATA,
# bounds a process's private writable mappings (its anonymous memory: the CPU allocator's tensors),
# not shared file mappings (the offloaded state), where RLIMIT_AS would count both. Set after the model
# is built, at 75 MB above: the gradient shards and a few layers' transients fit (offloaded, a rank
# trained under 60 MB), the gradients and the Adam state do not (without, it failed at 90 MB).
WIDTH, LAYERS = 1024, 16
LIMIT_ABOVE_START = 75 * 2**20


def _vm_data() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmData")


def _limited_job(offload: str | None) -> str:
    torch.set_num_threads(1)
    sharded_offload.STEP_CHUNK_BYTES = 8 * 2**20  # one layer's shard at a time
    strategy = spread.ShardedStrategy("parameters", units=(nn.Linear,), offload=offload)
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + LIMIT_ABOVE_START, resource.RLIM_INFINITY))
        x = torch.randn(8, WIDTH)
        for _ in range(3):
            optimizer.zero_grad()
            strategy.run(lambda: model(x).pow(2).mean().backward())
            optimizer.step()
        report = strategy.memory_report(optimizer)
        return f"trained, {report.optimizer_state_bytes - report.offloaded_bytes} state bytes in memory"
    finally:
        strategy.close()


@pytest.mark.processes
def test_a_model_whose_adam_state_exceeds_the_memory_limit_trains_with_it_offloaded(monkeypatch):
    # Freed tensors unmapped at once (glibc reads this when a process starts, so it is set here, for
    # the ranks to inherit): otherwise the heap keeps them and the limit sees them as used.
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(2**16))
    env = {"OMP_NUM_THREADS": "1"}
    with_offload = launch_ranks(_limited_job, WORLD, args=("optimizer",), timeout=180, env=env)
    assert all(r.ok for r in with_offload), with_offload[0].describe()
    assert all(r.value.startswith("trained") for r in with_offload)
    without = launch_ranks(_limited_job, WORLD, args=(None,), timeout=180, env=env, collective_timeout=15)
    assert not any(r.ok for r in without)
    assert "memory" in without[0].describe()
