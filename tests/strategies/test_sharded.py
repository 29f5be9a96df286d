"""ShardedStrategy equals one device on the same global batch at every ZeRO stage (custom loop, Trainer
with clipping and accumulation, uneven final batches), gathers the one-device state for checkpoints,
and holds ~1/N of MultiWorkerMirrored's model state per rank at ``shard="parameters"``."""

from __future__ import annotations

import copy
import os
import time

import _batchnorm_cases as bn_cases
import pytest
import torch
from _equivalence_cases import (
    GLOBAL_BATCH,
    STEPS,
    make_data,
    make_model,
    make_optimizer,
    max_relative_difference,
)
from _sharded_cases import every_stage, make_sharded
from torch import nn

import spread
from spread.memory import micro_batches
from spread.testing import launch_ranks, run_ranks
from spread.train.callbacks import BackupAndRestore, Callback, EarlyStopping

STAGES = ("optimizer", "gradients", "parameters")
# Every stage, and shard="parameters" with a unit per module holding parameters (a block gathered
# and released around each Linear, prefetched in forward and backward).
CONFIGS = (*STAGES, "parameters/modules")
OPTIMIZERS = ("sgd_momentum", "adamw")
TOLERANCE = 1e-5
WORLD = 2


def custom_loop(strategy, optimizer_name: str, *, init_seed: int = 0, accumulate: int = 1) -> dict:
    """The equivalence spine's custom loop (20 steps, two uneven final batches); with ``accumulate``,
    each replica's slice runs as that many micro-batches, all but the last under ``no_sync``."""
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = make_optimizer(optimizer_name, model)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, shuffle=True, seed=7)

    def step_fn(x, y):
        for micro in micro_batches((x, y), accumulate, strategy=strategy):
            mx, my = micro.data
            micro.backward(loss_fn(model(mx), my))

    steps = 0
    while steps < STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(step_fn, args=(x, y))
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    return {
        "weights": strategy.full_state_dict(model),
        "optimizer": strategy.full_state_dict(optimizer),
    }


def fit(strategy, feature: str, *, init_seed: int = 0) -> dict:
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    options: dict = {"clip_grad_norm": 0.3} if feature == "clip_norm" else {}
    if feature == "clip_value_accumulate":
        options = {"clip_grad_value": 0.02, "accumulation_steps": 2}
    callbacks = []
    if feature == "restore_best_weights":
        # mode="max": epoch 1's (higher) loss counts as best, so its weights come back at the end.
        callbacks = [EarlyStopping(monitor="loss", mode="max", patience=5, restore_best_weights=True)]
    trainer = spread.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        strategy=strategy,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7),
        scheduler_interval="step",
        callbacks=callbacks,
        **options,
    )
    validation = make_data() if feature == "clip_norm" else None  # evaluation's forward (no_grad)
    history = trainer.fit(
        make_data(), epochs=2, global_batch_size=GLOBAL_BATCH, seed=7, verbose=0, validation_data=validation
    )
    return {"weights": strategy.full_state_dict(model), "history": history.history}


FEATURES = ("clip_norm", "clip_value_accumulate", "restore_best_weights")


@pytest.fixture(scope="module")
def reference() -> dict:
    one = spread.OneDeviceStrategy("cpu")
    return {
        "loop": {name: custom_loop(one, name) for name in OPTIMIZERS},
        "fit": {f: fit(one, f) for f in FEATURES},
    }


def test_bad_shard_value_is_refused_by_name():
    with pytest.raises(ValueError, match=r"shard must be one of .*'optimizer'.*got 'zero3'"):
        spread.ShardedStrategy(shard="zero3")


def test_registered_by_name():
    assert spread.strategies.STRATEGIES["sharded"] is spread.ShardedStrategy


def _loop_job(strategy, rank: int) -> dict:
    # Non-chief ranks start from other weights: the chief's must win.
    return {
        name: custom_loop(strategy, name, init_seed=rank * 101, accumulate=1 + (name == "adamw"))
        for name in OPTIMIZERS
    }


