"""MultiWorkerMirroredStrategy: one process per replica, in lock-step, over torch.distributed.

The cluster comes from the environment (``spread run``, torchrun, ``TF_CONFIG`` or SLURM). The
chief's initial weights are broadcast when the scope exits; afterwards every backward pass ends with
a bucketed all-reduce of the gradients, weighted by each replica's share of the global batch, so the
optimizer step that follows is the same on every replica as on one device with the whole batch.

Buffers: after every optimizer step over managed parameters (a global optimizer step post-hook, so
custom loops get it too), float buffers become the replicas' average weighted by their shares of the
global batch, integer buffers rounded (:class:`~spread.comm.buffers.BufferAverager`): one flat
all-reduce per step. With ``sync_batchnorm=True`` BatchNorm layers exchange their statistics
over a process group of their own (so the exchange, which runs inside backward, never interleaves
with the gradient buckets' all-reduces on the main group) and normalise with the global batch's; their
buffers are then equal on every rank already and are left out of the averaging.

Compiled models (``torch.compile``, ``module.compile()``): ``run`` cuts graphs compiled inside it at
the reducer's bucket boundaries (:mod:`spread.comm.compiled`), so the all-reduce overlaps backward as
it does for an eager model; not where nothing could overlap (one bucket, or ``shm``, whose
asynchronous calls run at ``wait()``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from spread.cluster import ClusterSpec, resolve_cluster
from spread.cluster.rendezvous import Rendezvous, regroup_timeout
from spread.cluster.threads import share_cores
from spread.comm import DEFAULT_BUCKET_CAP_MB, Collectives, GradientReducer
from spread.comm.algorithms import ALGORITHM_NAMES, AllReduceAlgorithm, make_algorithm
from spread.comm.bucketing import COMPRESSIONS
from spread.comm.buffers import BufferAverager
from spread.comm.compiled import bucket_graph_breaks
from spread.comm.flight import start_watch, stop_watch
from spread.comm.ops import destroy_group
from spread.comm.peers import gone_ranks, on_this_host, record_job_processes
from spread.comm.structure import broadcast_structure
from spread.data import DataChannel, ReplicaLayout, StepInfo
from spread.errors import SpreadError
from spread.memory.report import MemoryReport
from spread.strategies.base import (
    Strategy,
    model_state_report,
    one_replica_tensor,
    replica_weights,
    run_as_replica,
)
from spread.strategies.batchnorm import BatchNormReplicas
from spread.strategies.process_group import join_process_group, local_device

COMMUNICATIONS = ALGORITHM_NAMES  # "auto" and every name of spread.comm.algorithms.ALGORITHMS


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism with one replica per process.

    Args:
        communication: the all-reduce algorithm: ``"native"`` (the backend's own: gloo on CPU,
            NCCL on GPU), ``"ring"``, ``"reduce_to_one"``, ``"shm"`` (ranks on one machine),
            ``"hierarchical"`` (nodes of ``cluster.local_world_size`` ranks), or ``"auto"`` (see
            :mod:`spread.comm.algorithms` for the rule).
        compression: ``None``, ``"bf16"`` or ``"fp16"``: exchange gradients as half-precision
            copies (half the bytes; accumulation in fp32 except with ``"native"`` on gloo).
        cluster: the cluster spec; default: resolved from the environment.
        bucket_cap_mb: size of a gradient bucket (one all-reduce each).
        init_timeout: seconds for all ranks to join (default ``SPREAD_INIT_TIMEOUT`` or 120).
        collective_timeout: seconds before a stuck collective fails naming the rank and operation
            (default ``SPREAD_COLLECTIVE_TIMEOUT`` or 300).
        sync_batchnorm: BatchNorm statistics over the global batch (see :class:`Strategy`).
    """

    def __init__(
        self,
        communication: str = "auto",
        *,
        cluster: ClusterSpec | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        compression: str | None = None,
        init_timeout: float | None = None,
        collective_timeout: float | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(sync_batchnorm=sync_batchnorm)
        if communication not in COMMUNICATIONS:
            raise ValueError(f"communication must be one of {COMMUNICATIONS}, got {communication!r}")
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(
                f"compression must be None or one of {sorted(COMPRESSIONS)}, got {compression!r}"
            )
        self.compression = compression
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.communication = communication
        self.bucket_cap_mb = bucket_cap_mb
        self.cluster = cluster if cluster is not None else resolve_cluster()
        share_cores(self.cluster)  # several processes on this host, no launcher: not every core each
        if self.cluster.rank < 0:
            raise SpreadError(
                f"a {self.cluster.role} task is not part of synchronous training; "
                f"MultiWorkerMirroredStrategy runs on chief and worker tasks only"
            )
        self._device = local_device(self.cluster)
        rendezvous: Rendezvous | None = join_process_group(
            self.cluster, self._device, init_timeout=init_timeout, collective_timeout=collective_timeout
        )
        if rendezvous is None and dist.get_world_size() != self.cluster.world_size:
            raise SpreadError(
                f"the existing process group has {dist.get_world_size()} ranks but the cluster spec "
                f"says {self.cluster.world_size}"
            )
        self._rendezvous = rendezvous
        self._reducer: GradientReducer | None = None
        self._join(rendezvous)
        self._batchnorm = BatchNormReplicas(self, self._make_statistics_sum(), shared_module=False)
        self._buffers: BufferAverager | None = None
        self._buffers_stale = False  # new buffers were adopted since self._buffers was built
        self._buffer_weight = 1.0 / self.collectives.world_size  # this rank's share of the last step
        # Optimizer steps applied to the managed parameters, and of those, steps whose buffers were
        # averaged: after a lost peer the survivors take the state of whoever got furthest.
        self.steps_applied = 0
        self.steps_with_buffers = 0
        self._step_hook = register_optimizer_step_post_hook(self._after_optimizer_step)

    def _join(self, rendezvous: Rendezvous | None) -> None:
        """What is bound to the process group: collectives, the flight watch, the algorithm."""
        self._resources.owner = f"MultiWorkerMirroredStrategy rank {self.cluster.rank}"
        if rendezvous is not None:  # ours to destroy (released last); a group the script made is not
            self._resources.push(rendezvous.close)
        try:
            self.collectives = Collectives(device=self._device)
            record_job_processes(self.collectives)  # a lost peer is then named by rank
            if rendezvous is not None and self.cluster.world_size > 1:  # a hang names who it waits for
                start_watch(rendezvous.store, self.cluster.rank, self.cluster.world_size)
                self._resources.push(stop_watch)
            self.algorithm: AllReduceAlgorithm = make_algorithm(
                self.communication, self.collectives, local_world_size=self.cluster.local_world_size
            )
            self._resources.push(self.algorithm.close)  # its threads and subgroups go before the group
        except BaseException:
            self._resources.release()
            raise

    # -- recovery without restart ------------------------------------------------------------------
    def check_recoverable(self) -> None:
        if self._rendezvous is None:
            raise SpreadError(
                "recovery without restart (spread run --recover) needs the process group made by "
                "MultiWorkerMirroredStrategy itself, not one the script initialised"
            )
        if self.sync_batchnorm:
            raise SpreadError(
                "recovery without restart (spread run --recover) does not support sync_batchnorm=True yet"
            )

    def regroup(self) -> None:
        """Continue with the ranks still alive after a peer was lost: tear down what was bound to the
        broken group, agree on the survivors through the store, form the next group (new ranks in the
        old ranks' order) and rebuild the gradient exchange over it. Model and optimizer state are
        left as they are: the caller makes them consistent (:meth:`broadcast_training_state`)."""
        self.check_recoverable()
        assert self._rendezvous is not None
        old = self._rendezvous
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        self.collectives.close()
        self._resources.release()  # the algorithm, the flight watch, then the broken group
        self._rendezvous = old.regroup(lambda: [rank for rank, _ in gone_ranks(wait=0.0)], regroup_timeout())
        members = self._rendezvous.members
        left_here = sum(1 for r in range(old.world_size) if r not in members and on_this_host(r))
        self.cluster = replace(
            self.cluster,
            rank=self._rendezvous.rank,
            world_size=self._rendezvous.world_size,
            local_world_size=max(1, self.cluster.local_world_size - left_here),
        )
        self._join(self._rendezvous)
        self._buffer_weight = 1.0 / self.collectives.world_size
        if self.managed_parameters:
            self._reducer = self._make_reducer()
        self._buffers_stale = True
        self._on_new_modules([])

    @property
    def recovery_progress(self) -> tuple[int, int]:
        return (self.steps_applied, self.steps_with_buffers)

    def broadcast_training_state(self, src: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Make every rank's model (parameters and buffers) and ``optimizer`` state those of rank
        ``src`` (after a regroup: the survivor that applied the most optimizer steps)."""
        tensors = [*self._managed.values(), *self._managed_buffers.values()]
        with torch.no_grad():
            self.collectives.broadcast_tensors(tensors, src=src, name="recover_weights")
        if optimizer is not None:
            state = self.broadcast_object(optimizer.state_dict() if self.rank == src else None, src)
            if self.rank != src:
                optimizer.load_state_dict(state)
        counts = torch.tensor([self.steps_applied, self.steps_with_buffers], dtype=torch.int64)
        self.collectives.broadcast(counts.to(self._device), src=src, name="recover_step_counts")
        self.steps_applied, self.steps_with_buffers = (int(c) for c in counts.tolist())

    def broadcast_object(self, value: Any, src: int) -> Any:
        """``value`` of rank ``src`` on every rank: JSON and tensors, never a pickle
        (:func:`spread.comm.structure.broadcast_structure`)."""
        return broadcast_structure(self.collectives, value, src=src, name="recover_state")

    def _cluster_spec(self) -> ClusterSpec:
        return self.cluster

    def _make_statistics_sum(self):
        """With ``sync_batchnorm``: a process group of its own for BatchNorm's statistics (made by
        every rank in the same order, here in the constructor) and the sum over it."""
        if not self.sync_batchnorm:
            return None
        group = dist.new_group(list(range(self.collectives.world_size)))
        statistics = Collectives(group, device=self._device)

        def release() -> None:
            statistics.close()
            destroy_group(group)

        self._resources.push(release)

        def sum_over_replicas(tensor: torch.Tensor, replica_id: int) -> torch.Tensor:
            return statistics.all_reduce(tensor, name="sync_batchnorm")

        return sum_over_replicas

    # -- topology ----------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self.collectives.world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def is_chief(self) -> bool:
        return self.collectives.rank == 0

    def _data_channel(self) -> DataChannel:
        return CollectivesDataChannel(self.collectives, self._device)

    @property
    def _layout(self) -> ReplicaLayout:
        world, rank = self.collectives.world_size, self.collectives.rank
        return ReplicaLayout(world, rank, 1, process_index=rank, num_processes=world)

    # -- variables ---------------------------------------------------------------------------------
    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        tensors = [*params, *buffers]
        self.collectives.check_same(_signature(tensors), what="the model's parameter shapes and dtypes")
        self.collectives.broadcast_tensors(tensors, src=0, name="broadcast_initial_weights")
        self._buffers_stale = True
        if self._reducer is not None:
            self._reducer.close()
        self._reducer = self._make_reducer()

    def _make_reducer(self) -> GradientReducer:
        return GradientReducer(
            self.managed_parameters,
            self.collectives,
            bucket_cap_mb=self.bucket_cap_mb,
            algorithm=self.algorithm,
            compression=self.compression,
        )

    def _on_new_modules(self, modules: list[nn.Module]) -> None:
        self._batchnorm.add(modules)
        if self._buffers_stale:
            # Buffers of synchronised BatchNorm layers are equal on every rank already.
            own = (
                {id(b) for m in self._batchnorm.modules for b in m.buffers()}
                if self.sync_batchnorm
                else set()
            )
            averaged = [b for b in self._managed_buffers.values() if id(b) not in own]
            self._buffers = BufferAverager(averaged, self.collectives) if averaged else None
            self._buffers_stale = False

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Average the buffers after a step of an optimizer over this strategy's parameters."""
        if self._closed:
            return
        if any(id(p) in self._managed for group in optimizer.param_groups for p in group["params"]):
            self.steps_applied += 1
            if self._buffers is not None:
                self._buffers.sync(self._buffer_weight)
            self.steps_with_buffers += 1

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        if self._reducer is None:
            yield
            return
        with self._reducer.no_sync():
            yield

    @property
    def exchange_seconds(self) -> float:
        """The gradient reducer's waits plus the collectives run on the training loop's thread."""
        reducer = self._reducer.wait_seconds if self._reducer is not None else 0.0
        return reducer + self.collectives.wait_seconds

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """As :meth:`Strategy.memory_report`, with the gradient buckets the reducer keeps between steps."""
        buckets = self._reducer.buckets if self._reducer is not None else []
        exchange = [t for b in buckets for t in (b.buffer, b.wire) if t is not None]
        return model_state_report(self, optimizer, exchange)

    def _set_step_info(self, info: StepInfo) -> None:
        super()._set_step_info(info)
        if self._reducer is not None:
            self._reducer.grad_scale = replica_weights(self)[0]

    # -- computation -------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        weight = replica_weights(self)[0]
        if self._reducer is not None:
            self._reducer.grad_scale = weight
        self._buffer_weight = weight
        if self._reducer is None or not self._reducer.overlaps_backward:
            return run_as_replica(self, fn, args, kwargs, self.rank, weight)
        # A model compiled here (at its first call) is cut at bucket boundaries, so the exchange of
        # its last layers' gradients overlaps the rest of its backward (spread.comm.compiled).
        with bucket_graph_breaks(int(self.bucket_cap_mb * 2**20)):
            return run_as_replica(self, fn, args, kwargs, self.rank, weight)

    def _sum_over_replicas(self, value: Any) -> tuple[torch.Tensor, int]:
        tensor = one_replica_tensor(value, self.device).detach().clone()
        self.collectives.all_reduce(tensor, name="reduce")
        return tensor, self.num_replicas_in_sync

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        tensor = one_replica_tensor(value, self.device).detach()
        moved = tensor.movedim(axis, 0).contiguous()
        parts = self.collectives.all_gather_uneven(moved, name="gather")
        return torch.cat(parts, dim=0).movedim(0, axis)

    def close(self) -> None:
        self._step_hook.remove()
        self._batchnorm.close()
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        super().close()  # the algorithm, then the process group if this strategy made it


def _signature(tensors: list[torch.Tensor]) -> list[int]:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(f"{tuple(t.shape)}:{t.dtype};".encode())
    return [len(tensors), sum(t.numel() for t in tensors), int.from_bytes(digest.digest()[:7], "big")]


class CollectivesDataChannel:
    """:class:`~spread.data.DataChannel` over the job's collectives (tensors moved to the collective's
    device and back: NCCL needs them on the GPU)."""

    def __init__(self, collectives: Collectives, device: torch.device, *, first_rank: int = 0) -> None:
        self.collectives = collectives
        self.device = device
        self.first_rank = first_rank  # the global rank of the group's first process (the reader)

    def sum_over_processes(self, counts: torch.Tensor) -> torch.Tensor:
        return self.collectives.all_reduce(counts.to(self.device), name="data_step_counts").cpu()

    def broadcast_from_first_process(self, tensors: list[torch.Tensor]) -> None:
        on_device = [t.to(self.device) for t in tensors]
        self.collectives.broadcast_tensors(on_device, src=self.first_rank, name="data_dispatch")
        for t, sent in zip(tensors, on_device, strict=True):
            if sent is not t:
                t.copy_(sent)
