"""A training step that runs out of memory says what this process holds and what would hold less.

Why: the allocator's own message ("DefaultCPUAllocator: can't allocate memory: you tried to allocate
67108864 bytes", "CUDA out of memory") names a size, not the cause; the strategy knows the model state
it keeps per process, and which choices divide it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from spread.errors import TrainingOutOfMemoryError
from spread.strategies import Strategy

_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")
MB = 2**20


def is_out_of_memory(exc: BaseException) -> bool:
    """The allocator's failure, raised as such or wrapped (a collective that could not allocate)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _MARKERS)


def out_of_memory_error(
    exc: BaseException, strategy: Strategy, optimizer: torch.optim.Optimizer
) -> TrainingOutOfMemoryError:
    """``exc`` explained: this process's model state and the ways to shrink it."""
    innermost = exc
    while innermost.__cause__ is not None and is_out_of_memory(innermost.__cause__):
        innermost = innermost.__cause__  # a replica's or a collective's wrapper around the allocator's
    first_line = (str(innermost).strip().splitlines() or [type(innermost).__name__])[0][:300]
    try:
        report = strategy.memory_report(optimizer)
        held = (
            f"{type(strategy).__name__} holds {report.parameter_bytes / MB:,.0f} MB of parameters, "
            f"{report.gradient_bytes / MB:,.0f} MB of gradients and exchange buffers and "
            f"{report.optimizer_state_bytes / MB:,.0f} MB of optimizer state in this process"
        )
        if report.activation_bytes is not None:
            held += f"; a replica's activations measured {report.activation_bytes / MB:,.0f} MB"
    except Exception:  # the report itself may not find the memory it needs
        held = f"{type(strategy).__name__} could not report what it holds"
    return TrainingOutOfMemoryError(
        f"rank {strategy.rank}: out of memory in a training step ({first_line}). {held}. Less per "
        f"process: spread.ShardedStrategy('parameters') splits parameters, gradients and optimizer "
        f"state over the processes; Trainer(accumulation_steps=k) or activation checkpointing "
        f"(spread.memory.checkpoint_blocks) shrink activations; a pipeline splits the layers"
    )


@contextmanager
def explained_out_of_memory(strategy: Strategy, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Around a part of a training step: the allocator's failure re-raised as
    :class:`TrainingOutOfMemoryError` (the original kept as its cause); other errors as they are."""
    try:
        yield
    except Exception as exc:
        if is_out_of_memory(exc):
            raise out_of_memory_error(exc, strategy, optimizer) from exc
        raise