def _assert_same_optimizer_state(got: dict, expected: dict, who: str) -> None:
    assert got["param_groups"] == expected["param_groups"], who
    assert got["state"].keys() == expected["state"].keys(), who
    for index, state in expected["state"].items():
        for key, value in state.items():
            mine = got["state"][index][key]
            assert mine.shape == value.shape, f"{who} state[{index}][{key}]"
            scale = value.abs().max().clamp_min(1e-12)
            diff = float((mine - value).abs().max() / scale)
            assert diff <= 1e-4, f"{who} state[{index}][{key}]: {diff:.2e}"


@pytest.mark.processes
@pytest.mark.parametrize("nprocs", [WORLD, 3])
def test_custom_loop_equals_one_device_at_every_stage(reference, nprocs):
    """SGD+momentum and AdamW (the latter with 2 micro-batches under no_sync), uneven final batches;
    the gathered optimizer state is one device's too. At 3 processes most parameters do not divide evenly."""
    per_rank = run_ranks(every_stage, nprocs, args=(CONFIGS, _loop_job), timeout=240)
    for rank, stages in enumerate(per_rank):
        for stage, results in stages.items():
            for name in OPTIMIZERS:
                who = f"rank {rank}, shard={stage}, {name}"
                expected = reference["loop"][name]
                diff = max_relative_difference(results[name]["weights"], expected["weights"])
                assert diff <= TOLERANCE, f"{who}: max relative weight difference {diff:.2e}"
                _assert_same_optimizer_state(results[name]["optimizer"], expected["optimizer"], who)


def _fit_job(strategy, rank: int) -> dict:
    return {f: fit(strategy, f, init_seed=rank * 101) for f in FEATURES}


@pytest.mark.processes
def test_trainer_fit_with_clipping_and_accumulation_equals_one_device(reference):
    per_rank = run_ranks(every_stage, WORLD, args=(CONFIGS, _fit_job), timeout=240)
    for rank, stages in enumerate(per_rank):
        for stage, results in stages.items():
            for feature in FEATURES:
                who = f"rank {rank}, shard={stage}, {feature}"
                expected = reference["fit"][feature]
                diff = max_relative_difference(results[feature]["weights"], expected["weights"])
                assert diff <= TOLERANCE, f"{who}: max relative weight difference {diff:.2e}"
                for key, values in expected["history"].items():
                    assert results[feature]["history"][key] == pytest.approx(values, rel=1e-5), who


def _memory_job(strategy) -> dict:
    """Model-state bytes after one AdamW step (before zero_grad: gradients still held)."""
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer = strategy.prepare_optimizer(optimizer)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    with strategy.measure_activations():
        strategy.run(lambda: nn.functional.cross_entropy(model(x), y).backward())
    optimizer.step()
    report = strategy.memory_report(optimizer)
    return {
        "parameters": report.parameter_bytes,
        "gradients": report.gradient_bytes,
        "optimizer_state": report.optimizer_state_bytes,
        "model_state": report.model_state_bytes,
        "activations": report.activation_bytes,
    }


def _memory_every_kind() -> dict:
    owner = spread.MultiWorkerMirroredStrategy()  # owns the process group; the others reuse it
    try:
        out = {"mirrored": _memory_job(owner)}
        for stage in CONFIGS:
            with make_sharded(stage) as strategy:
                out[stage] = _memory_job(strategy)
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_memory_report_shrinks_with_each_stage():
    per_rank = run_ranks(_memory_every_kind, WORLD, timeout=180)
    for rank, reports in enumerate(per_rank):
        mirrored, zero1, zero2, zero3, per_module = (reports[k] for k in ("mirrored", *CONFIGS))
        assert per_module == zero3, rank  # the same bytes between steps, whatever the units
        # Activations do not shard: every stage saves what one replica's 8 samples save (the input,
        # both ReLU outputs, log_softmax's output, the int64 targets, nll_loss's total weight);
        # gathered parameters are parameters, not activations.
        by_hand = 8 * (64 + 256 + 256 + 10) * 4 + 8 * 8 + 4
        for stage, report in reports.items():
            assert report["activations"] == by_hand, (rank, stage)
        # AdamW's two moments plus the step counts: about 2x the parameters' bytes.
        assert mirrored["optimizer_state"] >= 2 * mirrored["parameters"]
        assert zero1["optimizer_state"] < 0.55 * mirrored["optimizer_state"], rank
        assert zero2["gradients"] < 0.55 * zero1["gradients"], rank
        assert zero3["parameters"] < 0.55 * zero2["parameters"], rank
        ratio = zero3["model_state"] / mirrored["model_state"]
        assert ratio < 1 / WORLD + 0.05, f"rank {rank}: shard='parameters' holds {ratio:.2f} of mirrored's"


