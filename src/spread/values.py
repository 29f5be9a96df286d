"""Values that differ per replica. Kept below every layer so data, strategies and train share them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


class PerReplica:
    """One value per local replica (``values[i]`` belongs to replica ``i``), as in tf.distribute.

    Returned by ``strategy.run`` and yielded (as leaves of the batch structure) by distributed
    datasets when a process drives several replicas. Reduce it with ``strategy.reduce`` or unpack it
    with ``strategy.local_results``.
    """

    __slots__ = ("values",)

    def __init__(self, values: tuple[Any, ...] | list[Any]) -> None:
        self.values = tuple(values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        inner = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self.values))
        return f"PerReplica({{{inner}}})"


def is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def select_replica(structure: Any, index: int) -> Any:
    """Replace every PerReplica leaf in ``structure`` by its value for replica ``index``."""
    return pytree.tree_map(
        lambda x: x.values[index] if isinstance(x, PerReplica) else x, structure, is_leaf=is_per_replica
    )


def on_device(structure: Any, device: torch.device) -> Any:
    """``structure`` with its tensors on ``device`` (copied where they are elsewhere), as DDP does with
    a module's inputs: a step given CPU tensors runs unchanged on a GPU replica."""
    return pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x, structure
    )


def stack_replicas(per_replica_structures: list[Any]) -> Any:
    """Turn a list (one structure per replica) into one structure whose leaves are PerReplica."""
    if len(per_replica_structures) == 1:
        return per_replica_structures[0]
    flat = [pytree.tree_flatten(s) for s in per_replica_structures]
    leaves_per_replica = [leaves for leaves, _ in flat]
    spec = flat[0][1]
    merged = [PerReplica(vals) for vals in zip(*leaves_per_replica, strict=True)]
    return pytree.tree_unflatten(merged, spec)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    return pytree.tree_map(fn, structure)
