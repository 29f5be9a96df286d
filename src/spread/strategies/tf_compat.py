"""tf.distribute's names, for scripts translated from TensorFlow (see docs/coming-from-tf-distribute.md).

Every name here means what it means in TensorFlow, on spread's contract: ``strategy.run`` averages
the replicas' gradients weighted by their sample counts, where TensorFlow sums them. That is why a TF
loss scaled by the *global* batch (``tf.nn.compute_average_loss``) trains at ``1/N`` of the gradient
under spread, and why :func:`compute_average_loss` exists: it returns TensorFlow's value with the
gradient spread's contract wants.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, RandomSampler

from spread.cluster import ClusterSpec
from spread.values import PerReplica

if TYPE_CHECKING:  # pragma: no cover
    from spread.data import DistributedDataset, ReplicaLayout
    from spread.strategies.base import Strategy


class ReduceOp(enum.StrEnum):
    """``tf.distribute.ReduceOp``: ``strategy.reduce(ReduceOp.SUM, value, axis=None)``."""

    SUM = "sum"
    MEAN = "mean"


def compute_average_loss(
    per_example_loss: torch.Tensor,
    sample_weight: torch.Tensor | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """``tf.nn.compute_average_loss`` under spread: the value TensorFlow returns (this replica's
    summed, weighted losses over ``global_batch_size``, so ``strategy.reduce("sum", ...)`` of it is
    the global batch's mean loss), carrying the gradient of this replica's mean, which is what
    ``strategy.run`` expects: the trained weights equal one device's on the global batch.

    Without ``global_batch_size`` the value is this replica's mean (TensorFlow would divide by the
    global batch of the step, known only to the strategy)."""
    if per_example_loss.ndim == 0:
        raise ValueError("compute_average_loss takes per-example losses (reduction='none'), got a scalar")
    losses = per_example_loss.reshape(per_example_loss.shape[0], -1).mean(dim=1)
    if sample_weight is not None:
        losses = losses * torch.as_tensor(sample_weight, dtype=losses.dtype, device=losses.device)
    mean = losses.sum() / max(losses.shape[0], 1)
    if global_batch_size is None:
        return mean
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size!r}")
    tensorflow_value = losses.sum() / global_batch_size
    return mean + (tensorflow_value - mean).detach()


@dataclass(frozen=True)
class InputContext:
    """``tf.distribute.InputContext``: what ``distribute_datasets_from_function``'s ``dataset_fn`` gets
    to build this process's share of the data."""

    num_input_pipelines: int
    input_pipeline_id: int
    num_replicas_in_sync: int

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"the global batch size {global_batch_size} is not divisible by the "
                f"{self.num_replicas_in_sync} replicas in sync"
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclass(frozen=True)
class ClusterResolver:
    """What TF scripts read from ``strategy.cluster_resolver``: this task's type and index, the cluster."""

    task_type: str
    task_id: int
    _cluster: dict[str, list[str]] = field(repr=False)

    @classmethod
    def of(cls, spec: ClusterSpec) -> ClusterResolver:
        """Under TF_CONFIG, its own task; under a rank-based launcher (``spread run``, torchrun, SLURM)
        a cluster of workers only, ``worker r`` for rank ``r``: TensorFlow's multi-worker tutorial
        then picks rank 0 as its chief (``task_type == "worker" and task_id == 0``)."""
        cluster = {role: list(tasks) for role, tasks in spec.cluster.items()}
        if spec.source == "tf_config":
            return cls(spec.role, spec.task_index, cluster)
        return cls("worker", spec.rank, cluster)

    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster as TF_CONFIG's ``cluster``: role to task addresses."""
        return {role: list(tasks) for role, tasks in self._cluster.items()}


class _ReplicaBatches:
    """A process's own batches for its local replicas: one batch per step with one replica, else a
    :class:`PerReplica` of as many consecutive batches (TensorFlow's order for one input pipeline)."""

    def __init__(self, batches: Iterable[Any], num_local_replicas: int) -> None:
        self._batches, self._replicas = batches, num_local_replicas

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self._batches)
        while True:
            group = [batch for _, batch in zip(range(self._replicas), batches, strict=False)]
            if len(group) < self._replicas:  # a step needs every replica's batch
                return
            yield group[0] if self._replicas == 1 else PerReplica(group)


def distribute_global_batches(strategy: Strategy, dataset: DataLoader) -> DistributedDataset:
    """``experimental_distribute_dataset``: ``dataset`` is batched by the *global* batch size (a
    ``DataLoader``; its ``shuffle`` and ``drop_last`` are kept); each batch is split over the replicas."""
    if not isinstance(dataset, DataLoader) or dataset.batch_size is None:
        raise TypeError(
            "experimental_distribute_dataset takes a DataLoader batched by the global batch size "
            "(TensorFlow's dataset.batch(GLOBAL_BATCH_SIZE)); for samples call "
            f"strategy.distribute_dataset(data, global_batch_size), got {type(dataset).__name__}"
        )
    return strategy.distribute_dataset(
        dataset.dataset,
        dataset.batch_size,
        shuffle=isinstance(dataset.sampler, RandomSampler),
        drop_remainder=dataset.drop_last,
    )


def datasets_from_function(
    strategy: Strategy, layout: ReplicaLayout, dataset_fn: Callable[[InputContext], Iterable[Any]]
) -> Iterable[Any]:
    """``distribute_datasets_from_function``: ``dataset_fn(input_context)`` builds this process's own
    batches of the *per-replica* batch size; each step takes one per local replica."""
    context = InputContext(layout.num_processes, layout.process_index, strategy.num_replicas_in_sync)
    return _ReplicaBatches(dataset_fn(context), layout.num_local_replicas)
