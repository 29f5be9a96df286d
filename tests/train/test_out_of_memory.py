"""A training step that runs out of memory names the rank, what the strategy holds, and what would
hold less; other errors pass through as they are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.errors import CollectiveError, TrainingOutOfMemoryError
from spread.train.out_of_memory import is_out_of_memory

ALLOCATOR = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 67108864 bytes. Error code 12 (Cannot allocate memory)"
)


class FailsAtCall(nn.Module):
    def __init__(self, error: BaseException, at_call: int) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)
        self.error, self.at_call, self.calls = error, at_call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at_call:
            raise self.error
        return self.body(x)


def _fit(model: nn.Module, optimizer_cls=torch.optim.SGD, strategy=None):
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))
    strategy = strategy or spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        optimizer = optimizer_cls(model.parameters(), lr=0.1)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    return trainer.fit(data, epochs=1, global_batch_size=8, verbose=0)


@pytest.mark.parametrize(
    "strategy",
    [
        lambda: spread.OneDeviceStrategy("cpu"),
        lambda: spread.MirroredStrategy(num_replicas=2, intra_op_threads=1),
    ],
    ids=["one_device", "mirrored"],
)
def test_the_allocators_failure_in_forward_says_what_is_held_and_what_holds_less(strategy):
    original = RuntimeError(ALLOCATOR)
    with pytest.raises(TrainingOutOfMemoryError) as info:
        _fit(FailsAtCall(original, at_call=3), strategy=strategy())
    message = str(info.value)
    assert message.startswith("rank 0: out of memory in a training step ([enforce fail")
    assert "MB of parameters" in message and "MB of optimizer state" in message
    assert "ShardedStrategy('parameters')" in message and "accumulation_steps" in message
    assert isinstance(info.value, MemoryError)
    cause = info.value.__cause__
    assert cause is original or (cause is not None and original in (cause.__cause__, cause.__context__))


class _OptimizerOutOfMemory(torch.optim.SGD):
    def step(self, closure=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_the_optimizers_first_step_running_out_is_explained_too():
    with pytest.raises(TrainingOutOfMemoryError, match=r"rank 0: out of memory .*CUDA out of memory"):
        _fit(nn.Linear(4, 2), optimizer_cls=_OptimizerOutOfMemory)


def test_other_errors_pass_through_unchanged():
    original = ValueError("a shape the model did not expect")
    with pytest.raises(ValueError, match="a shape the model did not expect") as info:
        _fit(FailsAtCall(original, at_call=2))
    assert not isinstance(info.value, TrainingOutOfMemoryError)


def test_a_collective_that_could_not_allocate_counts_as_out_of_memory():
    wrapped = CollectiveError(1, "sharded.grad_reduce_scatter", 33, ALLOCATOR)
    assert is_out_of_memory(wrapped) and is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("Expected all tensors to be on the same device"))
