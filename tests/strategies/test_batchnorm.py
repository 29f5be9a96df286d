"""BatchNorm across replicas: ``sync_batchnorm=True`` equals one device (weights and running
statistics, uneven final batch included); without it, buffers stay identical on every rank and thread
replicas and processes make the same running-statistics update."""

from __future__ import annotations

import os
import time

import pytest
import torch
from _batchnorm_cases import (
    GLOBAL_BATCH,
    STEPS,
    fit_with_trainer,
    make_data,
    make_model,
    max_relative_difference,
    train_custom_loop,
)
from torch import nn

import spread
from spread.errors import SpreadError
from spread.testing import run_ranks

TOLERANCE = 1e-5
CROSS_STEPS = 3  # two full batches and the uneven one; per-replica statistics on slices of 2 and 3
# samples amplify rounding differences (gradient summation order) past 1e-5 after a few more steps


@pytest.fixture(scope="module")
def one_device() -> dict[str, torch.Tensor]:
    return train_custom_loop(spread.OneDeviceStrategy("cpu"))


@pytest.fixture(scope="module")
def mirrored_default() -> dict[str, torch.Tensor]:
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1)
    try:
        return train_custom_loop(strategy, steps=CROSS_STEPS)
    finally:
        strategy.close()


@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_thread_replicas_with_sync_batchnorm_equal_one_device(one_device, kind):
    cls = spread.MirroredStrategy if kind == "mirrored" else spread.CentralStorageStrategy
    strategy = cls(num_replicas=2, intra_op_threads=1, sync_batchnorm=True)
    try:
        state = train_custom_loop(strategy)
    finally:
        strategy.close()
    assert max_relative_difference(state, one_device) <= TOLERANCE
    for key in state:  # the step counts too
        if "num_batches_tracked" in key:
            assert torch.equal(state[key], one_device[key])


def test_thread_replicas_without_sync_batchnorm_differ_from_one_device(one_device):
    # The test above can fail: per-replica statistics give other weights than the global batch's.
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1)
    try:
        state = train_custom_loop(strategy)
    finally:
        strategy.close()
    assert max_relative_difference(state, one_device) > 1e-3


def test_thread_replicas_update_running_statistics_once_per_step_deterministically(mirrored_default):
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1)
    try:
        again = train_custom_loop(strategy, steps=CROSS_STEPS)
    finally:
        strategy.close()
    for key in again:
        assert torch.equal(again[key], mirrored_default[key]), key
    assert int(again["1.num_batches_tracked"]) == CROSS_STEPS  # once per step, not once per replica


def test_running_statistics_are_the_weighted_replica_statistics():
    """One step by hand: two replicas of 3 and 2 samples; the update uses each one's mean and
    unbiased variance weighted 3/5 and 2/5."""
    torch.manual_seed(0)
    x = torch.randn(5, 4) * 3 + 1
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1)
    try:
        with strategy.scope():
            bn = nn.BatchNorm1d(4)
        dataset = strategy.distribute_dataset((x, torch.zeros(5)), 5, shuffle=False)
        for batch, _ in dataset:
            strategy.run(lambda b: bn(b).sum().backward(), args=(batch,))
    finally:
        strategy.close()
    a, b = x[:3], x[3:]
    mean = 0.6 * a.mean(0) + 0.4 * b.mean(0)
    var = 0.6 * a.var(0) + 0.4 * b.var(0)
    torch.testing.assert_close(bn.running_mean, 0.1 * mean)
    torch.testing.assert_close(bn.running_var, 0.9 + 0.1 * var)
    assert int(bn.num_batches_tracked) == 1


def _mwms_train(sync_batchnorm: bool, steps: int) -> dict:
    rank = int(os.environ["RANK"])
    strategy = spread.MultiWorkerMirroredStrategy(sync_batchnorm=sync_batchnorm)
    try:
        # Non-chief ranks start from other weights: the chief's win at scope exit.
        return train_custom_loop(strategy, init_seed=rank * 101, steps=steps)
    finally:
        strategy.close()


@pytest.mark.processes
def test_multi_worker_mirrored_with_sync_batchnorm_equals_one_device(one_device):
    per_rank = run_ranks(_mwms_train, 2, args=(True, STEPS), timeout=180)
    for rank, state in enumerate(per_rank):
        diff = max_relative_difference(state, one_device)
        assert diff <= TOLERANCE, f"rank {rank}: max relative difference {diff:.2e}"
        assert torch.equal(state["4.num_batches_tracked"], one_device["4.num_batches_tracked"])


