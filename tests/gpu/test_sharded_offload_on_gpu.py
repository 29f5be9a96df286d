"""ShardedStrategy(offload=...) beside a GPU: the shards the optimizer steps, their gradients and its
state live in pinned host memory, the step runs on the CPU, the model computes on the GPU; equal to
the CPU's one device (SGD+momentum, AdamW), with the real state gathered, resumed from a backup.
(The same on a CPU machine, state in memory-mapped files: tests/strategies/test_sharded_offload.py.)

Skipped without CUDA; run on a GPU machine with ``python -m pytest tests/gpu``. One rank: NCCL refuses
two ranks on one GPU. TF32 off, so float32 differs from the CPU's only by summation order.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.testing import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (and SPREAD_TEST_GPU=1, see tests/conftest.py)"
)

TOLERANCE = 1e-4
STEPS, BATCH = 12, 16
CONFIGS = (
    ("optimizer", "optimizer"),
    ("gradients", "optimizer"),
    ("parameters", "optimizer"),
    ("parameters", "parameters"),
)
OPTIMIZERS = ("sgd_momentum", "adamw")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS * BATCH, 10, generator=g), torch.randint(0, 3, (STEPS * BATCH,), generator=g)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)


def _loop(strategy, name: str) -> dict:
    with strategy.scope():
        model = _model()
        optimizer = _optimizer(name, model)
    x, y = _data()
    loss_fn = nn.CrossEntropyLoss()
    device = strategy.device
    for i in range(STEPS):
        xb, yb = x[i * BATCH : (i + 1) * BATCH].to(device), y[i * BATCH : (i + 1) * BATCH].to(device)
        optimizer.zero_grad()
        strategy.run(lambda a, b: loss_fn(model(a), b).backward(), args=(xb, yb))
        optimizer.step()
    out: dict = {
        "weights": {k: v.detach().cpu() for k, v in strategy.full_state_dict(model).items()},
        "optimizer": strategy.full_state_dict(optimizer),
    }
    if isinstance(strategy, spread.ShardedStrategy):
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        out["model_on"] = {p.device.type for p in model.parameters()}
        out["shards_pinned"] = all(p.device.type == "cpu" and p.is_pinned() for p in shards)
        optimizer.zero_grad(set_to_none=False)
        strategy.run(lambda a, b: loss_fn(model(a), b).backward(), args=(xb, yb))
        out["grads_pinned"] = all(p.grad is not None and p.grad.is_pinned() for p in shards)
        out["state_on"] = {
            v.device.type for p in shards for k, v in optimizer.state[p].items() if k != "step"
        }
        out["report"] = strategy.memory_report(optimizer)
    return out


def _job(shard: str, offload: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    strategy = spread.ShardedStrategy(shard, offload=offload)
    try:
        return {name: _loop(strategy, name) for name in OPTIMIZERS}
    finally:
        strategy.close()


@pytest.fixture(scope="module")
def cpu_reference() -> dict:
    return {name: _loop(spread.OneDeviceStrategy("cpu"), name) for name in OPTIMIZERS}


def _max_difference(got: dict, expected: dict) -> float:
    return max(float((got[k].cpu() - v).abs().max()) for k, v in expected.items())


@pytest.mark.processes
@pytest.mark.parametrize(("shard", "offload"), CONFIGS)
def test_offload_beside_the_gpu_equals_the_cpu_with_state_in_pinned_memory(shard, offload, cpu_reference):
    (result,) = run_ranks(_job, 1, args=(shard, offload), timeout=240)
    for name in OPTIMIZERS:
        got, expected = result[name], cpu_reference[name]
        assert _max_difference(got["weights"], expected["weights"]) < TOLERANCE, name
        for index, state in expected["optimizer"]["state"].items():
            assert _max_difference(got["optimizer"]["state"][index], state) < TOLERANCE, (name, index)
        assert got["model_on"] == {"cuda"}, name
        assert got["shards_pinned"] and got["grads_pinned"], name
        assert got["state_on"] == {"cpu"}, name
        report = got["report"]
        held_off = report.optimizer_state_bytes + report.gradient_bytes  # the shards' gradients
        assert report.offloaded_bytes >= held_off - 1024, name


def _fit(shard: str, offload: str | None, directory: str, *, crash: bool = False) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    strategy = spread.ShardedStrategy(shard, offload=offload)

    class Crash(spread.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            if crash and self.trainer.global_step == 10:
                raise RuntimeError("simulated crash")

    try:
        with strategy.scope():
            model = _model()
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        callbacks = [spread.callbacks.BackupAndRestore(directory, save_freq=3), Crash()]
        trainer = spread.Trainer(
            model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks
        )
        x, y = _data()
        try:
            trainer.fit((x[:96], y[:96]), epochs=2, global_batch_size=16, seed=7, verbose=0)
        except RuntimeError as exc:
            if "simulated crash" not in str(exc):
                raise
            return {}
        return {k: v.detach().cpu() for k, v in strategy.full_state_dict(model).items()}
    finally:
        strategy.close()


@pytest.mark.processes
@pytest.mark.parametrize(("shard", "offload"), [("gradients", "optimizer"), ("parameters", "parameters")])
def test_an_offloaded_backup_resumes_on_the_gpu(shard, offload, tmp_path):
    (expected,) = run_ranks(_fit, 1, args=(shard, None, str(tmp_path / "ref")), timeout=240)
    run_ranks(_fit, 1, args=(shard, offload, str(tmp_path / "run")), kwargs={"crash": True}, timeout=240)
    (resumed,) = run_ranks(_fit, 1, args=(shard, offload, str(tmp_path / "run")), timeout=240)
    assert _max_difference(resumed, expected) < 1e-5
