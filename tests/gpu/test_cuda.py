"""What only a GPU can show: every strategy that fits on one CUDA device equals the CPU's one device,
CUDA autocast and fp16 loss scaling, compiled models on inductor's GPU kernels, pinned-memory offload,
NCCL process groups (one rank: NCCL refuses two ranks on one GPU), and the clear error when a
machine has fewer GPUs than processes.

Skipped without CUDA (the CI machine has none); run on a GPU machine with
``python -m pytest tests/gpu``. Weights are compared with TF32 off, so the GPU's float32 differs from
the CPU's only by summation order.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import spread
from spread.memory import OffloadActivations, checkpoint_blocks
from spread.testing import launch_ranks, run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (and SPREAD_TEST_GPU=1, see tests/conftest.py)"
)

TOLERANCE = 1e-4  # float32 on GPU vs CPU: different summation orders over 20 steps
GLOBAL_BATCH, STEPS = 16, 20


@pytest.fixture(autouse=True)
def _no_tf32():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(151, 10, generator=g)
    return x, torch.randint(0, 3, (151,), generator=g)


class Net(nn.Module):
    """Not a Sequential: a residual block and a head, as people write them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(3)
        )
        self.head = nn.Linear(32, 3)
        self.seen: set[torch.dtype] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        self.seen.add(h.dtype)
        return self.head(h)


def _initial_weights() -> dict[str, torch.Tensor]:
    """Built on the CPU: under a GPU scope, parameters are created on the GPU from CUDA's RNG."""
    torch.manual_seed(0)
    return Net().state_dict()


def _custom_loop(
    strategy: spread.Strategy, *, compiled: bool = False, data_device: str = "cpu"
) -> dict[str, torch.Tensor]:
    initial = _initial_weights()
    with strategy.scope():
        model = Net()
        model.load_state_dict(initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    step_model = torch.compile(model) if compiled else model
    loss_fn = nn.CrossEntropyLoss()
    data = tuple(t.to(data_device) for t in _data())
    dataset = strategy.distribute_dataset(data, GLOBAL_BATCH, shuffle=True, seed=7)

    def step_fn(x, y):
        loss = loss_fn(step_model(x), y)
        loss.backward()
        return loss

    steps = 0
    while steps < STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(step_fn, args=(x, y))
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    return {k: v.detach().cpu().clone() for k, v in strategy.full_state_dict(model).items()}


def _max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


@pytest.fixture(scope="module")
def cpu_reference() -> dict[str, torch.Tensor]:
    return _custom_loop(spread.OneDeviceStrategy("cpu"))


def test_the_default_strategy_and_one_device_pick_the_gpu():
    assert spread.OneDeviceStrategy().device.type == "cuda"
    assert spread.MirroredStrategy().num_replicas_in_sync == 1  # one replica per GPU by default


@pytest.mark.parametrize(
    "make",
    [
        lambda: spread.OneDeviceStrategy("cuda"),
        lambda: spread.MirroredStrategy(devices=["cuda:0"]),
        lambda: spread.MirroredStrategy(devices=["cuda:0", "cuda:0"], cross_device_ops="accumulate"),
        lambda: spread.MirroredStrategy(devices=["cuda:0", "cuda:0"], cross_device_ops="reduce_to_one"),
        lambda: spread.MirroredStrategy(
            devices=["cuda:0", "cuda:0", "cuda:0"], cross_device_ops="hierarchical_copy"
        ),
    ],
    ids=[
        "one_device",
        "mirrored_1",
        "mirrored_2_accumulate",
        "mirrored_2_reduce_to_one",
        "mirrored_3_hierarchical",
    ],
)
def test_in_process_strategies_on_the_gpu_equal_the_cpu(make, cpu_reference):
    strategy = make()
    try:
        weights = _custom_loop(strategy)
    finally:
        strategy.close()
    assert _max_relative_difference(weights, cpu_reference) < TOLERANCE


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dataset_already_on_the_gpu_trains_as_the_cpu_one_does(replicas, cpu_reference):
    """Small data sets are often moved to the GPU once, before training (the batches are then
    gathered there); the same samples in the same order give the CPU's weights."""
    strategy = spread.MirroredStrategy(devices=["cuda:0"] * replicas)
    try:
        weights = _custom_loop(strategy, data_device="cuda")
    finally:
        strategy.close()
    assert _max_relative_difference(weights, cpu_reference) < TOLERANCE


@pytest.mark.parametrize("replicas", [1, 2])
def test_cpu_tensors_given_to_run_reach_each_replica_on_its_gpu(replicas):
    strategy = spread.MirroredStrategy(devices=["cuda:0"] * replicas)
    with strategy.scope():
        model = Net()
    x = torch.randn(4, 10)  # a CPU tensor, not distributed: every replica gets it, on its device
    try:
        out = strategy.run(
            lambda t, scale=None: (model(t) * scale).sum().backward(), (x,), {"scale": torch.tensor(2.0)}
        )
    finally:
        strategy.close()
    assert out is None or all(v is None for v in getattr(out, "values", [out]))
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())


