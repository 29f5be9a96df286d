"""Memory reports count bytes by storage: each storage once, released ones not at all."""

from __future__ import annotations

import torch
from torch import nn

import spread
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
