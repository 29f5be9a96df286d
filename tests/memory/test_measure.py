"""ActivationMeter: the peak bytes autograd keeps saved for backward, counted by hand on small chains."""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from spread.memory import ActivationMeter

F32 = 4


def _chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _chain_bytes(batch: int) -> int:
    """What the chain and ``out.pow(2).mean()`` save: the input (for the first weight's gradient),
    ReLU's output (ReLU's and the second Linear's, one storage) and the output (for pow)."""
    return batch * (8 + 16 + 4) * F32


def test_a_linear_chain_saves_its_input_hidden_and_output_bytes():
    model = _chain()
    x = torch.randn(5, 8)
    with ActivationMeter() as meter:
        model(x).pow(2).mean().backward()
    assert meter.peak_bytes == _chain_bytes(5) == 560
    assert meter.peak_by_group == {None: 560}


def test_the_peak_is_what_is_alive_at_once_not_the_sum_over_steps():
    model = _chain()
    x = torch.randn(5, 8)
    with ActivationMeter() as steps:
        for _ in range(3):  # each backward frees its step's tensors: micro-batches do not add up
            model(x).pow(2).mean().backward()
    assert steps.peak_bytes == 560
    with ActivationMeter() as together:
        losses = [model(x).pow(2).mean() for _ in range(3)]  # three graphs alive before any backward
        sum(losses).backward()
    assert together.peak_bytes == 5 * 8 * F32 + 3 * 5 * (16 + 4) * F32  # they share x's storage


def test_parameters_their_views_swapped_storage_and_excluded_buffers_are_not_counted():
    weight = nn.Parameter(torch.randn(4, 8))
    weight.data = torch.randn(4, 8)  # a storage made after the meter started, as ZeRO-3's gathers
    x = torch.randn(3, 8, requires_grad=True)
    scale = torch.randn(3, 4, requires_grad=True)
    with ActivationMeter(exclude=[scale]) as meter:
        out = x @ weight.t()  # saves x and weight.t() (a view of the parameter)
        (out * scale).sum().backward()  # saves scale (excluded, as a buffer) and out
    assert meter.peak_bytes == (3 * 8 + 3 * 4) * F32


def test_views_count_the_bytes_they_reach_once():
    batch = torch.randn(10, 8)
    with ActivationMeter() as meter:
        rows = batch[:5].requires_grad_()  # a replica's slice: its rows, not the whole batch
        rows.sin().sum().backward()  # sin saves its input
    assert meter.peak_bytes == 5 * 8 * F32
    h = torch.randn(6, 8, requires_grad=True)
    with ActivationMeter() as meter:
        left, right = h.chunk(2, dim=1)  # two views of one storage: their union once
        (left.sin() + right.sin() + left.cos()).sum().backward()
    assert meter.peak_bytes == 6 * 8 * F32  # sin and cos save their inputs, all within h
    v = torch.randn(1, 8, requires_grad=True)
    with ActivationMeter() as meter:
        v.expand(100, 8).sin().sum().backward()  # an expanded tensor reaches one row of memory
    assert meter.peak_bytes == 8 * F32


def test_tensors_saved_inside_a_checkpointed_block_are_left_to_the_checkpoint():
    model = _chain()
    x = torch.randn(5, 8)
    with ActivationMeter() as meter:
        checkpoint(model, x, use_reentrant=False).pow(2).mean().backward()
    assert meter.peak_bytes == 5 * (8 + 4) * F32  # the block's input, kept by it, and what pow saves


def test_groups_are_measured_apart_on_threads():
    local = threading.local()
    model = _chain()
    meter = ActivationMeter(group=lambda: getattr(local, "replica", None))
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    barrier = threading.Barrier(2)

    def replica(i: int, batch: int) -> None:
        local.replica = i
        with torch.autograd.graph.saved_tensors_hooks(*hooks):  # what replica threads carry
            loss = model(torch.randn(batch, 8)).pow(2).mean()
            barrier.wait()  # both graphs alive at once
            loss.backward()

    with meter:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        threads = [threading.Thread(target=replica, args=(i, b)) for i, b in enumerate((5, 3))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert meter.peak_by_group == {0: _chain_bytes(5), 1: _chain_bytes(3)}
    assert meter.peak_bytes == _chain_bytes(5)
