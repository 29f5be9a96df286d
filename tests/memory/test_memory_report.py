"""Memory reports count bytes by storage: each storage once, released ones not at all; activation bytes
only from a step measured under ``Strategy.measure_activations``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.errors import SpreadError
from spread.memory.report import MemoryReport, optimizer_state_tensors, storage_bytes


def test_storage_bytes_counts_each_storage_once_and_skips_none_and_released():
    flat = torch.zeros(10)
    released = torch.zeros(4)
    released.untyped_storage().resize_(0)
    assert storage_bytes([flat[:5], flat[5:], None, released]) == 40
    seen: set[int] = set()
    assert storage_bytes([flat], seen) == 40
    assert storage_bytes([flat[2:]], seen) == 0  # counted already, under another category


def test_one_device_report_holds_parameters_gradients_and_momentum():
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = nn.Linear(8, 4)  # 36 float32 values
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert strategy.memory_report(optimizer) == MemoryReport(144, 0, 0)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    report = strategy.memory_report(optimizer)
    assert (report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes) == (144, 144, 144)
    assert report.model_state_bytes == 432
    assert len(optimizer_state_tensors(optimizer)) == 2  # a momentum buffer per parameter
    assert optimizer_state_tensors(None) == []


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


# What the chain and ``out.pow(2).mean()`` save per sample: the input, ReLU's output, the output.
CHAIN_BYTES_PER_SAMPLE = (8 + 16 + 4) * 4


def test_activation_bytes_are_reported_only_after_a_measured_step():
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = _chain()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    strategy.run(lambda: model(x).pow(2).mean().backward())
    assert strategy.memory_report(optimizer).activation_bytes is None  # not asked: nothing measured
    with strategy.measure_activations() as meter:
        strategy.run(lambda: model(x).pow(2).mean().backward())
    optimizer.step()
    report = strategy.memory_report(optimizer)
    assert report.activation_bytes == meter.peak_bytes == 5 * CHAIN_BYTES_PER_SAMPLE
    # parameters and gradients (plain SGD keeps no state); activations are not model state
    assert report.model_state_bytes == 2 * (8 * 16 + 16 + 16 * 4 + 4) * 4


def test_batchnorm_running_statistics_are_model_state_not_activations():
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
    x = torch.randn(5, 8)
    with strategy.measure_activations() as meter:
        strategy.run(lambda: model(x).pow(2).mean().backward())
    # x; the Linear output (BatchNorm's input); the batch mean and inverse std; the output (for pow)
    assert meter.peak_bytes == (5 * 8 + 5 * 16 + 16 + 16 + 5 * 16) * 4


def test_mirrored_measures_each_replica_on_its_own_thread():
    strategy = spread.MirroredStrategy(num_replicas=2)
    try:
        with strategy.scope():
            model = _chain()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(9, 8))
        batch = next(iter(strategy.distribute_dataset(data, global_batch_size=9)))
        with strategy.measure_activations() as meter:
            strategy.run(lambda b: model(b[0]).pow(2).mean().backward(), args=(batch,))
        # 9 samples: 5 on replica 0, 4 on replica 1 (each its rows of the batch's storage)
        assert meter.peak_by_group == {0: 5 * CHAIN_BYTES_PER_SAMPLE, 1: 4 * CHAIN_BYTES_PER_SAMPLE}
        assert strategy.memory_report(optimizer).activation_bytes == 5 * CHAIN_BYTES_PER_SAMPLE
    finally:
        strategy.close()


def test_measure_activations_is_refused_inside_run_and_when_nested():
    strategy = spread.OneDeviceStrategy("cpu")

    def inside() -> None:
        with strategy.measure_activations():
            pass

    with pytest.raises(SpreadError, match=r"around strategy\.run"):
        strategy.run(inside)
    outer = strategy.measure_activations()
    with outer, pytest.raises(SpreadError, match="already active"), strategy.measure_activations():
        pass
    with strategy.measure_activations():  # usable again after both refusals
        pass


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_measured_fit_reports_one_micro_batch_of_activations(accumulation_steps):
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = _chain()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 4))
    trainer = spread.Trainer(
        model, optimizer, nn.functional.mse_loss, strategy=strategy, accumulation_steps=accumulation_steps
    )
    with strategy.measure_activations():
        trainer.fit(data, epochs=1, global_batch_size=8)
    # per sample: the input, ReLU's output, the output and the target (both saved by mse_loss)
    micro_batch = 8 // accumulation_steps
    assert strategy.memory_report(optimizer).activation_bytes == micro_batch * (8 + 16 + 4 + 4) * 4
