"""The strategy contract every strategy implements, and the parts they share.

A strategy answers three questions for a training script: where do variables live and how are they
kept in sync (``scope``), how is a step run on every replica (``run``), and how are per-replica
values combined (``reduce``, ``gather``). It composes the lower layers (cluster, comm, data) and owns
no sockets of its own.

What the layers above ask of a strategy beyond that (the Trainer's step, skipping the gradient
exchange, clipping) is a documented method of :class:`Strategy` with a default that fits a
data-parallel strategy; a strategy that differs overrides it. Training state goes through one seam,
``save_checkpoint``/``load_checkpoint``/``full_state_dict`` (:mod:`spread.strategies.checkpointing`),
whose layout each strategy supplies. Nothing above this layer probes a strategy for optional
attributes.
"""

from __future__ import annotations

import abc
import shutil
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from spread.checkpoint.remote import is_url, remove_all
from spread.cluster import ClusterSpec
from spread.data import DataChannel, DistributedDataset, ReplicaLayout, ShardPolicy, StepInfo
from spread.errors import SpreadError
from spread.memory.measure import ActivationMeter
from spread.memory.report import MemoryReport, optimizer_state_tensors, storage_bytes
from spread.strategies import checkpointing, tf_compat
from spread.strategies.checkpointing import Restored, StateLayout
from spread.strategies.clipping import clip_by_norm, local_norm
from spread.strategies.context import (
    ReplicaContext,
    _pop_scope,
    _push_scope,
    _set_replica_context,
    get_replica_context,
)
from spread.strategies.teardown import ProcessResources
from spread.strategies.tensor_parallel import refuse_dtensor_parameters
from spread.values import PerReplica, on_device

REDUCE_OPS = ("sum", "mean")


class TrainingProgram(Protocol):
    """What :meth:`Strategy.run_training_step` needs from the training loop (``spread.Trainer`` is one)."""

    @property
    def model(self) -> nn.Module: ...
    @property
    def loss_fn(self) -> Callable[..., torch.Tensor] | None: ...
    @property
    def metrics(self) -> Mapping[str, Callable[..., torch.Tensor]]: ...
    @property
    def accumulation_steps(self) -> int: ...

    def forward_context(self) -> AbstractContextManager[Any]:
        """The context forward passes and the loss run under (autocast for mixed precision; never
        the backward pass)."""
        ...

    def replica_train_step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one replica's batch; its summed ``[loss*n, n, metric sums...]``."""
        ...

    def batch_stats(self, y_pred: torch.Tensor, y: Any, loss: torch.Tensor, n: int) -> torch.Tensor:
        """``[loss*n, n, metric sums...]`` of ``n`` samples."""
        ...

    def stop_vote(self) -> float:
        """1.0 when this process asks every rank to stop after this step, else 0.0: summed with the
        step's statistics, so the ranks agree on it without a collective of their own."""
        ...

    def prediction(self, output: Any) -> torch.Tensor:
        """The tensor ``loss_fn`` and the metrics take from a model output (a ``ModelOutput``'s
        ``logits``; a tensor as it is)."""
        ...

    def model_loss(self, output: Any) -> torch.Tensor:
        """The loss a model computed itself (``loss_fn=None``: a ``ModelOutput``'s ``loss``); raises
        ``ValueError`` when the output has none."""
        ...


def check_reduce_op(op: str) -> str:
    op = str(op).lower()
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
    return op


def one_replica_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """The value of a process that drives one replica, as a tensor on ``device``.

    A one-value ``PerReplica`` is unwrapped; a tensor already on ``device`` is returned as is.
    """
    if isinstance(value, PerReplica):
        (value,) = value.values
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.as_tensor(value, device=device)