@pytest.mark.processes
def test_multi_worker_mirrored_buffers_match_thread_replicas_without_sync_batchnorm(mirrored_default):
    """Default: buffers averaged after each step, weighted by the replicas' shares: identical on
    both ranks, and the same update thread replicas make from the same statistics."""
    per_rank = run_ranks(_mwms_train, 2, args=(False, CROSS_STEPS), timeout=180)
    for key in per_rank[0]:
        assert torch.equal(per_rank[0][key], per_rank[1][key]), f"{key} differs between the ranks"
    assert max_relative_difference(per_rank[0], mirrored_default) <= TOLERANCE


def _mwms_fit_and_evaluate() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = make_model(int(os.environ["RANK"]))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = spread.Trainer(
            model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"]
        )
        trainer.fit(make_data(), epochs=2, global_batch_size=GLOBAL_BATCH, verbose=0)
        logs = trainer.evaluate(make_data(), global_batch_size=GLOBAL_BATCH)
        return {"logs": logs, "state": {k: v.clone() for k, v in model.state_dict().items()}}
    finally:
        strategy.close()


@pytest.mark.processes
def test_multi_worker_mirrored_evaluate_uses_the_common_statistics():
    per_rank = run_ranks(_mwms_fit_and_evaluate, 2, timeout=180)
    chief = per_rank[0]["state"]
    for key in chief:
        assert torch.equal(chief[key], per_rank[1]["state"][key]), f"{key} differs between the ranks"
    assert per_rank[0]["logs"] == per_rank[1]["logs"]
    # What one device measures with the chief's model: every rank evaluated its slice with the same
    # statistics.
    model = make_model()
    model.load_state_dict(chief)
    trainer = spread.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        strategy=spread.OneDeviceStrategy("cpu"),
        metrics=["accuracy"],
    )
    expected = trainer.evaluate(make_data(), global_batch_size=GLOBAL_BATCH)
    assert per_rank[0]["logs"] == pytest.approx(expected, rel=1e-5)


def _hybrid_pipeline() -> dict:
    strategy = spread.PipelineStrategy(stages=2, microbatches=2, replicas=2, split_points=[5])
    try:
        state = fit_with_trainer(strategy, global_batch=20)
        assert strategy.stage_module is not None
        own = {k: v.clone() for k, v in strategy.stage_module.state_dict().items()}
        return {"state": state, "stage": strategy.stage, "own": own}
    finally:
        strategy.close()


@pytest.mark.processes
def test_hybrid_pipeline_batchnorm_is_thread_replicas_accumulating_microbatches():
    """What BatchNorm in a pipeline equals: each stage normalises micro-batches; a stage's replicas
    average their buffers after each step. That is MirroredStrategy with the same replicas, each
    accumulating the same micro-batches (37 samples in batches of 20: micro-batches of 4 to 5)."""
    per_rank = run_ranks(_hybrid_pipeline, 4, timeout=240)
    threads = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1)
    try:
        expected = fit_with_trainer(threads, global_batch=20, accumulation_steps=2)
    finally:
        threads.close()
    for rank, result in enumerate(per_rank):
        diff = max_relative_difference(result["state"], expected)
        assert diff <= TOLERANCE, f"rank {rank}: max relative difference {diff:.2e}"
    for a, b in ((0, 2), (1, 3)):  # the same stage on both pipeline replicas: the same buffers
        assert per_rank[a]["stage"] == per_rank[b]["stage"]
        for key, value in per_rank[a]["own"].items():
            assert torch.equal(value, per_rank[b]["own"][key]), f"stage {per_rank[a]['stage']}: {key}"


def test_pipeline_refuses_sync_batchnorm():
    with pytest.raises(ValueError, match="PipelineStrategy does not support sync_batchnorm=True"):
        spread.PipelineStrategy(stages=2, sync_batchnorm=True)


# -- refusals and failures ----------------------------------------------------------------------------
def test_sync_batchnorm_must_be_a_bool():
    with pytest.raises(TypeError, match="sync_batchnorm must be True or False, got 'yes'"):
        spread.MirroredStrategy(num_replicas=2, sync_batchnorm="yes")


def test_sync_batchnorm_refused_for_thread_replicas_on_an_accelerator():
    with pytest.raises(ValueError, match="sync_batchnorm=True with 2 thread replicas on meta"):
        spread.MirroredStrategy(devices=["meta", "meta"], sync_batchnorm=True)


def test_one_device_accepts_sync_batchnorm(one_device):
    state = train_custom_loop(spread.OneDeviceStrategy("cpu", sync_batchnorm=True))
    assert spread.OneDeviceStrategy("cpu", sync_batchnorm=True).sync_batchnorm
    # (not bit for bit: the thread replicas' tests above changed torch's intra-op thread count)
    assert max_relative_difference(state, one_device) <= TOLERANCE


