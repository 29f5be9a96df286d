"""All-reduce between replicas of one process: each replica holds a flat buffer, the sum lands in the
first replica's buffer. These are :class:`~spread.strategies.MirroredStrategy`'s ``cross_device_ops``.

Why here and not in :mod:`spread.comm.algorithms`: there is no process group; the replicas' buffers
are plain tensors of one process, and the work can run on the replicas' own threads.

* :func:`reduce_to_one` (TensorFlow's ``ReductionToOneDevice``): the first replica adds every other
  buffer into its own, in replica order, on one thread. Simple, exact order, one core busy.
* :func:`hierarchical_copy` (TensorFlow's ``HierarchicalCopyAllReduce``): replicas form
  ``num_groups`` groups of consecutive replicas; (1) each group's first replica sums its group, the
  groups in parallel; (2) the group sums are cut into ``num_groups`` slices and group leader ``k``
  sums slice ``k`` across the group sums, in parallel; the total ends in the first replica's buffer.
  With two replicas this is a reduce-scatter run on both cores at once.

fp16/bf16 buffers are summed in fp32 and rounded once per level. ``reduce_to_one`` writes only
``buffers[0]``; ``hierarchical_copy`` also leaves partial sums in the other group leaders' buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from spread.comm.algorithms.base import LOW_PRECISION, segment_bounds

Parallel = Callable[[Sequence[Callable[[], None]]], None]
"""Runs the given callables concurrently (for example on the replicas' threads) and waits."""

IN_PROCESS_ALGORITHMS = ("reduce_to_one", "hierarchical_copy")


def _sum_into(out: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """``out += sum(parts)`` in order, in fp32 for half-precision buffers."""
    if not parts or out.numel() == 0:
        return
    if out.dtype in LOW_PRECISION:
        acc = out.float()
        for part in parts:
            acc.add_(part)
        out.copy_(acc)
    else:
        for part in parts:
            out.add_(part)


def _check(buffers: Sequence[torch.Tensor]) -> None:
    if not buffers:
        raise ValueError("an in-process all-reduce needs at least one replica buffer")
    first = buffers[0]
    for i, b in enumerate(buffers):
        if b.dim() != 1 or b.numel() != first.numel() or b.dtype != first.dtype:
            raise ValueError(
                f"replica {i}'s buffer is {tuple(b.shape)} {b.dtype}; every replica needs a 1-D "
                f"buffer like replica 0's {tuple(first.shape)} {first.dtype}"
            )


def reduce_to_one(buffers: Sequence[torch.Tensor]) -> None:
    """Sum every replica's buffer into ``buffers[0]`` on the calling thread, in replica order."""
    _check(buffers)
    first = buffers[0]
    _sum_into(first, [b.to(first.device) for b in buffers[1:]])


def _serial(tasks: Sequence[Callable[[], None]]) -> None:
    for task in tasks:
        task()


def hierarchical_copy(
    buffers: Sequence[torch.Tensor], *, num_groups: int = 2, parallel: Parallel | None = None
) -> None:
    """Sum every replica's buffer into ``buffers[0]`` in two parallel levels (see the module doc)."""
    _check(buffers)
    run = parallel or _serial
    n = len(buffers)
    groups = max(1, min(num_groups, n))
    members = segment_bounds(n, groups)  # replica ranges of the groups
    leaders = [members[k] for k in range(groups)]

    def sum_group(k: int) -> Callable[[], None]:
        lo, hi = members[k], members[k + 1]
        return lambda: _sum_into(buffers[lo], [buffers[i].to(buffers[lo].device) for i in range(lo + 1, hi)])

    run([sum_group(k) for k in range(groups)])
    cuts = segment_bounds(buffers[0].numel(), groups)
    first = buffers[0]

    def sum_slice(k: int) -> Callable[[], None]:
        a, b = cuts[k], cuts[k + 1]
        return lambda: _sum_into(first[a:b], [buffers[j][a:b].to(first.device) for j in leaders[1:]])

    run([sum_slice(k) for k in range(groups)])