class Strategy(abc.ABC):
    """Base class: ``scope``, ``run``, ``reduce``, ``gather``, ``distribute_dataset``.

    Parameters created inside ``scope()`` (and modules passed to :meth:`prepare_model`) are *managed*:
    placed on the strategy's device, made identical on every replica when the scope exits, and kept in
    sync by gradient exchange at the end of each backward pass.

    Buffers (BatchNorm's running statistics and the like) are kept in sync too, by default: after
    each optimizer step every replica holds the average of the replicas' buffers, weighted by their
    shares of the global batch (integer buffers such as ``num_batches_tracked`` get the average
    change rounded: they advance alike and are kept equal). Running statistics are linear in the
    batch statistics, so this is one update from every replica's slice rather than rank 0's alone:
    saved models and evaluation are the same on every rank. Thread replicas share one module and
    get the same update once per step (see :mod:`spread.strategies.batchnorm`).

    Args:
        sync_batchnorm: BatchNorm layers normalise with the mean and variance of the *global* batch
            (summed over the replicas in the forward and backward passes; the running statistics
            follow them): training equals one device on the same global batch. Costs two small
            exchanges per BatchNorm layer and step. Default ``False``: each replica normalises with
            its own slice's statistics (as ``torch.nn.parallel.DistributedDataParallel`` does).
            Strategies where it cannot hold refuse it (pipelines, parameter servers).
    """

    def __init__(self, *, sync_batchnorm: bool = False) -> None:
        if not isinstance(sync_batchnorm, bool):
            raise TypeError(f"sync_batchnorm must be True or False, got {sync_batchnorm!r}")
        self._sync_batchnorm = sync_batchnorm
        self._managed: dict[int, nn.Parameter] = {}
        self._managed_buffers: dict[int, torch.Tensor] = {}
        self._step_info: StepInfo | None = None
        self._activation_bytes: int | None = None  # the last measure_activations() window's peak
        self._measuring_activations = False
        self._closed = False
        # Joined a running job (spread run --recover): the state comes from a live peer in fit.
        self.awaiting_state = False
        # Process groups and threads this strategy starts: released by close(), or at exit without it.
        self._resources = ProcessResources(type(self).__name__)

    # -- topology ----------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each synchronous step, over all processes."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The device that this process's (first) replica computes on."""

    @property
    def is_chief(self) -> bool:
        """True on the one process that prints, writes logs and saves replicated state."""
        return True

    @property
    @abc.abstractmethod
    def _layout(self) -> ReplicaLayout: ...

    def _local_devices(self) -> list[torch.device]:
        return [self.device] * self._layout.num_local_replicas

    @property
    def sync_batchnorm(self) -> bool:
        """Whether BatchNorm layers normalise with the global batch's statistics (see the class)."""
        return self._sync_batchnorm

    # -- variables ---------------------------------------------------------------------------------
    @contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Create models and optimizers inside: their parameters become managed by this strategy.

        On exit the new parameters are synchronised (the chief's values win) and hooked for gradient
        exchange. Re-entering the scope later adds the parameters created then.
        """
        # Weak references: a module built in the scope and then dropped (nn.TransformerEncoder's
        # template layer, which it deep-copies) is neither kept alive nor managed.
        created: list[weakref.ref[nn.Module]] = []

        def on_param(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            created.append(weakref.ref(module))

        def on_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
            created.append(weakref.ref(module))

        def on_module(module: nn.Module, name: str, child: nn.Module | None) -> None:
            created.append(weakref.ref(module))  # containers too: how the new modules nest
            if child is not None:
                created.append(weakref.ref(child))

        with ExitStack() as stack:
            stack.enter_context(
                _hook(nn.modules.module.register_module_parameter_registration_hook, on_param)
            )
            stack.enter_context(_hook(nn.modules.module.register_module_buffer_registration_hook, on_buffer))
            stack.enter_context(_hook(nn.modules.module.register_module_module_registration_hook, on_module))
            if self.device.type != "cpu":
                stack.enter_context(self.device)
            stack.enter_context(self._scope_context())
            _push_scope(self)
            stack.callback(_pop_scope, self)
            yield self
        # What the live new modules hold, including what registered nothing in the scope: layers
        # copied with copy.deepcopy (nn.TransformerEncoder clones its layer).
        alive = [module for module in (ref() for ref in created) if module is not None]
        modules = _unique([sub for module in alive for sub in module.modules()])
        self._check_meta_tensors(modules)
        created_params = [p for module in modules for p in module.parameters(recurse=False)]
        created_buffers = [b for module in modules for b in module.buffers(recurse=False)]
        _adopt(self, created_params, created_buffers)
        self._on_new_modules(modules)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Manage a model built outside ``scope()``: move it to the device, sync it, hook its gradients.
        Returns ``model``; a model already managed (built in the scope, or prepared) is left as it is."""
        params = list(model.parameters())
        if params and all(id(p) in self._managed for p in params):
            return model
        modules = list(model.modules())
        self._check_meta_tensors(modules)
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            model._apply(lambda t: t if t.is_meta else t.to(self.device))  # the rest: materialised
        else:
            model.to(self.device)
        _adopt(self, list(model.parameters()), list(model.buffers()))
        self._on_new_modules(modules)
        return model

    def _scope_context(self) -> AbstractContextManager[Any]:
        """Entered around the body of :meth:`scope` (a strategy recording how models are built there).
        Default: nothing."""
        return nullcontext()

    def _meta_refusal(self) -> str | None:
        """Why this strategy cannot take parameters or buffers on the meta device (None: it
        materialises them itself)."""
        return (
            "it holds every parameter whole on each process, so the model would be materialised whole anyway"
        )

    def _check_meta_tensors(self, modules: Sequence[nn.Module]) -> None:
        """Refuse, by name, parameters and buffers on the meta device (shapes without values) unless
        this strategy materialises them."""
        reason = self._meta_refusal()
        if reason is None:
            return
        names = meta_tensor_names(modules)
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise SpreadError(
                f"{type(self).__name__} cannot take a model on the meta device ({shown}): {reason}. "
                "Build it on a real device, or train it with ShardedStrategy(shard='parameters'), "
                "which gives each process its shard of one device's values without the whole model"
            )

    def _on_new_modules(self, modules: list[nn.Module]) -> None:
        """Modules whose variables were just adopted (those registering a parameter, buffer or
        submodule in the scope, or every module of a prepared model): strategies that change how
        some layers run (BatchNorm across thread replicas, ``sync_batchnorm``, sharded parameters)
        take them here. Default: nothing."""
        return

    @abc.abstractmethod
    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """Synchronise and hook newly managed variables."""

    def _check_new_parameters(self, params: list[nn.Parameter]) -> None:
        """Refuse, before anything is exchanged, parameters this strategy cannot train. Default:
        tensor-parallel ones (``DTensor``, from ``parallelize_module``), which only
        MultiWorkerMirroredStrategy trains (:mod:`spread.strategies.tensor_parallel`)."""
        why = "it keeps whole tensors (replicated, placed or staged), not DTensor shards"
        refuse_dtensor_parameters(type(self).__name__, params, why)

    @property
    def managed_parameters(self) -> list[nn.Parameter]:
        return list(self._managed.values())

    # -- computation -------------------------------------------------------------------------------
    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``fn`` once per local replica with that replica's slice of ``args``.

        Contract: ``fn`` computes a per-replica *mean* loss and calls ``loss.backward()``; when
        ``run`` returns, gradients are reduced across all replicas (weighted by sample count, so the
        result equals one device on the global batch). Call ``optimizer.step()`` after ``run``, in
        cross-replica context. Returns fn's result: a :class:`PerReplica` when this process drives
        several replicas, else the value itself.
        """

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine a per-replica value over all replicas (``"sum"`` or ``"mean"``); the same on every
        rank. With ``axis``, also reduce along that axis of each value (mean over all elements).
        The result carries no gradient under every strategy (a value for logs and decisions, as
        tf.distribute's ``reduce``): backpropagate the per-replica loss inside ``run``."""
        op = check_reduce_op(op)
        if axis is not None:
            gathered = self.gather(value, axis=axis).detach()
            return gathered.sum(dim=axis) if op == "sum" else gathered.mean(dim=axis)
        total, count = self._sum_over_replicas(value)
        total = total.detach()
        return total if op == "sum" else total / count

    @abc.abstractmethod
    def _sum_over_replicas(self, value: Any) -> tuple[torch.Tensor, int]:
        """Subclass hook of :meth:`reduce`: the elementwise sum of ``value`` over the replicas this
        strategy combines (the same on every rank), and how many replicas that is."""

    @abc.abstractmethod
    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        """Concatenate per-replica values along ``axis`` in replica order; the same on every rank."""

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas as a tuple."""
        return value.values if isinstance(value, PerReplica) else (value,)

    # -- tf.distribute's names, for translated scripts (spread.strategies.tf_compat) ----------------
    def experimental_distribute_dataset(self, dataset: Any, options: Any = None) -> DistributedDataset:
        """TensorFlow's name: ``dataset`` is a ``DataLoader`` batched by the *global* batch size (its
        ``shuffle`` and ``drop_last`` kept); each batch is split over the replicas."""
        return tf_compat.distribute_global_batches(self, dataset)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[tf_compat.InputContext], Any], options: Any = None
    ) -> Any:
        """TensorFlow's: ``dataset_fn(input_context)`` builds this process's own batches of the
        *per-replica* batch size (shard by ``input_context.input_pipeline_id``); a step takes one
        batch per local replica."""
        return tf_compat.datasets_from_function(self, self._layout, dataset_fn)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """TensorFlow's name for :meth:`local_results`."""
        return self.local_results(value)

    @property
    def cluster_resolver(self) -> tf_compat.ClusterResolver | None:
        """This task's type and index in the cluster (TF's multi-worker scripts pick the chief with
        them); None in a single process, as in TensorFlow."""
        spec = self._cluster_spec()
        return None if spec is None else tf_compat.ClusterResolver.of(spec)

    def _cluster_spec(self) -> ClusterSpec | None:
        """The cluster this strategy's processes form; None in a single process (the default)."""
        return None

    # -- data --------------------------------------------------------------------------------------
    def distribute_dataset(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
        shard_policy: str | ShardPolicy = ShardPolicy.AUTO,
        num_workers: int | None = None,
        prefetch: int = 2,
    ) -> DistributedDataset:
        """Split each global batch of ``dataset`` over the replicas (see :class:`DistributedDataset`).

        Every process must pass the same dataset, batch size, seed and flags. The final batch may be
        smaller (unless ``drop_remainder``); gradients are weighted by each replica's sample count.
        ``prefetch`` batches are prepared ahead on a background thread (0: none);
        ``num_workers`` > 0 loads samples in that many worker processes (torch DataLoader).
        """
        distributed = DistributedDataset(
            dataset,
            global_batch_size,
            self._layout,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
            shard_policy=shard_policy,
            devices=self._local_devices(),
            num_workers=num_workers,
            prefetch=prefetch,
            on_step=self._set_step_info,
            channel=self._data_channel(),
        )
        self._check_data(distributed)
        return distributed

    def _check_data(self, data: DistributedDataset) -> None:
        """Refuse, up front, data this strategy cannot read correctly (never a hang, never a silent
        second reading). Default: a stream that every process would read in full (several processes,
        no :meth:`_data_channel` to dispatch it)."""
        if data.read_in_full_by_every_process:
            raise SpreadError(
                f"{type(self).__name__} cannot hand a stream on between its "
                f"{data.layout.num_processes} data-reading processes, so this "
                f"{type(data.dataset).__name__} (an iterable without shard(num_shards, index)) "
                f"would be read in full by every one of them: give it a shard(num_shards, index) "
                f"method (each process then reads only its own files), pass a map-style dataset "
                f"(each process loads only its slice), or use shard_policy='off' when each process's "
                f"stream already holds only its own samples"
            )

    def _data_channel(self) -> DataChannel | None:
        """How the processes reading data agree on steps and pass a stream on (see
        :class:`~spread.data.distributed.DataChannel`). Default ``None``: one process, or processes
        that read independently."""
        return None

    def _set_step_info(self, info: StepInfo) -> None:
        self._step_info = info

    # -- what the layers above rely on (defaults fit a data-parallel strategy) ----------------------
    @property
    def rank(self) -> int:
        """This process's rank in the job (0 in a single process)."""
        return 0

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes inside accumulate gradients locally; the next one outside exchanges them.
        A no-op where gradients are not exchanged at the end of backward."""
        return nullcontext()

    def run_training_step(self, program: TrainingProgram, batch: Any) -> torch.Tensor:
        """Forward and backward of one global batch; ``[loss*n, n, metric sums..., stop votes]``
        summed over it (the votes: :meth:`TrainingProgram.stop_vote` of every replica's process,
        taken after backward), the same on every rank. The caller steps the optimizer. Strategies
        that own forward and backward (pipelines) override it."""
        stats = self.run(program.replica_train_step, args=(batch,))
        vote = program.stop_vote()
        if isinstance(stats, PerReplica):
            stats = PerReplica([_with_vote(s, vote) for s in stats.values])
        else:
            stats = _with_vote(stats, vote)
        return self.reduce("sum", stats)

    # -- gradients between backward and the optimizer step (Trainer's clipping, loss scaling) ------
    def clip_gradients(
        self, params: Sequence[nn.Parameter], *, max_norm: float | None = None, max_value: float | None = None
    ) -> torch.Tensor:
        """Clip the reduced gradient as one device would: by global norm (``clip_grad_norm_``'s
        coefficient ``min(1, max_norm / (norm + 1e-6))``), then each element to ``[-max_value,
        max_value]`` (``clip_grad_value_``). Returns the L2 norm of the whole model's reduced gradient
        over ``params`` *before* clipping (what one device's ``clip_grad_norm_`` computes on the
        global batch; a 0-dim float32 tensor, the same on every rank, non-finite when some gradient
        is); with neither limit it only measures it. Call after :meth:`run` (or
        :meth:`run_training_step`) returned, before ``optimizer.step()``, on every rank alike:
        collective wherever a strategy overrides it.

        Default: this process's ``.grad`` hold the whole model's reduced gradient (data parallelism:
        after ``run`` every replica holds the same sum), so its own norm, then scale and clamp them.
        A strategy whose process holds part of the gradient (a pipeline stage, a shard) sums the
        parts' squared norms over the processes that hold the rest.
        """
        return clip_by_norm(params, local_norm(params, self.device), max_norm, max_value)

    def check_precision(self, precision: str) -> None:
        """Raise ``ValueError`` naming the reason where this strategy cannot train in ``precision``
        (``"32"``, ``"bf16"``, ``"fp16"``; see :mod:`spread.train.precision`). Default: every one: the
        gradient is reduced before the optimizer step, so a loss scaler's overflow check (``fp16``)
        sees the same gradient, and skips the same steps, on every replica."""
        return

    def gather_from_every_rank(self, value: torch.Tensor) -> torch.Tensor:
        """One row per rank of the whole job, stacked on dimension 0 (collective); ``value`` itself
        in a single process."""
        return self.gather(value) if self.num_replicas_in_sync > 1 else value

    def local_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model.state_dict()`` as this process holds it, sharing the model's storage, current after
        every step: for bookkeeping done in place on every rank (a weight average such as
        ``spread.callbacks.EMA``), never for saving (:meth:`full_state_dict` is that). Raises
        :class:`~spread.errors.SpreadError` naming why where this process's model does not hold every
        variable's current value (parameter servers: a cache of their variables; ShardedStrategy at
        ``"parameters"``: 1/N of each between steps). Pipeline: every rank's copy, its other stages'
        layers included (out of date there; ``model.state_dict()`` itself refuses)."""
        return model.state_dict()

    def refresh_weights(self) -> None:
        """Make this process's model hold the current value of every variable (before evaluating
        what training produced elsewhere). Default: nothing, the model is current. ParameterServer:
        pull from the servers."""
        return None

    # -- training state: the one seam every save, load, resume and export goes through --------------
    def full_state_dict(self, obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
        """The one-device ``state_dict`` of a managed model or its optimizer: gathered from shards,
        pipeline stages or parameter servers where the strategy splits it, loadable into the same
        model or optimizer on one device. Collective wherever the state is split (ShardedStrategy,
        PipelineStrategy): call it on every rank. Tensors may share the model's storage; copy them
        to keep them past the next step."""
        return self._state_layout().full_state_dict(obj)

    def load_full_state_dict(self, obj: nn.Module | torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        """Load a one-device ``state_dict`` (what :meth:`full_state_dict` returns) into a managed model
        or its optimizer; each rank keeps its part. Collective where :meth:`full_state_dict` is."""
        self._state_layout().load_full_state_dict(obj, state)

    def save_checkpoint(
        self, path: str | Path, state: Mapping[str, Any], *, step: int, keep: int = 3, blocking: bool = True
    ) -> Path | str:
        """Write ``state`` as checkpoint ``step`` under the directory ``path``; keep the newest ``keep``.

        ``state`` maps names to models, optimizers, objects with ``state_dict``/``load_state_dict``
        (the Trainer, a distributed dataset) and plain values, e.g. ``{"model": model, "optimizer":
        opt, "data": dataset, "step": step}``. The strategy decides the layout (whole on the chief,
        pieces per rank, gathered stages, servers' shards); the write is atomic and checksummed
        (:mod:`spread.strategies.checkpointing`). ``path`` may be an fsspec URL (``s3://bucket/run``:
        :mod:`spread.checkpoint.remote`). Collective: every rank calls it with the same keys;
        it returns on every rank once the checkpoint is durable, and raises on every rank if not.

        ``blocking=False``: the state is copied off the training state here (the step boundary:
        gathered where the layout gathers, tensors cloned to host memory) and written on a
        background thread, with the same atomic commit; the call returns the checkpoint's path at
        once. At most one write is in flight: the next save, or :meth:`wait_for_checkpoint`, waits
        for it and raises its failure on every rank. A crash during the background write leaves
        the previous checkpoint as ``latest``.
        """
        return checkpointing.save(self, path, state, step=step, keep=keep, blocking=blocking)

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint written in the background (``save_checkpoint(...,
        blocking=False)``) is committed; raise on every rank if it failed on one. Collective when a
        background save was made since the last wait (every rank calls it; a no-op otherwise)."""
        self._async_checkpoints.confirm(self)

    def finish_checkpoint_writes(self) -> None:
        """Wait for a checkpoint written in the background, on this rank only (no collective: for
        leaving ``fit`` by an exception, when peers may be gone); its failure is warned about rather
        than raised over the exception in flight."""
        self._async_checkpoints.finish()

    @property
    def _async_checkpoints(self) -> checkpointing.AsyncCheckpoints:
        found = self.__dict__.get("_async_checkpoint_writes")
        if found is None:
            found = self.__dict__["_async_checkpoint_writes"] = checkpointing.AsyncCheckpoints()
        return found

    def load_checkpoint(
        self, path: str | Path, state: MutableMapping[str, Any], *, step: int | None = None
    ) -> Restored | None:
        """Restore ``state`` in place from the newest valid checkpoint under ``path`` (or that of
        ``step``); plain values are put back into ``state``. Returns what was restored, or None when
        there is no checkpoint. A corrupt checkpoint is skipped with a warning for an older one; one
        that does not fit (other shapes, another kind of strategy, a replica count this strategy
        cannot resume at) raises :class:`~spread.errors.CheckpointMismatchError` listing every
        difference before anything is overwritten. Every rank calls it. A checkpoint still being
        written in the background is committed first (:meth:`wait_for_checkpoint`)."""
        self.wait_for_checkpoint()
        return checkpointing.load(self, path, state, step=step)

    def delete_checkpoints(self, path: str | Path) -> None:
        """Remove the checkpoint directory ``path`` once no rank can still need it (on the chief,
        when training finished). Default: at once; parameter servers first wait for the workers
        that train on after the chief."""
        if is_url(path):
            remove_all(str(path))
        else:
            shutil.rmtree(path, ignore_errors=True)

    @property
    def exchange_seconds(self) -> float | None:
        """Seconds this process's training loop has spent waiting in exchanges with other processes
        (gradient reductions, parameter gathers, the step's statistics): what is not computing.
        Straggler detection subtracts it from each step's time and compares the ranks. None where
        ranks are not alike to compare (one process, pipeline stages, parameter-server tasks)."""
        return None

    @property
    def steps_together(self) -> bool:
        """Whether every rank takes each training step together (a collective per step), so the
        ranks can agree at a step boundary to stop or back up (a preemption notice). False for
        parameter servers, whose tasks step on their own."""
        return True

    # -- recovery without restart (spread run --recover) --------------------------------------------
    def check_recoverable(self) -> None:
        """Raise :class:`~spread.errors.SpreadError` naming why this strategy's survivors cannot go on
        after a lost rank (:meth:`regroup`). Default: they cannot; MultiWorkerMirroredStrategy can."""
        raise SpreadError(
            f"{type(self).__name__} cannot recover without restart (spread run --recover, SPREAD_RECOVER=1): "
            f"only MultiWorkerMirroredStrategy regroups its surviving ranks so far. Run without --recover "
            f"(--max-restarts with BackupAndRestore restarts every rank from the last backup)"
        )

    def regroup(self) -> None:
        """After a lost peer: form a new group of the surviving ranks at the smaller world size (the
        data layout and the gradient exchange follow it). Collective over the survivors."""
        self.check_recoverable()

    def joiners_waiting(self) -> bool:
        """Whether processes wait to join the running job at the next step boundary (a machine that
        came back under ``spread run --recover``); checked once per step by the chief. Default: never."""
        return False

    @property
    def recovery_progress(self) -> tuple[int, int]:
        """``(optimizer steps applied, of those with buffers averaged)`` by this process: after a
        regroup the survivors take the state of the one that got furthest."""
        return (0, 0)

    def broadcast_training_state(self, src: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Make the model's and ``optimizer``'s state those of rank ``src`` on every rank."""
        self.check_recoverable()

    def broadcast_object(self, value: Any, src: int) -> Any:
        """``value`` of rank ``src`` on every rank (dicts, lists, tuples, scalars, strings, tensors;
        never pickled)."""
        self.check_recoverable()
        return value

    def _state_layout(self) -> StateLayout:
        """How this strategy lays out models and optimizers in a checkpoint (the one-device layout
        by default); strategies that split state return their own."""
        return StateLayout(self)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make an optimizer over managed parameters fit this strategy; returns the same object.
        ``Trainer`` calls it. Default: nothing to do. A strategy whose optimizer must step something
        else than the model's parameters (its shards of them) rewires the parameter groups here."""
        return optimizer

    # -- memory ------------------------------------------------------------------------------------
    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Bytes of model state this process holds now: managed parameters, their gradients and the
        gradient exchange's buffers, and ``optimizer``'s state (each storage counted once); with
        ``activation_bytes`` from the last :meth:`measure_activations` window."""
        return model_state_report(self, optimizer)

    @contextmanager
    def measure_activations(self) -> Iterator[ActivationMeter]:
        """Measure the activation bytes of the steps run inside: the most bytes one replica had saved
        for backward at once (:class:`~spread.memory.ActivationMeter`; parameters and managed
        buffers left out). On leaving, :meth:`memory_report` reports it as ``activation_bytes``
        until the next measurement. Opt-in because it costs a small object per saved tensor; outside
        it steps run untouched. Wrap the ``strategy.run`` calls (or ``Trainer.fit``) to measure::

            with strategy.measure_activations() as meter:
                strategy.run(train_step, args=(batch,))
            strategy.memory_report(optimizer).activation_bytes   # meter.peak_by_group: per replica

        Replica threads (MirroredStrategy) carry the hooks, each replica counted apart; a process
        driving ``k`` replicas holds ``k`` such figures at once.
        """
        if get_replica_context() is not None:
            raise SpreadError(
                "measure_activations() was entered inside strategy.run; enter it around strategy.run, "
                "so that every replica's thread carries it"
            )
        if self._measuring_activations:
            raise SpreadError("measure_activations() is already active on this strategy; nest none")
        meter = ActivationMeter(exclude=self._managed_buffers.values(), group=_replica_id)
        self._measuring_activations = True
        try:
            with meter:
                yield meter
        finally:
            self._measuring_activations = False
        self._activation_bytes = meter.peak_bytes

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Release hooks, threads and process groups this strategy created. Idempotent.

        A script that never calls it still gets its process groups and threads released, newest
        first, at interpreter exit (see :mod:`spread.strategies.teardown`); hooks stay until then.
        """
        self._closed = True
        self._resources.release()

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, device={self.device})"
        )


def model_state_report(
    strategy: Strategy, optimizer: torch.optim.Optimizer | None, exchange_buffers: Sequence[torch.Tensor] = ()
) -> MemoryReport:
    """:meth:`Strategy.memory_report` of a strategy whose gradient exchange keeps ``exchange_buffers``
    between steps (MultiWorkerMirrored: its buckets)."""
    seen: set[int] = set()
    params = strategy.managed_parameters
    return MemoryReport(
        parameter_bytes=storage_bytes(params, seen),
        gradient_bytes=storage_bytes([*(p.grad for p in params), *exchange_buffers], seen),
        optimizer_state_bytes=storage_bytes(optimizer_state_tensors(optimizer), seen),
        activation_bytes=strategy._activation_bytes,
    )


def _adopt(strategy: Strategy, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
    """Manage the variables ``strategy`` does not manage yet, then let it sync and hook them."""
    new_params = [p for p in _unique(params) if id(p) not in strategy._managed]
    new_buffers = [b for b in _unique(buffers) if id(b) not in strategy._managed_buffers]
    if not new_params and not new_buffers:
        return
    strategy._check_new_parameters(new_params)
    for p in new_params:
        strategy._managed[id(p)] = p
    for b in new_buffers:
        strategy._managed_buffers[id(b)] = b
    strategy._on_new_variables(new_params, new_buffers)


def run_as_replica(
    strategy: Strategy,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict | None,
    replica: int,
    weight: float = 1.0,
) -> Any:
    """``fn`` once in replica context as replica ``replica`` of this step (``weight``: its share of the
    global batch), on the strategy's first local device; the step's batch sizes are forgotten
    afterwards. Nesting is refused. (Strategies driving one replica per process implement ``run``
    with it.)"""
    if get_replica_context() is not None:
        raise SpreadError("strategy.run was called inside strategy.run; call it from the training loop")
    device = strategy._local_devices()[0]
    args, kwargs = on_device(args, device), on_device(kwargs or {}, device)
    _set_replica_context(ReplicaContext(strategy, replica, strategy.num_replicas_in_sync, weight))
    try:
        return fn(*args, **kwargs)
    finally:
        _set_replica_context(None)
        strategy._step_info = None


def replica_weights(strategy: Strategy) -> list[float]:
    """Each of this process's replicas' share of the current global batch (1/replicas when the step's
    sizes are unknown): the weight of its mean loss's gradient in the exchange."""
    info = strategy._step_info
    n = strategy._layout.num_local_replicas
    if info is None or info.global_size <= 0:
        return [1.0 / strategy.num_replicas_in_sync] * n
    return [size / info.global_size for size in info.local_sizes]


@contextmanager
def _hook(register: Callable[[Callable], Any], fn: Callable) -> Iterator[None]:
    handle = register(fn)
    try:
        yield
    finally:
        handle.remove()


def _with_vote(stats: torch.Tensor, vote: float) -> torch.Tensor:
    return torch.cat([stats, stats.new_tensor([vote])])


def meta_tensor_names(modules: Sequence[nn.Module]) -> list[str]:
    """``Class.name`` of each parameter and buffer on the meta device held by ``modules``."""
    names: dict[int, str] = {}
    for module in modules:
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            if t is not None and t.is_meta:
                names.setdefault(id(t), f"{type(module).__name__}.{name}")
    return list(names.values())


def _unique(tensors: list) -> list:
    seen: dict[int, Any] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def _replica_id() -> int | None:
    """The replica computing on this thread (None outside ``strategy.run``): whom a saved tensor is
    counted for by :meth:`Strategy.measure_activations`."""
    context = get_replica_context()
    return None if context is None else context.replica_id_in_sync_group
