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

Tensor parallelism: with ``tensor_parallel=N`` the job is a ``(dp, tp)`` mesh (:attr:`mesh`); a
model parallelised with torch's ``parallelize_module`` on ``strategy.mesh["tp"]`` is one replica per
tensor-parallel group, and everything above (initial broadcast, gradient buckets, buffers, the
step's statistics, data) runs along the data axis over each ``DTensor``'s local shard
(:mod:`spread.strategies.tensor_parallel`); ``num_replicas_in_sync`` is the data axis's size.

Compiled models (``torch.compile``, ``module.compile()``): ``run`` cuts graphs compiled inside it at
the reducer's bucket boundaries (:mod:`spread.comm.compiled`), so the all-reduce overlaps backward as
it does for an eager model; not where nothing could overlap (one bucket, or ``shm``, whose
asynchronous calls run at ``wait()``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
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
from spread.comm.local_parts import local_part
from spread.comm.ops import destroy_group
from spread.comm.peers import gone_ranks, job_places, on_this_host, record_job_processes
from spread.comm.structure import broadcast_structure
from spread.data import DataChannel, ReplicaLayout, StepInfo
from spread.errors import SpreadError
from spread.memory.report import MemoryReport
from spread.strategies.base import (
    Strategy,
    TrainingProgram,
    model_state_report,
    one_replica_tensor,
    replica_weights,
    run_as_replica,
)
from spread.strategies.batchnorm import BatchNormReplicas
from spread.strategies.checkpointing import StateLayout
from spread.strategies.clipping import clip_by_norm
from spread.strategies.process_group import join_process_group, local_device
from spread.strategies.tensor_parallel import (
    DataAxis,
    TensorParallelLayout,
    check_axis_arguments,
    check_parameters,
    gradient_norm,
    make_data_axis,
)

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
        tensor_parallel: processes per tensor-parallel group (default 1: none). The strategy builds
            the 2-D mesh :attr:`mesh` of ``(world / N, N)`` processes named ``("dp", "tp")``
            (tensor-parallel ranks adjacent); parallelise the model on ``strategy.mesh["tp"]``
            with ``parallelize_module``, and this strategy runs data parallelism along ``"dp"``.
        data_mesh: instead of ``tensor_parallel``, the data axis of a mesh the script built itself
            (a 1-D ``DeviceMesh``, e.g. ``mesh["dp"]``; the process group must exist first).
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
        tensor_parallel: int = 1,
        data_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__(sync_batchnorm=sync_batchnorm)
        check_axis_arguments(tensor_parallel, data_mesh)
        if communication == "hierarchical" and (tensor_parallel != 1 or data_mesh is not None):
            raise ValueError(
                "communication='hierarchical' groups the job's ranks by node and does not combine with "
                "tensor parallelism; use 'auto', 'native', 'ring', 'reduce_to_one' or 'shm'"
            )
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
        # Joined a running job (spread run --recover on a machine that came back): the weights come
        # from a live peer when Trainer.fit starts (broadcast_training_state), not from this scope.
        self.awaiting_state = rendezvous is not None and rendezvous.joined
        self._reducer: GradientReducer | None = None
        self._tensor_parallel, self._data_mesh = tensor_parallel, data_mesh
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
            self.world = Collectives(device=self._device)
            record_job_processes(self.world)  # a lost peer is then named by rank
            if rendezvous is not None and self.cluster.world_size > 1:  # a hang names who it waits for
                start_watch(rendezvous.store, self.cluster.rank, self.cluster.world_size)
                self._resources.push(stop_watch)
            self._data_axis: DataAxis | None = make_data_axis(
                self.world, self._device, tensor_parallel=self._tensor_parallel, data_mesh=self._data_mesh
            )
            # Data parallelism runs over the data axis: the whole job without tensor parallelism.
            self.collectives = self.world if self._data_axis is None else self._data_axis.collectives
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
        if self._data_axis is not None:
            raise SpreadError(
                "recovery without restart (spread run --recover) does not support tensor parallelism yet "
                "(the mesh would have to be rebuilt for the survivors)"
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
        self._rendezvous = old.regroup(
            lambda: [rank for rank, _ in gone_ranks(wait=0.0)], regroup_timeout(), places=job_places()
        )
        members = self._rendezvous.members
        left_here = sum(1 for r in range(old.world_size) if r not in members and on_this_host(r))
        self.cluster = replace(
            self.cluster,
            rank=self._rendezvous.rank,
            world_size=self._rendezvous.world_size,
            # Never below this rank's own place (it keeps its local rank and device): the ranks lost
            # "here" may have been another launcher's, on the same host.
            local_world_size=max(self.cluster.local_rank + 1, self.cluster.local_world_size - left_here),
        )
        self._join(self._rendezvous)
        self._buffer_weight = 1.0 / self.collectives.world_size
        self._after_regroup(old.world_size, [r for r in range(old.world_size) if r not in members])
        self._buffers_stale = True
        self._on_new_modules([])

    def _buffers_now_equal(self) -> None:
        """After the buffers were made equal by a broadcast: the averaging starts from them. It averages
        each rank's change since its last starting point, so a starting point taken at a regroup, while
        the lost step's forward had moved each rank's buffers its own way, would keep each rank's
        offset for good."""
        if self._buffers is not None:
            self._buffers.reset()

    def _after_regroup(self, old_world: int, lost: list[int]) -> None:
        """What follows the new group at a regroup (``lost``: the old ranks that are gone): here the
        gradient exchange over it."""
        if self.managed_parameters:
            self._reducer = self._make_reducer()

    def joiners_waiting(self) -> bool:
        """Whether processes wait to join the job: one read of the store (the Trainer's chief reads it
        once per step under ``--recover``)."""
        return self._rendezvous is not None and self._rendezvous.joiners_waiting()

    @property
    def recovery_progress(self) -> tuple[int, int]:
        return (self.steps_applied, self.steps_with_buffers)

    def broadcast_training_state(self, src: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Make every rank's model (parameters and buffers) and ``optimizer`` state those of rank
        ``src`` (after a regroup: the survivor that applied the most optimizer steps; a process that
        joined takes everything from it)."""
        tensors = [*self._managed.values(), *self._managed_buffers.values()]
        self.collectives.check_same(_signature(tensors), what="the model's parameter shapes and dtypes")
        self.awaiting_state = False
        with torch.no_grad():
            self.collectives.broadcast_tensors(tensors, src=src, name="recover_weights")
        self._buffers_now_equal()
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
        axis = self._data_axis
        every = [list(range(self.world.world_size))] if axis is None else [list(g) for g in axis.groups]
        groups = [dist.new_group(ranks) for ranks in every]  # every rank makes every group, in order
        mine = next(g for g, ranks in zip(groups, every, strict=True) if self.world.rank in ranks)
        statistics = Collectives(mine, device=self._device)

        def release() -> None:
            statistics.close()
            for group in groups:
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
        return self.world.rank

    @property
    def is_chief(self) -> bool:
        return self.world.rank == 0

    @property
    def mesh(self) -> DeviceMesh | None:
        """The ``("dp", "tp")`` DeviceMesh built for ``tensor_parallel=N``: parallelise the model on
        ``mesh["tp"]``; None without tensor parallelism or with a ``data_mesh`` of the script's."""
        return None if self._data_axis is None else self._data_axis.mesh

    @property
    def _first_data_rank(self) -> int:
        """The global rank that speaks first for this process's data-parallel group."""
        return 0 if self._data_axis is None else self._data_axis.first_rank

    def _data_channel(self) -> DataChannel:
        return CollectivesDataChannel(self.collectives, self._device, first_rank=self._first_data_rank)

    @property
    def _layout(self) -> ReplicaLayout:
        world, rank = self.collectives.world_size, self.collectives.rank
        return ReplicaLayout(world, rank, 1, process_index=rank, num_processes=world)

    # -- variables ---------------------------------------------------------------------------------
    def _check_new_parameters(self, params: list[nn.Parameter]) -> None:
        """Tensor-parallel parameters are trained when split off the data axis only."""
        data_ranks = range(self.world.world_size) if self._data_axis is None else self._data_axis.ranks
        check_parameters(type(self).__name__, params, data_ranks)

    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        tensors = [local_part(t) for t in (*params, *buffers)]  # a DTensor's shard: see tensor_parallel
        if self.awaiting_state:  # the running ranks are training, not in a scope: no collective here
            pass
        elif self._data_axis is None:
            self.collectives.check_same(_signature(tensors), what="the model's parameter shapes and dtypes")
            self.collectives.broadcast_tensors(tensors, src=0, name="broadcast_initial_weights")
        else:
            self.collectives.check_same(_signature(tensors), what="the model's parameter shapes and dtypes")
            # A shard from the first rank of its data-parallel group (the shard this rank holds of the
            # chief's replica: parallelize_module cut it from each tensor-parallel group's first rank);
            # a plain tensor, whole on every rank of the job, from the chief.
            shards = [local_part(t) for t in (*params, *buffers) if isinstance(t, DTensor)]
            whole = [t for t in (*params, *buffers) if not isinstance(t, DTensor)]
            self.collectives.broadcast_tensors(
                shards, src=self._first_data_rank, name="broadcast_initial_weights"
            )
            self.world.broadcast_tensors(whole, src=0, name="broadcast_initial_weights")
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
            averaged = [local_part(b) for b in self._managed_buffers.values() if id(b) not in own]
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
        world = self.world.wait_seconds if self.world is not self.collectives else 0.0
        return reducer + self.collectives.wait_seconds + world

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

    # -- with tensor parallelism: what spans the whole job, not only the data axis -------------------
    def gather_from_every_rank(self, value: torch.Tensor) -> torch.Tensor:
        if self._data_axis is None:
            return super().gather_from_every_rank(value)
        tensor = one_replica_tensor(value, self.device).detach().contiguous()
        return torch.cat(self.world.all_gather_uneven(tensor, name="gather_from_every_rank"))

    def run_training_step(self, program: TrainingProgram, batch: Any) -> torch.Tensor:
        """As :meth:`Strategy.run_training_step`; with tensor parallelism the statistics are one
        data-parallel group's (every tensor-parallel group computes the same ones) and the stop votes
        every rank's, summed in one all-reduce over the job, so no rank's vote is lost."""
        if self._data_axis is None:
            return super().run_training_step(program, batch)
        stats = one_replica_tensor(self.run(program.replica_train_step, args=(batch,)), self.device)
        stats = stats.detach().clone()
        if not self._data_axis.counts_statistics:
            stats.zero_()
        voted = torch.cat([stats, stats.new_tensor([program.stop_vote()])])
        return self.world.all_reduce(voted, name="step_statistics")

    def clip_gradients(
        self, params: Sequence[nn.Parameter], *, max_norm: float | None = None, max_value: float | None = None
    ) -> torch.Tensor:
        """As :meth:`Strategy.clip_gradients`; with tensor parallelism the norm sums each ``DTensor``
        gradient's shards over its tensor-parallel group (collective over the job)."""
        if self._data_axis is None:
            return super().clip_gradients(params, max_norm=max_norm, max_value=max_value)
        norm = gradient_norm(params, self.device)
        with_grad = [p for p in params if p.grad is not None]
        # torch's foreach arithmetic takes DTensors or plain tensors in one call, not both.
        clip_by_norm([p for p in with_grad if isinstance(p.grad, DTensor)], norm, max_norm, max_value)
        clip_by_norm([p for p in with_grad if not isinstance(p.grad, DTensor)], norm, max_norm, max_value)
        return norm

    def check_precision(self, precision: str) -> None:
        if self._data_axis is not None and precision == "fp16":
            raise ValueError(
                "MultiWorkerMirroredStrategy with tensor parallelism does not train in precision='fp16': "
                "the loss scaler's overflow check would see each rank's shard of the gradient and could "
                "skip a step on some ranks only (and torch's unscaling refuses DTensor and plain "
                "gradients together); use 'bf16'"
            )

    def _state_layout(self) -> StateLayout:
        return super()._state_layout() if self._data_axis is None else TensorParallelLayout(self)

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