def test_a_compiled_model_on_the_gpu_equals_the_cpu(cpu_reference, monkeypatch):
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)  # no compile-worker processes
    torch._dynamo.reset()
    strategy = spread.OneDeviceStrategy("cuda")
    try:
        weights = _custom_loop(strategy, compiled=True)
    finally:
        strategy.close()
        torch._dynamo.reset()
    assert _max_relative_difference(weights, cpu_reference) < TOLERANCE


def _trainer(strategy: spread.Strategy, precision: str, **kwargs) -> spread.Trainer:
    initial = _initial_weights()
    with strategy.scope():
        model = Net()
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, precision=precision, **kwargs
    )


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("replicas", [1, 2])
def test_cuda_autocast_computes_in_the_chosen_dtype_with_float32_weights(precision, dtype, replicas):
    strategy = spread.MirroredStrategy(devices=["cuda:0"] * replicas)
    try:
        trainer = _trainer(strategy, precision, clip_grad_norm=1.0)
        history = trainer.fit(_data(), epochs=4, global_batch_size=GLOBAL_BATCH, verbose=0)
        predictions = trainer.predict(_data()[0])
    finally:
        strategy.close()
    assert trainer.model.seen == {dtype}
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in trainer.model.parameters())
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert predictions.dtype == torch.float32
    if precision == "fp16":
        assert isinstance(trainer.precision.scaler, torch.amp.GradScaler)
        assert trainer.precision.scaler.get_scale() > 0