def test_a_failing_replica_releases_the_others_from_the_statistics_exchange():
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1, sync_batchnorm=True)
    try:
        with strategy.scope():
            bn = nn.BatchNorm1d(4)

        def step(batch):
            if spread.get_replica_context().replica_id_in_sync_group == 1:
                raise RuntimeError("replica 1 broke")
            return bn(batch).sum()

        dataset = strategy.distribute_dataset((torch.randn(8, 4), torch.zeros(8)), 8, shuffle=False)
        started = time.monotonic()
        with pytest.raises(SpreadError, match="replica 1 of 2 failed"):
            for batch, _ in dataset:
                strategy.run(step, args=(batch,))
        assert time.monotonic() - started < 60  # not the 300 s exchange deadline
        for batch, _ in dataset:  # the next step works again
            strategy.run(lambda b: bn(b).sum().backward(), args=(batch,))
    finally:
        strategy.close()


def test_parameter_servers_refuse_sync_batchnorm():
    with pytest.raises(ValueError, match="ParameterServerStrategy does not support sync_batchnorm=True"):
        spread.ParameterServerStrategy(sync_batchnorm=True)


def test_the_trainer_refuses_sync_batchnorm_with_accumulation():
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1, sync_batchnorm=True)
    try:
        with strategy.scope():
            model = make_model()
        with pytest.raises(ValueError, match="accumulation_steps > 1 does not combine with sync_batchnorm"):
            spread.Trainer(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                nn.CrossEntropyLoss(),
                strategy=strategy,
                accumulation_steps=2,
            )
    finally:
        strategy.close()


def test_a_replica_without_samples_takes_part_in_the_exchange():
    """35 samples in batches of 17: the last batch has one sample, so replica 1 gets none."""
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(35, 3, 6, 6, generator=g), torch.randint(0, 3, (35,), generator=g))

    def train(strategy) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(144, 3)
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
        trainer.fit(data, epochs=2, global_batch_size=17, verbose=0, shuffle=False)
        return {k: v.clone() for k, v in model.state_dict().items()}

    expected = train(spread.OneDeviceStrategy("cpu"))
    strategy = spread.MirroredStrategy(num_replicas=2, intra_op_threads=1, sync_batchnorm=True)
    try:
        assert max_relative_difference(train(strategy), expected) <= TOLERANCE
    finally:
        strategy.close()


# -- sync_batchnorm under mixed precision (bf16/fp16 inputs, float32 parameters and statistics) ------
def _mixed_precision_losses(strategy: spread.Strategy, precision: str) -> tuple[list[float], dict]:
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, precision=precision)
    if trainer.precision.scaler is not None:
        # A replica's gradients are 1/share of one device's (its loss is its slice's mean), so a
        # high loss scale overflows there a step earlier and the scaler skips different steps.
        trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    history = trainer.fit(make_data(), epochs=3, global_batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    buffers = {k: v.detach().clone() for k, v in strategy.full_state_dict(model).items() if "running" in k}
    return history.history["loss"], buffers


def _assert_like_one_device(losses: list[float], buffers: dict, precision: str, who: str) -> None:
    """The crash is the bug (torch.batch_norm refused float32 statistics beside a bf16 input); the
    numbers can only be close: one device normalises in its own mixed-precision kernel."""
    reference, _ = _mixed_precision_losses(spread.OneDeviceStrategy("cpu"), precision)
    assert losses == pytest.approx(reference, rel=1e-2), who
    for key, value in buffers.items():  # statistics stay float32 and finite
        assert value.dtype == torch.float32 and torch.isfinite(value).all(), f"{who}: {key}"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["mirrored", "central_storage"])
def test_thread_replicas_sync_batchnorm_trains_in_mixed_precision(kind, precision):
    cls = spread.MirroredStrategy if kind == "mirrored" else spread.CentralStorageStrategy
    strategy = cls(num_replicas=2, intra_op_threads=1, sync_batchnorm=True)
    try:
        losses, buffers = _mixed_precision_losses(strategy, precision)
    finally:
        strategy.close()
    _assert_like_one_device(losses, buffers, precision, f"{kind} {precision}")


def _process_mixed_precision(kind: str, precision: str) -> tuple[list[float], dict]:
    if kind == "mwms":
        strategy: spread.Strategy = spread.MultiWorkerMirroredStrategy(sync_batchnorm=True)
    else:
        strategy = spread.ShardedStrategy(shard="gradients", sync_batchnorm=True)
    try:
        return _mixed_precision_losses(strategy, precision)
    finally:
        strategy.close()


@pytest.mark.processes
@pytest.mark.parametrize(("kind", "precision"), [("mwms", "bf16"), ("mwms", "fp16"), ("sharded", "bf16")])
def test_process_replicas_sync_batchnorm_trains_in_mixed_precision(kind, precision):
    """One job each (ShardedStrategy refuses fp16)."""
    per_rank = run_ranks(_process_mixed_precision, 2, args=(kind, precision), timeout=180)
    for rank, (losses, buffers) in enumerate(per_rank):
        _assert_like_one_device(losses, buffers, precision, f"rank {rank}: {kind} {precision}")