def _stages_one_and_two_memory() -> dict:
    out = {}
    owner = make_sharded("optimizer")
    try:
        out["optimizer"] = _memory_job(owner)
        with make_sharded("gradients") as strategy:
            out["gradients"] = _memory_job(strategy)
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_stages_one_and_two_hold_no_more_than_their_peers():
    """Model state per rank after an AdamW step, against what ZeRO-1 (torch's ZeroRedundancyOptimizer)
    and ZeRO-2 hold: parameters whole (the optimizer's shards are views of them, no second copy);
    gradients whole at stage 1 (the all-reduced buffer, once) and 1/N at stage 2; AdamW's moments
    1/N. Beyond that, per parameter: its step count on every rank (as FSDP2 keeps it) and the
    4-byte flag saying whether any rank produced a gradient."""
    shapes = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]  # _memory_job's MLP
    params = sum(torch.Size(s).numel() for s in shapes) * 4  # even sizes: no padding at 2 ranks
    per_parameter = len(shapes) * (4 + 4)  # a float32 step count and a presence flag
    moments = 2 * params // WORLD
    bound = {
        "optimizer": params + params + moments + per_parameter,
        "gradients": params + params // WORLD + moments + per_parameter,
    }
    for rank, reports in enumerate(run_ranks(_stages_one_and_two_memory, WORLD, timeout=120)):
        for stage, report in reports.items():
            assert report["parameters"] == params, (rank, stage)  # the shards live inside them
            assert report["model_state"] <= bound[stage], (rank, stage, report, bound[stage])


class _Crash(Callback):
    """Every rank raises at the same global step: a crash after some backups were written."""

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 10:
            raise RuntimeError("simulated crash")


def _fit_with_backup(strategy, backup_dir: str, *, init_seed: int, crash: bool = False) -> dict:
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    callbacks = [BackupAndRestore(backup_dir, save_freq=3), *([_Crash()] if crash else [])]
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
    trainer.fit(make_data(), epochs=2, global_batch_size=GLOBAL_BATCH, seed=7, verbose=0)
    return strategy.full_state_dict(model)


def _backup_job(root: str):
    def job(strategy, rank: int) -> dict:
        stage = f"{strategy.shard}-{strategy.units}"
        uninterrupted = _fit_with_backup(strategy, f"{root}/{stage}-ref", init_seed=0)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit_with_backup(strategy, f"{root}/{stage}-run", init_seed=0, crash=True)
        resumed = _fit_with_backup(strategy, f"{root}/{stage}-run", init_seed=5 + rank)
        return {"uninterrupted": uninterrupted, "resumed": resumed}

    return job


def _every_stage_backup(root: str) -> dict:
    return every_stage(CONFIGS, _backup_job(root))


@pytest.mark.processes
def test_backup_and_restore_resumes_exactly_at_every_stage(tmp_path):
    """Each rank backs up its own shards (through DCP) and restores them bit for bit."""
    per_rank = run_ranks(_every_stage_backup, WORLD, args=(str(tmp_path),), timeout=240)
    for rank, stages in enumerate(per_rank):
        for stage, result in stages.items():
            for key, value in result["uninterrupted"].items():
                assert torch.equal(result["resumed"][key], value), f"rank {rank}, shard={stage}, {key}"


def _rank_1_skips_the_step() -> None:
    """Rank 1 never steps (so never joins the parameters' all-gather) but stays alive."""
    rank = int(os.environ["RANK"])
    strategy = spread.ShardedStrategy("gradients")
    with strategy.scope():
        model = make_model(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 10), torch.randint(0, 3, (4,))
    strategy.run(lambda: nn.functional.cross_entropy(model(x), y).backward())
    if rank == 1:
        time.sleep(8)
        return
    optimizer.step()