def test_fp16_overflow_on_the_gpu_is_skipped_by_the_scaler():
    trainer = _trainer(spread.OneDeviceStrategy("cuda"), "fp16")
    trainer.precision.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)  # overflows fp16 at first
    trainer.fit(_data(), epochs=3, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert trainer.scaler_skipped_steps >= 1 and trainer.skipped_steps == 0
    assert trainer.precision.scaler.get_scale() < 2.0**40
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_trainer_fit_on_the_gpu_equals_the_cpu():
    results = {}
    for device in ("cpu", "cuda"):
        trainer = _trainer(spread.OneDeviceStrategy(device), "32")
        history = trainer.fit(
            _data(), epochs=3, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=3, verbose=0
        )
        results[device] = (
            history.history["loss"],
            {k: v.cpu() for k, v in trainer.model.state_dict().items()},
        )
    assert results["cuda"][0] == pytest.approx(results["cpu"][0], rel=1e-4)
    assert _max_relative_difference(results["cuda"][1], results["cpu"][1]) < TOLERANCE


def test_pinned_offload_and_checkpointing_on_the_gpu_keep_the_gradients():
    torch.manual_seed(0)
    plain = Net().cuda()
    tooled = Net().cuda()
    tooled.load_state_dict(plain.state_dict())
    checkpoint_blocks(tooled, every=1)
    x, y = (t.cuda() for t in _data())
    nn.functional.cross_entropy(plain(x), y).backward()
    offload = OffloadActivations(keep=tooled.parameters())
    with offload:
        nn.functional.cross_entropy(tooled(x), y).backward()
    torch.cuda.synchronize()
    assert offload.pin_memory and offload.offloaded > 0 and offload.restored >= offload.offloaded
    for (name, a), b in zip(plain.named_parameters(), tooled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_hugging_face_gpt2_trains_in_bf16_on_the_gpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128, n_positions=32)
    strategy = spread.MirroredStrategy(devices=["cuda:0", "cuda:0"])
    with strategy.scope():
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    trainer = spread.Trainer(model, optimizer, None, strategy=strategy, precision="bf16")
    try:
        history = trainer.fit(data, epochs=3, global_batch_size=16, verbose=0)
    finally:
        strategy.close()
    assert history.history["loss"][-1] < history.history["loss"][0]


class _CrashAt(spread.callbacks.Callback):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.step:
            raise KeyboardInterrupt("simulated crash")


def _fit_with_dropout(backup_dir, extra=()) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(100, 10, generator=g), torch.randint(0, 3, (100,), generator=g)
    strategy = spread.OneDeviceStrategy("cuda")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks = [spread.callbacks.BackupAndRestore(str(backup_dir), save_freq=3), *extra]
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
    trainer.fit((x, y), epochs=3, global_batch_size=16, verbose=0)
    return {k: v.cpu().clone() for k, v in model.state_dict().items()}


def test_a_resumed_fit_with_gpu_dropout_equals_the_uninterrupted_one(tmp_path):
    """Dropout on a GPU draws from the GPU's generator: the backup must carry its state."""
    torch.manual_seed(123)
    reference = _fit_with_dropout(tmp_path / "ref")
    torch.manual_seed(123)
    with pytest.raises(KeyboardInterrupt):
        _fit_with_dropout(tmp_path / "run", extra=[_CrashAt(10)])
    torch.manual_seed(999)  # the restarted process: other RNG states (CPU and GPU), other weights
    resumed = _fit_with_dropout(tmp_path / "run")
    for k, v in reference.items():
        assert torch.equal(resumed[k], v), k


def test_a_checkpoint_saved_on_the_gpu_loads_on_the_cpu_and_back(tmp_path):
    """The state seam on a GPU: a custom loop's checkpoint (model, optimizer, a value) written from
    CUDA tensors loads into a CPU model and optimizer, and into another GPU model, in place."""
    gpu = spread.OneDeviceStrategy("cuda")
    with gpu.scope():
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = _data()
    gpu.run(lambda: nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward())
    optimizer.step()
    gpu.save_checkpoint(tmp_path, {"model": model, "optimizer": optimizer, "step": 1}, step=1)
    weights = {k: v.cpu() for k, v in gpu.full_state_dict(model).items()}
    for strategy in (spread.OneDeviceStrategy("cpu"), spread.OneDeviceStrategy("cuda")):
        with strategy.scope():
            torch.manual_seed(1)
            other = Net()
            other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        state = {"model": other, "optimizer": other_optimizer, "step": 0}
        restored = strategy.load_checkpoint(tmp_path, state)
        assert restored is not None and state["step"] == 1
        for k, v in other.state_dict().items():
            assert v.device.type == strategy.device.type and torch.equal(v.cpu(), weights[k]), k
        moments = other_optimizer.state_dict()["state"][0]["exp_avg"]
        assert moments.device.type == strategy.device.type


# --- process strategies: one rank (NCCL refuses two ranks on one GPU) ---


def _process_strategy_job(kind: str) -> dict:
    strategy = {
        "multi_worker_mirrored": lambda: spread.MultiWorkerMirroredStrategy(),
        "multi_worker_mirrored_ring": lambda: spread.MultiWorkerMirroredStrategy("ring"),
        "sharded_parameters": lambda: spread.ShardedStrategy("parameters"),
        "sharded_gradients": lambda: spread.ShardedStrategy("gradients"),
    }[kind]()
    try:
        backend = torch.distributed.get_backend()
        weights = _custom_loop(strategy)
    finally:
        strategy.close()
    return {"backend": backend, "weights": weights}


@pytest.mark.processes
@pytest.mark.parametrize(
    "kind", ["multi_worker_mirrored", "multi_worker_mirrored_ring", "sharded_parameters", "sharded_gradients"]
)
def test_process_strategies_join_nccl_and_equal_the_cpu(kind, cpu_reference):
    (result,) = run_ranks(_process_strategy_job, 1, args=(kind,), timeout=240)
    assert result["backend"] == "nccl"
    assert _max_relative_difference(result["weights"], cpu_reference) < TOLERANCE


def _two_ranks_one_gpu() -> None:
    spread.MultiWorkerMirroredStrategy()


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_more_processes_than_gpus_fails_clearly_before_nccl():
    results = launch_ranks(_two_ranks_one_gpu, 2, timeout=120)
    assert not any(r.ok for r in results)
    for r in results:
        assert "2 processes on this machine but 1 GPU" in r.describe(), r.describe()


# --- ShardedStrategy backups hold CUDA tensors: resumed on the GPU and on two CPU ranks ---


class _CrashAtStep(spread.callbacks.Callback):
    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 10:
            raise RuntimeError("simulated crash")


def _sharded_fit(shard: str, directory: str, *, crash: bool = False) -> dict:
    """Two epochs of 6 steps with a backup every 3; returns the one-device weights, on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    strategy = spread.ShardedStrategy(shard)
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        device = next(model.parameters()).device.type
        backup = spread.callbacks.BackupAndRestore(directory, save_freq=3)
        callbacks = [backup, *([_CrashAtStep()] if crash else [])]
        loss_fn = nn.CrossEntropyLoss()
        trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy, callbacks=callbacks)
        x, y = _data()
        trainer.fit((x[:96], y[:96]), epochs=2, global_batch_size=16, seed=7, verbose=0)
        weights = {k: v.detach().cpu().clone() for k, v in strategy.full_state_dict(model).items()}
        return {"device": device, "restored": backup.restored_step, "weights": weights}
    finally:
        strategy.close()


def _sharded_crash(shard: str, directory: str) -> str:
    with pytest.raises(RuntimeError, match="simulated crash"):
        _sharded_fit(shard, directory, crash=True)
    return "crashed"


@pytest.mark.processes
@pytest.mark.parametrize("shard", ["optimizer", "parameters"])
def test_a_sharded_backup_written_on_the_gpu_resumes_there_and_on_two_cpu_ranks(shard, tmp_path, monkeypatch):
    """DCP writes each rank's CUDA shards; the restore places them on whatever device the ranks use."""

    (reference,) = run_ranks(_sharded_fit, 1, args=(shard, str(tmp_path / "ref")), timeout=240)
    assert reference["device"] == "cuda"
    run_ranks(_sharded_crash, 1, args=(shard, str(tmp_path / "run")), timeout=240)
    shutil.copytree(tmp_path / "run", tmp_path / "cpu")
    (on_gpu,) = run_ranks(_sharded_fit, 1, args=(shard, str(tmp_path / "run")), timeout=240)
    assert on_gpu["restored"] == 9
    assert _max_relative_difference(on_gpu["weights"], reference["weights"]) < 1e-6
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks start with no GPU
    on_cpus = run_ranks(_sharded_fit, 2, args=(shard, str(tmp_path / "cpu")), timeout=240)
    for rank, result in enumerate(on_cpus):
        assert result["device"] == "cpu" and result["restored"] == 9, rank
        assert _max_relative_difference(result["weights"], reference["weights"]) < TOLERANCE, rank
