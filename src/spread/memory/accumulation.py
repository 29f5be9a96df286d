"""Gradient accumulation: one optimizer step computed in several smaller forward/backward passes.

Why: the activations a forward pass keeps grow with the batch it sees. Splitting each replica's slice
of the global batch into ``k`` micro-batches divides that memory by about ``k`` while the update stays
the one of the whole global batch.

Weighting (why the result equals the whole batch, uneven sizes included): every strategy weights a
replica's gradient by the replica's share ``n_r / N`` of the global batch, assuming a per-replica
*mean* loss. Inside a replica, micro-batch ``m`` with ``c_m`` samples multiplies its mean loss by
``c_m / n_r`` (:attr:`MicroBatch.weight`), so every sample ends up weighing ``1 / N``, exactly as one
device on the global batch.

Communication: the backward passes of all but the last micro-batch run inside the strategy's
``no_sync()`` (strategies that exchange gradients between processes have one), so gradients are
exchanged once per step, after the last micro-batch, and that exchange carries everything
accumulated. Strategies without ``no_sync`` (one device, replicas on threads) never communicate.

Not equal to the whole batch: layers whose forward depends on the batch (BatchNorm statistics) and
random draws (dropout masks are drawn per micro-batch, so they differ from one large draw).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from spread.data import split_sizes


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch of a replica's batch.

    Attributes:
        data: the micro-batch, the same structure as the batch it was cut from.
        index: its position, from 0 to ``count - 1``.
        count: how many micro-batches this replica's batch was split into.
        num_samples: samples in this micro-batch.
        weight: multiply the micro-batch's *mean* loss by this before ``backward()``
            (``num_samples`` over the replica's samples; 0.0 for an empty replica batch).
        strategy: the strategy whose ``no_sync()`` :meth:`backward` uses (None: always exchange).
    """

    data: Any
    index: int
    count: int
    num_samples: int
    weight: float
    strategy: SupportsNoSync | None = field(default=None, repr=False, compare=False)

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def backward(self, mean_loss: torch.Tensor) -> None:
        """``(mean_loss * weight).backward()``, inside the strategy's ``no_sync()`` unless this is the
        last micro-batch: only the last backward pass exchanges gradients (all that accumulated).

        The no-sync block lasts exactly this call, so an exception anywhere leaves the strategy
        synchronising as before.
        """
        scaled = mean_loss * self.weight
        if self.is_last:
            scaled.backward()
            return
        with no_sync_context(self.strategy):
            scaled.backward()


def check_accumulation_steps(steps: Any) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"accumulation_steps must be a positive integer, got {steps!r}")
    return steps


def split_batch(batch: Any, num_micro_batches: int) -> list[tuple[Any, int]]:
    """Cut ``batch`` along dimension 0 into at most ``num_micro_batches`` pieces of sizes differing by
    at most one; returns ``(piece, samples)`` pairs. Every leaf of ``batch`` (a tensor, or a tuple,
    list or dict of tensors) must hold the same number of samples. A batch with fewer samples than
    ``num_micro_batches`` gives one piece per sample; an empty batch gives itself, once."""
    check_accumulation_steps(num_micro_batches)
    leaves, spec = pytree.tree_flatten(batch)
    if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
        raise TypeError(
            "gradient accumulation splits batches along dimension 0 and needs every leaf of the batch to "
            "be a tensor with a batch dimension; got leaves of types "
            f"{sorted({type(t).__name__ for t in leaves})}"
        )
    sizes = {int(t.shape[0]) for t in leaves}
    if len(sizes) != 1:
        raise ValueError(
            f"the batch's tensors disagree on the number of samples (dimension 0): {sorted(sizes)}"
        )
    (n,) = sizes
    if num_micro_batches == 1 or n == 0:
        return [(batch, n)]
    parts = [s for s in split_sizes(n, min(num_micro_batches, n)) if s > 0]
    pieces = [t.split(parts) for t in leaves]
    return [(pytree.tree_unflatten([p[i] for p in pieces], spec), size) for i, size in enumerate(parts)]


class SupportsNoSync(Protocol):
    """A strategy (every ``spread`` strategy is one): ``no_sync()`` skips the gradient exchange of the
    backward passes inside it, a no-op where there is none."""

    def no_sync(self) -> AbstractContextManager[None]: ...


def no_sync_context(strategy: SupportsNoSync | None) -> AbstractContextManager[None]:
    """``strategy.no_sync()``, or a no-op without a strategy."""
    return strategy.no_sync() if strategy is not None else nullcontext()


def micro_batches(
    batch: Any, num_micro_batches: int, *, strategy: SupportsNoSync | None = None
) -> Iterator[MicroBatch]:
    """Yield a replica's ``batch`` as micro-batches for gradient accumulation (custom loops).

    Call it inside ``strategy.run``; run forward and ``micro.backward(mean_loss)`` once per
    micro-batch; step the optimizer after ``run`` as usual::

        def train_step(batch):
            for micro in spread.memory.micro_batches(batch, 4, strategy=strategy):
                x, y = micro.data
                micro.backward(loss_fn(model(x), y))

    ``micro.backward`` weights the loss and, with ``strategy`` given, runs every backward pass but the
    last inside ``strategy.no_sync()``, so gradients are exchanged once. Calling
    ``(loss * micro.weight).backward()`` yourself gives the same result, with an exchange per pass
    unless you wrap the non-final ones in :func:`no_sync_context`.
    """
    parts = split_batch(batch, num_micro_batches)
    total = sum(size for _, size in parts)
    count = len(parts)
    for index, (data, size) in enumerate(parts):
        yield MicroBatch(data, index, count, size, size / total if total else 0.0, strategy)