@pytest.mark.processes
def test_a_stuck_collective_fails_naming_rank_and_operation():
    results = launch_ranks(
        _rank_1_skips_the_step, WORLD, collective_timeout=3, fail_fast_grace=30, timeout=90
    )
    error = results[0].error or ""
    assert error.startswith("CollectiveTimeout: rank 0: sharded.all_gather_parameters"), results[0].describe()


def _batchnorm_loop(strategy, init_seed: int) -> dict:
    """The BatchNorm tests' CNN and loop (8 SGD steps, uneven final batches); weights and buffers."""
    with strategy.scope():
        model = bn_cases.make_model(init_seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(bn_cases.make_data(), bn_cases.GLOBAL_BATCH, shuffle=True, seed=3)
    done = 0
    while done < bn_cases.STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(lambda x, y: loss_fn(model(x), y).backward(), args=(x, y))
            optimizer.step()
            done += 1
            if done == bn_cases.STEPS:
                break
    return strategy.full_state_dict(model)


def _batchnorm_every_stage() -> dict:
    rank = int(os.environ["RANK"])
    out = {}
    owner = make_sharded(CONFIGS[0], sync_batchnorm=True)
    try:
        out[CONFIGS[0]] = _batchnorm_loop(owner, rank * 101)
        for stage in CONFIGS[1:]:
            with make_sharded(stage, sync_batchnorm=True) as strategy:
                out[stage] = _batchnorm_loop(strategy, rank * 101)
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_batchnorm_with_sync_batchnorm_equals_one_device_at_every_stage():
    """Convolutions, BatchNorm layers (their parameters sharded, their buffers averaged)."""
    expected = _batchnorm_loop(spread.OneDeviceStrategy("cpu"), 0)
    for rank, stages in enumerate(run_ranks(_batchnorm_every_stage, WORLD, timeout=180)):
        for stage, weights in stages.items():
            diff = max_relative_difference(weights, expected)
            assert diff <= TOLERANCE, f"rank {rank}, shard={stage}: max relative difference {diff:.2e}"


def test_bad_units_are_refused_by_name():
    with pytest.raises(ValueError, match=r"units must be 'model', 'modules' or .*got 'layers'"):
        spread.ShardedStrategy(units="layers")


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class _TiedDecoder(nn.Module):
    """W2's shape in small: embeddings, deep-copied residual blocks, and an LM head tied to the
    embedding table that the model reads in its own forward (not inside the embedding's)."""

    def __init__(self, vocab: int = 29, d: int = 12, layers: int = 3) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        template = _Block(d)  # deep-copied as nn.TransformerEncoder does: the copies' parameters
        self.blocks = nn.Sequential(*[copy.deepcopy(template) for _ in range(layers)])  # skip the scope
        self.ln = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ln(self.blocks(self.tok(ids))) @ self.tok.weight.T


def _decoder_loop(strategy, init_seed: int) -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 29, (23, 6), generator=g)  # 2 global batches of 8, then one of 7
    with strategy.scope():
        torch.manual_seed(init_seed)
        model = _TiedDecoder()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    strategy.prepare_model(model)  # adopts the deep copies (Trainer does this when needed)
    dataset = strategy.distribute_dataset((ids, ids), 8, shuffle=True, seed=2)

    def step(x, y):
        logits = model(x)
        nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 29), y[:, 1:].reshape(-1)).backward()

    for _ in range(2):
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(step, args=(x, y))
            optimizer.step()
    return strategy.full_state_dict(model)


def _decoder_every_unit_choice() -> dict:
    rank = int(os.environ["RANK"])
    owner = spread.ShardedStrategy("parameters")
    try:
        out = {"model": _decoder_loop(owner, rank * 7)}
        with spread.ShardedStrategy("parameters", units=(_Block,)) as strategy:
            out["blocks"] = _decoder_loop(strategy, rank * 7)
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_a_tied_head_read_in_the_models_forward_equals_one_device():
    """The default unit (the whole model) and layer classes as units both keep the embedding table
    resident while the model's own forward reads it for the head."""
    expected = _decoder_loop(spread.OneDeviceStrategy("cpu"), 0)
    for rank, results in enumerate(run_ranks(_decoder_every_unit_choice, WORLD, timeout=120)):
        for units, weights in results.items():
            diff = max_relative_difference(weights, expected)
            assert diff <= TOLERANCE, f"rank {rank}, units={units}: max relative difference {diff:.2e}"
