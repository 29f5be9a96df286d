"""PipelineStrategy: split a model into stages, one process each, fed by micro-batches.

What is split: an ``nn.Sequential`` (or list of modules) at layer indices, balanced by measured time
unless ``split_points`` says where; or any ``nn.Module`` at module paths
(``split_points=["transformer.h.2"]``), traced with ``torch.export`` and cut before each named module
(:mod:`spread.pipeline.graph_split`). A parameter several stages use (GPT-2's tied embedding and LM
head) stays one parameter: its stages sum their gradients after each step. ``Trainer`` hands the
``loss_fn`` the output's prediction (``logits``), as on one device; ``train_step`` hands it the raw
model output.

Batches, as on one device: ``(inputs, targets)``, or (a model split at module paths) a dict of the
model's keyword tensors, Hugging Face style (``model(**batch)``; every tensor is cut into the same
micro-batches; ``labels`` reach the stage that uses them, the last one when the model computes its
loss, without a transfer: every stage reads the batch). With ``Trainer(loss_fn=None)`` the last stage
takes the model's own ``loss`` (``GPT2LMHeadModel(labels=...)``). Exactness of a model's own mean
loss: each micro-batch's mean is weighted by its share of the samples, as ``Trainer(
accumulation_steps=k)`` and every data-parallel strategy weigh a replica's mean; that is the mean over
the global batch when every sample counts the same number of loss terms (causal-LM batches of equal
length without ``-100`` labels). A token mean over labels with ``-100`` (padding) becomes the mean of
the micro-batches' token means, the result of one device with ``accumulation_steps=microbatches``.

Topology: ``stages`` x ``replicas`` processes. Global rank ``r`` is stage ``r % stages`` of pipeline
replica ``r // stages``; the ranks of one pipeline replica are contiguous. Every rank of a pipeline
replica reads the same slice of each global batch (stage 0 uses the inputs, the last stage the
targets). With ``replicas > 1`` (hybrid), the replicas agree on each step of data read per replica
(uneven ``shard()`` shards end together) and a stream is read by replica 0 (:meth:`_data_channel`);
each stage's gradients are all-reduced within that stage's replica group (``dist.new_group``) by
:class:`~spread.comm.GradientReducer`, overlapped with the last micro-batch's backward.

Equivalence: each micro-batch's mean loss is scaled by its share of the *global* batch before its
backward, gradients accumulate over the micro-batches and are summed over replicas, and the
optimizer steps once per mini-batch, so the update equals one device on the same global batch.

How to train: ``Trainer.fit`` (it calls :meth:`PipelineStrategy.run_training_step`), or a custom loop::

    strategy = spread.PipelineStrategy(stages=2, microbatches=4, schedule="1f1b")
    with strategy.scope():
        model = nn.Sequential(...); optimizer = torch.optim.Adam(model.parameters())
    for x, y in strategy.distribute_dataset(data, global_batch_size=64):
        optimizer.zero_grad()
        loss = strategy.train_step(model, x, y, loss_fn)   # the global mean loss, on every rank
        optimizer.step()

Every rank builds the whole model (rank 0's weights win, as in the other strategies) but computes only
its own stage; parameters of other stages get no gradient, so the optimizer leaves them alone, and
their values in this rank's copy go out of date: after a training step ``model.state_dict()`` raises
until :meth:`gather_state_dict` (every rank) or ``load_state_dict`` makes the copy current.
``model(x)`` under ``torch.no_grad()`` runs the whole pipeline and returns the output on every rank
(that is how ``Trainer.evaluate/predict`` work). Checkpoints: :meth:`gather_state_dict` brings every
rank's copy of the model up to date and returns the full model's ``state_dict`` (original keys, loads
into a one-device model); loading a one-device ``state_dict`` into ``model`` on every rank works as is.
:meth:`gather_optimizer_state_dict` does the same for the optimizer, so ``BackupAndRestore`` and
``ModelCheckpoint`` save one-device checkpoints under a pipeline (see that method for why a gather).

BatchNorm inside a stage normalises each micro-batch by its own statistics and updates its running
statistics once per micro-batch: the computation of one device that runs the global batch as
``microbatches`` accumulated micro-batches (``Trainer(accumulation_steps=microbatches)``), not one
device on the whole batch. ``sync_batchnorm=True`` is refused: statistics over the global batch would
need every micro-batch's forward before any could be normalised, which is what a pipeline avoids.
With ``replicas > 1`` a stage's buffers are averaged over its replicas after each training step,
weighted by their shares of the global batch (as MultiWorkerMirroredStrategy does), so the replicas
hold the same statistics.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from spread.checkpoint.optimizer_exchange import broadcast_optimizer_state
from spread.cluster import ClusterSpec, resolve_cluster
from spread.cluster.rendezvous import Rendezvous
from spread.cluster.threads import share_cores
from spread.comm import DEFAULT_BUCKET_CAP_MB, Collectives, GradientReducer
from spread.comm.buffers import BufferAverager
from spread.comm.compiled import compiled_kind
from spread.comm.ops import classify_error, destroy_group
from spread.comm.peers import record_job_processes
from spread.data import DataChannel, ReplicaLayout
from spread.data.batches import as_batch
from spread.errors import (
    CollectiveError,
    CollectiveTimeout,
    PeerLostError,
    PipelineStageError,
    SpreadError,
    WorldSizeError,
)
from spread.memory import checkpoint_stage
from spread.memory.forward_wrap import unwrap_forward, wrap_forward, wrappers
from spread.pipeline import (
    BALANCE_BY,
    SCHEDULES,
    Heartbeat,
    StageLink,
    StageRunner,
    as_layers,
    make_schedule,
    partition,
)
from spread.pipeline.affinity import CpuBinding, bind_local_cpus
from spread.pipeline.graph_split import GraphStage, check_split_points, input_names
from spread.pipeline.ownership import StaleStateGuard, TiedGradients, first_owned
from spread.pipeline.p2p import HEADER_LEN, decode_header, encode_header
from spread.pipeline.partition import bounds_from_split_points, check_stage_count
from spread.strategies.base import Strategy, TrainingProgram, one_replica_tensor, run_as_replica
from spread.strategies.checkpointing import StateLayout
from spread.strategies.clipping import clip_by_norm, local_norm
from spread.strategies.context import get_replica_context
from spread.strategies.multi_worker_mirrored import CollectivesDataChannel
from spread.strategies.process_group import join_process_group, local_device

_WRAP_KIND = "pipeline"


def _chunks(value: Any, parts: int) -> list[Any]:
    """``parts`` micro-batches of a tensor, or of a dict of keyword tensors (each tensor cut alike
    along dimension 0; sizes differ by at most one, the larger first)."""
    if parts == 0:
        return []
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    if isinstance(value, Mapping):
        _num_samples(value)  # every value a tensor with the same number of samples
        columns = {k: torch.tensor_split(v, parts) for k, v in value.items()}
        return [{k: column[i] for k, column in columns.items()} for i in range(parts)]
    raise TypeError(
        "pipeline inputs and targets must be tensors (or a dict of keyword tensors), got "
        f"{type(value).__name__}"
    )


def _num_samples(x: Any) -> int:
    """Samples in a pipeline input: dimension 0 of the tensor, or of every tensor of a dict."""
    if isinstance(x, torch.Tensor):
        return int(x.shape[0])
    if isinstance(x, Mapping):
        sizes = {k: int(v.shape[0]) for k, v in x.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        others = sorted(k for k in x if k not in sizes)
        if others:
            raise TypeError(
                f"a pipeline cuts every entry of a dict batch into micro-batches along dimension 0; {others} "
                "are not tensors with a batch dimension"
            )
        if len(set(sizes.values())) != 1:
            raise ValueError(
                f"the dict batch's tensors disagree on the number of samples (dimension 0): {sizes}"
            )
        return next(iter(sizes.values()))
    raise TypeError(f"pipeline inputs must be tensors (or a dict of keyword tensors), got {type(x).__name__}")


def _combine(column: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """One output tensor of the whole batch from its micro-batches' pieces: concatenated along the
    batch dimension, or, for a scalar (a ``ModelOutput``'s mean ``loss``), averaged by samples."""
    if column[0].dim() > 0:
        return torch.cat(list(column))
    stacked = torch.stack([t.to(torch.float64) for t in column])
    share = torch.tensor(sizes, dtype=torch.float64, device=stacked.device) / sum(sizes)
    return (stacked * share).sum().to(column[0].dtype)


class PipelineStrategy(Strategy):
    """Pipeline parallelism (GPipe or 1F1B) over ``stages`` processes, times ``replicas`` (hybrid).

    Args:
        stages: number of pipeline stages (processes per pipeline replica).
        microbatches: micro-batches per mini-batch (M >= 1); more means a smaller bubble
            ``(S-1)/(M+S-1)`` but smaller, less efficient pieces of work.
        schedule: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (same math, at most
            ``S - stage`` micro-batches' activations alive at once) or ``"zb"`` (zero bubble,
            ZB-H1-style: 1F1B with each backward split into the input gradient, sent at once, and
            the weight gradients, computed while the stage would wait; one more micro-batch alive
            than 1F1B; see :mod:`spread.pipeline.split_backward`).
        split_points: where stages 1..S-1 start. Integers: indices of the first layer of each stage
            of an ``nn.Sequential`` (default: balanced by ``balance_by``). Strings: module paths of
            any ``nn.Module`` (``"transformer.h.2"``, as in ``model.named_modules()``); the model is
            then traced with ``torch.export`` and cut before each named module (see
            :mod:`spread.pipeline.graph_split`).
        replicas: data-parallel copies of the pipeline (the job has ``stages * replicas`` ranks).
        balance_by: ``"time"`` (forward+backward per layer, measured on rank 0 on the first
            micro-batch; parameter count when none is available) or ``"params"``.
        checkpoint_stages: recompute each stage's activations in backward (keeps only stage inputs;
            see :func:`spread.memory.checkpoint_stage`).
        bind_cpus: on CPU, bind each stage process to its own share of the node's CPUs (and cap its
            intra-op threads to it), so neighbouring stages are not woken onto one CPU at every
            hand-off (:mod:`spread.pipeline.affinity`); skipped where the process's CPUs are already
            narrowed or there are fewer CPUs than local processes. Undone by :meth:`close`. Pass
            False on a machine shared with other busy jobs (a bound stage cannot leave a loaded CPU).
        cluster, init_timeout, collective_timeout, bucket_cap_mb: as for MultiWorkerMirroredStrategy.
        sync_batchnorm: must stay ``False`` (see the module's BatchNorm paragraph); ``True`` raises.
    """

    def __init__(
        self,
        stages: int,
        microbatches: int = 1,
        schedule: str = "gpipe",
        split_points: Sequence[int] | Sequence[str] | None = None,
        replicas: int = 1,
        *,
        balance_by: str = "time",
        checkpoint_stages: bool = False,
        bind_cpus: bool = True,
        cluster: ClusterSpec | None = None,
        init_timeout: float | None = None,
        collective_timeout: float | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        record_times: bool = False,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(sync_batchnorm=sync_batchnorm)
        if sync_batchnorm:
            raise ValueError(
                "PipelineStrategy does not support sync_batchnorm=True: BatchNorm in a stage normalises "
                "each micro-batch (as one device accumulating `microbatches` micro-batches would); "
                "statistics over the global batch would need every micro-batch's forward first"
            )
        _check_args(stages, microbatches, schedule, split_points, replicas, balance_by)
        self.named_split = split_points is not None and all(isinstance(p, str) for p in split_points)
        if schedule == "zb" and checkpoint_stages:
            raise ValueError(
                "schedule='zb' does not combine with checkpoint_stages=True: its weight pass runs once "
                "per module, and each run would recompute the checkpointed stage's forward; use "
                "schedule='1f1b' (least activation memory) with checkpointing"
            )
        self.stages, self.microbatches, self.schedule = stages, microbatches, schedule
        self.split_points: list[Any] | None = list(split_points) if split_points is not None else None
        self.replicas, self.balance_by = replicas, balance_by
        self.checkpoint_stages = checkpoint_stages
        self.bucket_cap_mb = bucket_cap_mb
        self.record_times = record_times
        self.cluster = cluster if cluster is not None else resolve_cluster()
        share_cores(self.cluster)  # several processes on this host, no launcher: not every core each
        if self.cluster.world_size != stages * replicas:
            raise WorldSizeError(
                f"PipelineStrategy(stages={stages}, replicas={replicas}) needs {stages * replicas} "
                f"processes, but the job has {self.cluster.world_size}; launch it with "
                f"`spread run -n {stages * replicas}` (or change stages/replicas)",
                needed=stages * replicas,
                available=self.cluster.world_size,
            )
        self._device = local_device(self.cluster)
        self._resources.owner = f"PipelineStrategy rank {self.cluster.rank}"
        # Before joining: the transport and heartbeat threads started below inherit the binding.
        self.cpu_binding: CpuBinding | None = (
            bind_local_cpus(self.cluster.local_rank, self.cluster.local_world_size)
            if bind_cpus and self._device.type == "cpu"
            else None
        )
        if self.cpu_binding is not None:
            self._resources.push(self.cpu_binding.restore)  # released last
        try:
            self._join(stages, replicas, init_timeout, collective_timeout)
        except BaseException:
            self._resources.release()
            raise
        self._model: nn.Module | None = None
        self._bounds: list[tuple[int, int]] | None = None
        self.stage_module: nn.Module | None = None
        self._runner: StageRunner | None = None
        self._reducer: GradientReducer | None = None
        self._buffers: BufferAverager | None = None
        self._graph_stage: GraphStage | None = None
        self._stage_tensors: list[list[torch.Tensor]] = []  # per stage: the user's tensors it uses
        self._tied: TiedGradients | None = None
        self._state_guard: StaleStateGuard | None = None

    def _cluster_spec(self) -> ClusterSpec:
        return self.cluster

    def _join(
        self, stages: int, replicas: int, init_timeout: float | None, collective_timeout: float | None
    ) -> None:
        """Join the job, make the stage and replica groups, the stage link and the heartbeat; each is
        pushed onto ``self._resources`` as it is made, so they are released in the reverse order."""
        rendezvous: Rendezvous | None = join_process_group(
            self.cluster, self._device, init_timeout=init_timeout, collective_timeout=collective_timeout
        )
        if rendezvous is not None:  # ours to destroy; a group the script made is not
            self._resources.push(rendezvous.close)
        self._rank = dist.get_rank()
        self.stage, self.replica = self._rank % stages, self._rank // stages
        self.world = Collectives(device=self._device)
        record_job_processes(self.world)  # a lost peer is then named by rank
        # Every rank creates every group, in the same order (torch.distributed requires it).
        groups = [dist.new_group([r * stages + s for r in range(replicas)]) for s in range(stages)]
        groups += [dist.new_group([r * stages + s for s in range(stages)]) for r in range(replicas)]
        self.replica_collectives = Collectives(groups[self.stage], device=self._device)
        self.pipeline_collectives = Collectives(groups[stages + self.replica], device=self._device)
        self._resources.push(
            partial(_release_groups, groups, [self.replica_collectives, self.pipeline_collectives])
        )
        first = self.replica * stages
        self.link = StageLink(
            self.rank,
            first + self.stage - 1 if self.stage > 0 else None,
            first + self.stage + 1 if self.stage < stages - 1 else None,
            self._device,
        )
        self._resources.push(self.link.close)
        store = rendezvous.store if rendezvous is not None else None
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        self.heartbeat = Heartbeat(
            store, self.rank, self.world.world_size, store_host_rank=None if agent_store else 0
        )
        self._resources.push(self.heartbeat.close)

    # -- topology ----------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self.replicas

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def stage_bounds(self) -> list[tuple[int, int]] | None:
        """Each stage's layer range ``[start, end)``, once the model is partitioned."""
        return self._bounds

    @property
    def last_step_times(self):
        """This stage's :class:`~spread.pipeline.StepTimes` of the last training step."""
        return self._runner.last_times if self._runner is not None else None

    @property
    def _layout(self) -> ReplicaLayout:
        return ReplicaLayout(
            self.replicas, self.replica, 1, process_index=self.replica, num_processes=self.replicas
        )

    def _data_channel(self) -> DataChannel:
        """The pipeline replicas' data processes talk within this stage's replica group (one rank per
        replica; every stage of a replica reads the same data, so each group sees the same counts):
        uneven file shards end together (a finished replica steps with empty batches, weighted zero)
        and a stream without ``shard()`` is read by replica 0's rank of the stage and broadcast. One
        replica (``num_processes == 1``): unused."""
        return CollectivesDataChannel(self.replica_collectives, self._device, first_rank=self.stage)

    # -- variables ---------------------------------------------------------------------------------
    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """Nothing yet: the model is split (and rank 0's weights broadcast) at its first use."""

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Adopt ``model`` (an ``nn.Sequential`` or a list of modules; any module with named
        ``split_points``) as the one pipelined model.

        Local: the split and the broadcast of rank 0's weights happen at the model's first training
        step or forward, on every rank together. A model compiled as a whole is refused (its one graph
        cannot be cut into stages); layers compiled in place (``layer.compile()``) are fine.
        """
        if self._model is model:
            return model
        if self._model is not None:
            raise SpreadError(
                "a PipelineStrategy pipelines one model; create another strategy for a second one"
            )
        _refuse_compiled_whole(model)
        self._check_meta_tensors(list(model.modules()))
        self._check_new_parameters(list(model.parameters()))  # a tensor-parallel model, by name
        if self.named_split:
            assert self.split_points is not None
            check_split_points(model, self.split_points)  # refuse unknown module paths, now
        else:
            as_layers(model)  # refuse anything that is not a sequence of layers, now
        model.to(self._device)
        self._model = model
        wrap_forward(model, _WRAP_KIND, self._pipelined_forward)
        return model

    def _ensure_partitioned(self, sample: Any) -> None:
        if self._bounds is not None or self._graph_stage is not None:
            return
        assert self._model is not None
        if self.named_split:
            self._partition_traced(sample)
        else:
            self._partition_layers(sample)
        self._tied = TiedGradients(self._stage_tensors, self.stage, self.replica, self.replicas, self._device)
        self._resources.push(self._tied.close)
        self._state_guard = StaleStateGuard(self._model, self._stage_tensors, self.stage, self.rank)

    def _partition_layers(self, sample: torch.Tensor | None) -> None:
        assert self._model is not None
        layers = as_layers(self._model)
        # Argument errors first, on every rank alike, before any rank waits in a collective.
        check_stage_count(len(layers), self.stages)
        if self.split_points is not None:
            bounds_from_split_points(len(layers), self.stages, self.split_points)
        with self._guard("the initial weight broadcast and partition"):
            self.world.broadcast_tensors(
                [*self._model.parameters(), *self._model.buffers()], src=0, name="pipeline_weights"
            )
            edges = torch.zeros(self.stages + 1, dtype=torch.int64, device=self.world.device)
            if self.rank == 0:
                bounds = partition(
                    layers,
                    self.stages,
                    split_points=self.split_points,
                    sample=sample,
                    balance_by=self.balance_by,
                )
                edges.copy_(torch.tensor([b[0] for b in bounds] + [len(layers)]))
            self.world.broadcast(edges, src=0, name="pipeline_partition")
        e = edges.tolist()
        self._bounds = [(e[i], e[i + 1]) for i in range(self.stages)]
        self._stage_tensors = [
            _unique(t for layer in layers[a:b] for t in (*layer.parameters(), *layer.buffers()))
            for a, b in self._bounds
        ]
        start, end = self._bounds[self.stage]
        self._start_stage(nn.Sequential(*layers[start:end]), None)

    def _partition_traced(self, sample: Any) -> None:
        """Every rank traces the whole model on the same first micro-batch, so every rank knows every
        stage's tensors without a message; rank 0's weights are broadcast first, as for layers."""
        assert self._model is not None and self.split_points is not None
        input_names(sample)  # one tensor or a dict of them, refused alike on every rank
        with self._guard("the initial weight broadcast"):
            self.world.broadcast_tensors(
                [*self._model.parameters(), *self._model.buffers()], src=0, name="pipeline_weights"
            )
        ours = next(w for w in wrappers(self._model) if w.kind == _WRAP_KIND)
        stage = GraphStage(self._model, self.split_points, self.stage, call=ours.inner)
        split = stage.prepare(sample)
        assert split is not None
        self._stage_tensors = [split.stage_tensors(s) for s in range(self.stages)]
        self._graph_stage = stage
        self._start_stage(stage, stage)

    def _prepare_traces(self, xs: Sequence[Any]) -> None:
        """Trace the model for input shapes (or train/eval mode) not seen yet; the stages must use the
        same tensors as in the first trace (the tied-gradient groups and checkpoints rely on it)."""
        if self._graph_stage is None:
            return
        for x in xs:
            with self._reading_state():  # the tracer reads state_dict(keep_vars=True)
                split = self._graph_stage.prepare(x)
            if split is None:
                continue
            for s in range(self.stages):
                if [id(t) for t in split.stage_tensors(s)] != [id(t) for t in self._stage_tensors[s]]:
                    shapes = (
                        {k: tuple(v.shape) for k, v in x.items()}
                        if isinstance(x, Mapping)
                        else tuple(x.shape)
                    )
                    raise SpreadError(
                        f"tracing the model for input shapes {shapes} gave stage {s} other parameters "
                        "than the first trace did; the split must not depend on the input"
                    )

    def _start_stage(self, module: nn.Module, traced: GraphStage | None) -> None:
        self.stage_module = module
        if self.checkpoint_stages:
            checkpoint_stage(self.stage_module)
        self._runner = StageRunner(
            self.stage_module, self.stage, self.stages, self.link, record=self.record_times, traced=traced
        )
        if self.replicas > 1:
            self._reducer = GradientReducer(
                list(self.stage_module.parameters()),
                self.replica_collectives,
                bucket_cap_mb=self.bucket_cap_mb,
            )
            self._reducer.grad_scale = 1.0  # micro-batch losses already carry their global-batch share
            buffers = list(self.stage_module.buffers())
            self._buffers = BufferAverager(buffers, self.replica_collectives) if buffers else None

    def _check_model(self, model: nn.Module) -> None:
        if self._model is None:
            self.prepare_model(model)
        elif model is not self._model:
            raise SpreadError("this PipelineStrategy already pipelines another model")

    def _sum_tied_grads(self) -> None:
        if self._tied is not None:
            self._tied.sum()

    def local_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with self._reading_state():
            return model.state_dict()

    @contextmanager
    def _reading_state(self):
        """The strategy's own reads of the whole state (tracing, the gather) pass the stale guard."""
        if self._state_guard is None:
            yield
        else:
            with self._state_guard.reading():
                yield

    # -- training ----------------------------------------------------------------------------------
    def _check_input_kind(self, x: Any) -> None:
        """Dict batches are the keyword arguments of a model split at module paths; a layer split
        passes one tensor into its first layer."""
        if isinstance(x, Mapping) and not self.named_split:
            raise TypeError(
                "PipelineStrategy takes a dict batch (the model's keyword arguments, Hugging Face style) "
                "only for a model split at module paths (split_points=['transformer.h.2', ...]); a model "
                "split by layer index takes (inputs, targets) batches"
            )

    def _check_model_loss(self, xs: Sequence[Any], model_loss: Callable[[Any], torch.Tensor]) -> None:
        """Every rank knows the model's output structure from its own trace, so a model that computes
        no loss for these inputs (a batch without ``labels``) is refused by every rank alike, before
        any stage waits for another."""
        if self._graph_stage is None:
            raise ValueError(
                "Trainer(loss_fn=None) takes the loss the model computes, so PipelineStrategy must trace "
                "it: give split_points as module paths (split_points=['transformer.h.2', ...]); a model "
                "split by layer index needs a loss_fn"
            )
        for structure in {id(s): s for s in map(self._graph_stage.rebuild, xs)}.values():
            model_loss(structure([torch.empty(0)] * structure.num_tensors))

    def _step(
        self,
        model: nn.Module,
        x: Any,
        y: Any,
        loss_fn: Callable,
        on_loss: Callable[[Any, Any, torch.Tensor, int], None] | None,
        forward_context: Callable[[], AbstractContextManager] | None = None,
        model_loss: Callable[[Any], torch.Tensor] | None = None,
    ) -> None:
        """One mini-batch through the pipeline. ``x``: a tensor or a dict of keyword tensors (its
        ``labels`` are then the targets ``loss_fn`` gets); ``on_loss(output, target, loss, samples)``
        per micro-batch on the last stage; ``model_loss``: the loss is the model's own (checked first)."""
        self._check_model(model)
        if get_replica_context() is not None:
            raise SpreadError("call train_step from the training loop, not inside strategy.run")
        self._check_input_kind(x)
        n = _num_samples(x)
        m = min(self.microbatches, n)
        xs = _chunks(x, m)
        ys = [c.get("labels") for c in xs] if isinstance(x, Mapping) else _chunks(y, m)
        sizes = [_num_samples(c) for c in xs]
        self._ensure_partitioned(xs[0] if xs else None)
        self._prepare_traces(xs)
        if model_loss is not None:
            self._check_model_loss(xs, model_loss)
        if self._state_guard is not None:  # from now on, other stages' layers here go out of date
            self._state_guard.stale = self.stages > 1
        info, self._step_info = self._step_info, None
        global_n = info.global_size if info is not None and info.global_size > 0 else n * self.replicas
        weights = [size / global_n for size in sizes]

        def counted(i: int, out: Any, target: Any, loss: torch.Tensor) -> None:
            if on_loss is not None:
                on_loss(out, target, loss, sizes[i])

        assert self._runner is not None
        with self._guard("a training step"):
            if m == 0:  # this replica got no samples: it still joins the gradient exchange
                if self._reducer is not None:
                    self._reducer.reduce_now()
                if self._buffers is not None:
                    self._buffers.sync(0.0)
                self._sum_tied_grads()
                return
            self._runner.train(
                make_schedule(self.schedule, self.stage, self.stages, m),
                xs,
                ys,
                loss_fn,
                weights,
                no_sync=self._reducer.no_sync if self._reducer is not None else None,
                on_loss=counted,
                forward_context=forward_context,
            )
            if self._buffers is not None:  # the stage's replicas: the same running statistics
                self._buffers.sync(n / global_n)
            self._sum_tied_grads()

    def train_step(self, model: nn.Module, x: Any, y: Any, loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of one mini-batch through the pipeline; ``.grad`` holds the gradient
        of the global mean loss when it returns (call ``optimizer.step()`` next). ``x`` is a tensor or
        (a model split at module paths) a dict of keyword tensors, ``model(**x)``; ``loss_fn(output,
        y_part)`` gets the raw model output and the micro-batch's part of ``y`` (of ``x["labels"]`` for
        a dict; ``lambda out, _: out.loss`` takes a model's own loss). Collective: every rank calls it
        with its batch. Returns the global mean loss, the same on every rank."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.world.device)

        def on_loss(out: Any, target: Any, loss: torch.Tensor, samples: int) -> None:
            sums[0] += float(loss.detach()) * samples
            sums[1] += samples

        self._step(model, x, y, loss_fn, on_loss)
        with self._guard("the loss all-reduce"):
            self.world.all_reduce(sums, name="pipeline_loss")
        return (sums[0] / sums[1].clamp_min(1)).to(torch.float32)

    def run_training_step(self, program: TrainingProgram, batch: Any) -> torch.Tensor:
        """One pipelined step; returns ``[loss*n, n, metric sums..., stop votes]`` summed over the
        global batch (votes: every rank's ``program.stop_vote()``), the same on every rank. The
        caller (the Trainer) steps the optimizer afterwards. Batches as on one device: ``(inputs,
        targets)``, or a dict of the model's keyword tensors; ``loss_fn=None`` takes the model's own
        loss (see the module's note on its exactness)."""
        if program.accumulation_steps != 1:
            raise ValueError(
                "Trainer(accumulation_steps=k) does not combine with PipelineStrategy: the pipeline "
                "already splits each batch; raise PipelineStrategy(microbatches=...) instead"
            )
        b = as_batch(batch, who="PipelineStrategy")
        if b.weights is not None:
            raise ValueError(
                "PipelineStrategy does not weigh samples (sample_weight): the loss is computed per "
                "micro-batch on the last stage; train without sample weights"
            )
        user_loss_fn = program.loss_fn
        if b.as_keywords and user_loss_fn is not None and b.targets is None:
            raise ValueError("Trainer got a batch without 'labels' and a loss_fn: the loss_fn has no targets")

        def loss_fn(out: Any, target: Any) -> torch.Tensor:  # as the Trainer does on one device
            if user_loss_fn is None:
                return program.model_loss(out)
            return user_loss_fn(program.prediction(out), target)

        width = 2 + len(program.metrics)
        stats = torch.zeros(width + 1, dtype=torch.float64, device=self.world.device)

        def on_loss(out: Any, target: Any, loss: torch.Tensor, samples: int) -> None:
            pred = program.prediction(out)
            stats[:width].add_(program.batch_stats(pred, target, loss, samples).to(stats.device))

        model_loss = program.model_loss if user_loss_fn is None else None
        self._step(program.model, b.inputs, b.targets, loss_fn, on_loss, program.forward_context, model_loss)
        stats[width] = program.stop_vote()  # every rank votes; only last stages add statistics
        with self._guard("the metrics all-reduce"):
            self.world.all_reduce(stats, name="pipeline_metrics")  # only last stages contribute
        return stats

    # -- gradients ---------------------------------------------------------------------------------
    def clip_gradients(
        self, params: Sequence[nn.Parameter], *, max_norm: float | None = None, max_value: float | None = None
    ) -> torch.Tensor:
        """Each stage holds its own layers' gradients only (the others' ``.grad`` stay empty or
        zero): the squared norms are summed over the stages of this pipeline replica (one small
        all-reduce; after the hybrid exchange a stage's replicas hold the same gradient). A parameter
        several stages use holds the same summed gradient on each: only the first of them counts it.
        Each stage then clips its own gradients by that norm."""
        skip = self._tied.counted_elsewhere if self._tied is not None else set()
        counted = [p for p in params if id(p) not in skip]  # a tied parameter counts once
        squared = local_norm(counted, self._device).to(torch.float64).square().reshape(1)
        with self._guard("the gradient-norm all-reduce"):
            self.pipeline_collectives.all_reduce(squared, name="grad_norm")
        return clip_by_norm(params, squared.sqrt().to(torch.float32).reshape(()), max_norm, max_value)

    def check_precision(self, precision: str) -> None:
        if precision == "fp16":
            raise ValueError(
                "PipelineStrategy does not train with precision='fp16': a loss scaler skips a step when "
                "its own gradients overflow, and each stage would decide alone (and scale alone); "
                "use precision='bf16' (no loss scaling needed)"
            )

    # -- inference ---------------------------------------------------------------------------------
    def _pipelined_forward(self, inner: Callable, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            raise SpreadError(
                "under PipelineStrategy, model(x) runs the pipeline for inference only: call it inside "
                "torch.no_grad(); train with Trainer.fit or strategy.train_step(model, x, y, loss_fn)"
            )
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
            x: Any = args[0]
        elif kwargs and not args:
            x = kwargs
            self._check_input_kind(x)
        else:
            raise TypeError(
                "a pipelined model takes one tensor argument, or (split at module paths) keyword tensors"
            )
        n = _num_samples(x)
        if n == 0:
            return inner(x) if isinstance(x, torch.Tensor) else inner(**x)  # every rank holds every layer
        m = min(self.microbatches, n)
        xs = _chunks(x, m)
        self._ensure_partitioned(xs[0])
        self._prepare_traces(xs)
        assert self._runner is not None
        with self._guard("a pipelined forward"):
            outputs = self._runner.forward(xs)
            if self._graph_stage is None:
                return self._broadcast_output(torch.cat(outputs) if outputs is not None else None)
            # A traced model's output may be a structure (a ModelOutput): every rank knows it from
            # its own trace, so only its tensors travel, each concatenated over the micro-batches.
            structure = self._graph_stage.rebuild(xs[0])
            flat = None
            if outputs is not None:
                parts = [[t for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)] for o in outputs]
                sizes = [_num_samples(c) for c in xs]
                flat = [_combine(column, sizes) for column in zip(*parts, strict=True)]
            tensors = [
                self._broadcast_output(flat[k] if flat is not None else None)
                for k in range(structure.num_tensors)
            ]
            return structure(tensors)

    def _broadcast_output(self, out: torch.Tensor | None) -> torch.Tensor:
        src = self.replica * self.stages + self.stages - 1
        pipe = self.pipeline_collectives
        header = (
            encode_header(out, False).to(pipe.device)
            if out is not None
            else torch.zeros(HEADER_LEN, dtype=torch.int64, device=pipe.device)
        )
        pipe.broadcast(header, src=src, name="pipeline_output_header")
        dtype, _, shape = decode_header(header.cpu())
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=self._device)
        pipe.broadcast(out, src=src, name="pipeline_output")
        return out

    # -- cross-replica -----------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Call ``fn`` once in replica context (no gradient exchange: training goes through
        :meth:`train_step` or ``Trainer``). Inside, ``model(x)`` under no_grad runs the pipeline."""
        return run_as_replica(self, fn, args, kwargs, self.replica)

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine over the data-parallel replicas. ``value`` must be the same on every stage of a
        pipeline replica (as the results of ``train_step`` and pipelined ``model(x)`` are)."""
        return super().reduce(op, value, axis)

    def _sum_over_replicas(self, value: Any) -> tuple[torch.Tensor, int]:
        tensor = one_replica_tensor(value, self._device).detach().clone()
        with self._guard("reduce"):
            self.replica_collectives.all_reduce(tensor, name="reduce")
        return tensor, self.replicas

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        tensor = one_replica_tensor(value, self._device).detach()
        with self._guard("gather"):
            parts = self.replica_collectives.all_gather_uneven(tensor.movedim(axis, 0).contiguous())
        return torch.cat(parts, dim=0).movedim(0, axis)

    # -- checkpoints -------------------------------------------------------------------------------
    def _state_layout(self) -> StateLayout:
        return PipelineLayout(self)

    def gather_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """Bring every rank's copy of every layer up to date (each stage's values from its replica-0
        rank) and return ``model.state_dict()``: the full model under its original keys, loadable into
        a one-device model. Collective: call it on every rank. Afterwards ``model.state_dict()`` works
        on every rank until the next training step (:class:`~spread.pipeline.ownership.StaleStateGuard`)."""
        model = model if model is not None else self._model
        if model is None or model is not self._model:
            raise SpreadError("gather_state_dict needs the model this strategy pipelines")
        if self._stage_tensors:
            with self._guard("gather_state_dict"):
                for s, tensors in enumerate(first_owned(self._stage_tensors)):
                    self.world.broadcast_tensors(tensors, src=s, name="pipeline_weights")
        if self._state_guard is not None:
            self._state_guard.stale = False
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def gather_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's ``state_dict`` as one device would have it: every stage's per-parameter state
        (from that stage's replica-0 rank), under the indices of the whole model's parameters.
        Collective: call it on every rank; every rank gets the same result.

        Why a gather and not per-rank shards through ``torch.distributed.checkpoint``: a pipeline
        backup then has the one-device format (the same ``state.pt`` as every other strategy), so it
        loads into a one-device model and optimizer, survives a different stage split on restart (the
        time-balanced split is measured anew), and needs no per-rank shape metadata to read back (a
        fresh optimizer has no state to describe the shards with). Its cost is one broadcast per stage
        and dtype of that stage's state; every rank already holds the whole model, so the gathered copy
        adds at most one model's optimizer state per rank, briefly. Parameters a rank does not train
        get no gradient, so the other stages' state it loads on restore is never used.
        """
        local = optimizer.state_dict()
        if not self._stage_tensors or self.world.world_size == 1:
            return local
        assert self._model is not None
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        merged: dict[int, dict[str, Any]] = {}
        with self._guard("gather_optimizer_state_dict"):
            for s, tensors in enumerate(first_owned(self._stage_tensors)):
                owned = sorted(index[id(p)] for p in tensors if id(p) in index)
                merged.update(
                    broadcast_optimizer_state(self.world, local["state"], owned, src=s, device=self._device)
                )
        return {"state": merged, "param_groups": local["param_groups"]}

    def gather_from_every_rank(self, value: torch.Tensor) -> torch.Tensor:
        """Equally shaped tensors of every rank (every stage of every replica), stacked in rank order:
        :meth:`gather` spans only this stage's replica group."""
        tensor = one_replica_tensor(value, self._device).detach()
        with self._guard("gather_from_every_rank"):
            return torch.cat(self.world.all_gather(tensor.contiguous(), name="gather_from_every_rank"))

    # -- failures ----------------------------------------------------------------------------------
    @contextmanager
    def _guard(self, what: str):
        """Turn a lost peer or a deadline into PipelineStageError naming the stage that died."""
        try:
            yield
        except PipelineStageError:
            raise
        except (CollectiveError, RuntimeError, dist.DistError) as exc:
            err = exc if isinstance(exc, CollectiveError) else classify_error(self.rank, what, -1, exc)
            if not isinstance(err, (PeerLostError, CollectiveTimeout)):
                raise  # not a communication failure (a bug in the model, a shape mismatch): as it is
            suspects = [err.peer] if err.peer is not None else []
            dead = self.heartbeat.diagnose(suspects)
            self.heartbeat.report(dead)
            named = [(r, r % self.stages) for r in dead]
            raise PipelineStageError(self.rank, self.stage, named, f"{what} ({err.op})", err.detail) from exc

    def close(self) -> None:
        if self._closed:
            return
        self.heartbeat.report(None)  # left on purpose (a script that never closes leaves no report)
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        if self._runner is not None:
            self._runner.close()
        if self._model is not None:
            unwrap_forward(self._model, _WRAP_KIND)
        if self._state_guard is not None:
            self._state_guard.remove()
        super().close()  # heartbeat, stage link, subgroups, process group, CPU binding

    def __repr__(self) -> str:
        return (
            f"PipelineStrategy(stages={self.stages}, microbatches={self.microbatches}, "
            f"schedule={self.schedule!r}, replicas={self.replicas}, rank={self.rank}, stage={self.stage})"
        )


def _unique(tensors: Any) -> list[torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for t in tensors:
        found.setdefault(id(t), t)
    return list(found.values())


def _release_groups(groups: list, collectives: list[Collectives]) -> None:
    """Destroy this strategy's subgroups and drop every reference to them, so that their worker
    threads are joined now, not at interpreter exit (see :mod:`spread.strategies.teardown`)."""
    for c in collectives:
        c.close()
    for group in groups:
        destroy_group(group)
    groups.clear()


def _refuse_compiled_whole(model: nn.Module) -> None:
    kind = compiled_kind(model) if isinstance(model, nn.Module) else None
    if kind is not None:
        raise TypeError(
            f"PipelineStrategy cannot partition a model compiled as a whole ({kind}): stages are cut "
            "from its layers, and one compiled graph cannot be split over processes (each stage would "
            "run its layers uncompiled). Pass the uncompiled nn.Sequential; to compile, compile its "
            "layers in place before the strategy adopts it: `for layer in model: layer.compile()`."
        )


def _check_args(
    stages: Any, microbatches: Any, schedule: Any, split_points: Any, replicas: Any, balance_by: Any
) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got stages={stages!r}")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(
            f"microbatches must be a positive integer (M >= 1), got microbatches={microbatches!r}"
        )
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got schedule={schedule!r}")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got replicas={replicas!r}")
    if balance_by not in BALANCE_BY:
        raise ValueError(f"balance_by must be one of {BALANCE_BY}, got balance_by={balance_by!r}")
    if split_points is not None and any(isinstance(p, str) for p in split_points):
        names = list(split_points)
        if len(names) != stages - 1 or not all(isinstance(p, str) and p for p in names):
            raise ValueError(
                f"split_points must name stages-1={stages - 1} module paths (where stages 1..{stages - 1} "
                f"start, e.g. 'transformer.h.2'), or be layer indices; got split_points={names!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"split_points must be distinct module paths, got split_points={names!r}")
    elif split_points is not None:
        points = list(split_points)
        if (
            len(points) != stages - 1
            or any(not isinstance(p, int) for p in points)
            or points != sorted(set(points))
            or (points and points[0] < 1)
        ):
            raise ValueError(
                f"split_points must be stages-1={stages - 1} strictly increasing layer indices >= 1 "
                f"(where stages 1..{stages - 1} start), got split_points={points!r}"
            )


class PipelineLayout(StateLayout):
    """A pipeline's checkpoints hold the one-device state: every stage's layers and optimizer state
    are gathered (each from its stage's first replica) before the chief writes them, so they load into
    one device, and into a pipeline cut elsewhere (see
    :meth:`PipelineStrategy.gather_optimizer_state_dict` for why not per-rank pieces)."""

    family = "pipeline"

    def __init__(self, strategy: PipelineStrategy) -> None:
        super().__init__(strategy)
        self.pipeline = strategy

    def full_state_dict(self, obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
        if isinstance(obj, nn.Module):
            return self.pipeline.gather_state_dict(obj)
        return self.pipeline.gather_optimizer_state_dict(obj)

    def load_full_state_dict(self, obj: nn.Module | torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        obj.load_state_dict(dict(state))  # every rank holds every layer: each keeps what it trains

    def module_signature(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.pipeline.local_state_dict(model)
