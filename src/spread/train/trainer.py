"""Keras-style training on any strategy: ``fit``, ``evaluate``, ``predict`` with callbacks.

The trainer is a thin loop over the strategy's contract: the dataset is distributed by the strategy,
each step runs forward and backward on every replica (``strategy.run``), gradients arrive reduced,
the optimizer steps once in cross-replica context. Loss and metrics are summed over replicas once
per step (one small all-reduce), so every rank sees the same logs and callbacks agree.

Between the reduced gradient and the optimizer step come the everyday extras, each through the
strategy's contract so that it means what it means on one device: the fp16 loss scaler's unscale
(:mod:`spread.train.precision`), clipping by the whole model's global norm
(``Strategy.clip_gradients``), then the step and the learning-rate schedule
(:mod:`spread.train.lr_schedule`).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from spread.checkpoint.compat import field_mismatches, raise_if
from spread.comm.flight import RECORDER
from spread.data import DistributedDataset, ReplicaLayout
from spread.data.batches import Batch, as_batch
from spread.errors import NonFiniteLossError, SpreadError
from spread.memory.accumulation import check_accumulation_steps, micro_batches
from spread.ps import ClusterCoordinator
from spread.strategies import Strategy, make_strategy
from spread.train import rng
from spread.train.callbacks import Callback, CallbackList, History, ProgressBar
from spread.train.coordinated import check_coordinated, fit_coordinated
from spread.train.fit_inputs import split_for_validation, with_sample_weight
from spread.train.lr_schedule import LRSchedule, SchedulerArg
from spread.train.metrics import MetricFn, RunningSums, resolve_metrics
from spread.train.out_of_memory import explained_out_of_memory
from spread.train.outputs import loss_of, prediction_of
from spread.train.precision import Precision, check_precision
from spread.train.recovery import JOIN_VOTE, PEER_FAILURES, recover, recovery_requested, share_state
from spread.train.stragglers import StragglerWatch
from spread.train.timeline import merge_traces, rank_traces
from spread.train.tracing import StepTracer, TraceWindow
from spread.train.weighting import class_weight_table, class_weights_of, per_sample_loss, weighted_mean

NONFINITE_POLICIES = ("raise", "skip_step")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_global_batch_size(global_batch_size: int | None, batch_size: int | None) -> int:
    """``fit``'s global batch: ``global_batch_size``, or Keras' ``batch_size`` (global under
    tf.distribute too), default 32."""
    if global_batch_size is not None and batch_size is not None and global_batch_size != batch_size:
        raise ValueError(
            f"fit got global_batch_size={global_batch_size} and batch_size={batch_size}: they name the same "
            f"thing (the global batch, as Keras' batch_size under tf.distribute); pass one"
        )
    chosen = global_batch_size if global_batch_size is not None else batch_size
    return 32 if chosen is None else chosen


def _check_clip(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be None or a positive finite number, got {name}={value!r}")
    return float(value)


class Trainer:
    """Train ``model`` with ``optimizer`` on ``loss_fn`` under ``strategy``.

    Args:
        model: the network; built inside ``strategy.scope()`` or not (then it is moved and synced).
        optimizer: a torch optimizer over the model's parameters.
        loss_fn: ``(y_pred, y_true) -> scalar mean loss`` over the replica's batch; ``None``: the
            model computes it (a Hugging Face model given ``labels``: its output's ``loss``). Batches
            are ``(inputs, targets)`` pairs, or dicts of the model's keyword arguments
            (``model(**batch)``; ``batch["labels"]`` are the targets of metrics).
        strategy: a Strategy, a registered name ("mirrored", ...) or None for one device.
        metrics: names ("accuracy", "mse", "mae") or per-sample functions ``(y_pred, y_true) -> [n]``.
        callbacks: added to every ``fit`` call (History and ProgressBar are added for you); their
            ``evaluation_weights()`` (``spread.callbacks.EMA``) also apply to ``evaluate`` and ``predict``.
        on_nonfinite: ``"raise"`` stops with NonFiniteLossError before the weights change;
            ``"skip_step"`` drops that step's update and goes on.
        accumulation_steps: run each replica's slice of the global batch as this many micro-batches
            (forward and backward each), then step once: the update of the whole global batch with
            about 1/k of the activation memory; gradients are exchanged once per step.
        lr_scheduler: a ``torch.optim.lr_scheduler`` scheduler of ``optimizer``, or a callable
            building one from it; stepped once per optimizer step or per epoch (see
            :mod:`spread.train.lr_schedule`); the logs then hold ``lr``.
        scheduler_interval: ``"epoch"`` (default) or ``"step"``.
        scheduler_monitor: the log a metric-driven scheduler (``ReduceLROnPlateau``) steps with;
            default ``"val_loss"`` with validation data (per epoch), else ``"loss"``.
        clip_grad_norm: clip the gradient to this global L2 norm, computed over the whole model's
            reduced gradient (across replicas, stages and shards: equal to one device's
            ``torch.nn.utils.clip_grad_norm_``); the norm before clipping is logged as ``grad_norm``.
        clip_grad_value: clip each gradient element to ``[-v, v]`` (after ``clip_grad_norm``).
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (autocast; fp16 with a loss scaler; see
            :mod:`spread.train.precision`).
        profile: trace a window of each ``fit``'s steps with ``torch.profiler`` into a directory
            (``rank-<r>.json`` per rank, merged by the chief into ``timeline.json``): a directory
            (steps 2-4), or a :class:`~spread.train.tracing.TraceWindow`. Default: the directory
            ``spread run --trace`` gives, else none (see :mod:`spread.train.tracing`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None,
        *,
        strategy: Strategy | str | None = None,
        metrics: Sequence[str | MetricFn] | None = None,
        callbacks: Sequence[Callback] | None = None,
        on_nonfinite: str = "raise",
        accumulation_steps: int = 1,
        lr_scheduler: SchedulerArg | None = None,
        scheduler_interval: str = "epoch",
        scheduler_monitor: str | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        precision: str = "32",
        coordinator: ClusterCoordinator | None = None,
        profile: str | os.PathLike[str] | TraceWindow | None = None,
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, got {on_nonfinite!r}")
        self.strategy = make_strategy(strategy)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.metrics = resolve_metrics(metrics)
        self.callbacks = list(callbacks or [])
        self.on_nonfinite = on_nonfinite
        self.accumulation_steps = check_accumulation_steps(accumulation_steps)
        if self.accumulation_steps > 1 and self.strategy.sync_batchnorm:
            raise ValueError(
                "accumulation_steps > 1 does not combine with sync_batchnorm=True: statistics would be "
                "exchanged per micro-batch, and replicas with fewer samples run fewer micro-batches"
            )
        self.coordinator = coordinator
        if coordinator is not None:
            check_coordinated(self)
        self.clip_grad_norm = _check_clip("clip_grad_norm", clip_grad_norm)
        self.clip_grad_value = _check_clip("clip_grad_value", clip_grad_value)
        precision = check_precision(precision)
        self.strategy.check_precision(precision)
        self.precision = Precision(precision, self.strategy.device)
        self.lr_schedule = (
            LRSchedule(lr_scheduler, optimizer, scheduler_interval, scheduler_monitor)
            if lr_scheduler is not None
            else None
        )
        if lr_scheduler is None and (scheduler_interval != "epoch" or scheduler_monitor is not None):
            raise ValueError("scheduler_interval and scheduler_monitor need an lr_scheduler")
        self.stop_training = False
        self.stop_voted = False  # whether some rank's callback asked to stop after the last step
        self.join_voted = False  # whether machines wait to join (spread run --recover), after the last step
        self._recovering = False  # this fit recovers without restart (spread run --recover)
        # Under --recover: the loop's state after the last two counts of optimizer steps (recovery).
        self._loop_states: dict[int, dict[str, Any]] = {}
        self.params: dict[str, Any] = {}
        self.epoch = 0
        self.global_step = 0
        self.skipped_steps = 0
        self.scaler_skipped_steps = 0  # fp16 steps the loss scaler skipped (overflow; not failures)
        self.grad_norm_sums = torch.zeros(2, dtype=torch.float64)  # this epoch's [sum of norms, steps]
        self.data_wait_fraction = 0.0  # share of the last epoch this rank spent waiting for batches
        self.running_sums: RunningSums | None = None  # the current epoch's loss and metric sums
        self.train_dataset: DistributedDataset | None = None  # the running fit's training data
        self._resume: dict[str, Any] | None = None  # where a restored fit continues (load_state_dict)
        self._data_config: dict[str, Any] = {}  # the running fit's data order (seed, shuffle)
        self._starting = False  # inside the callbacks' on_train_begin
        self._pending_callback_states: dict[str, Any] | None = None  # restored, not yet given back
        self._class_weights: torch.Tensor | None = None  # the running fit's class_weight table
        self._step_packed: torch.Tensor | None = None  # the last step's summed statistics
        self.stragglers: StragglerWatch | None = None  # the running (or last) fit's straggler watch
        self._trace_window = TraceWindow.of(profile)  # None: no tracing (nor spread run --trace)
        self._tracer: StepTracer | None = None
        self.history = History()
        self.active_callbacks: list[Callback] = []  # the running fit's callbacks on this rank
        self._fit_callbacks: list[Callback] = []  # the running fit's callbacks, on this rank or not
        self.strategy.prepare_model(model)  # nothing to do for a model built in the scope
        self.strategy.prepare_optimizer(optimizer)  # after the model: it may rewire the optimizer

    @property
    def is_chief(self) -> bool:
        return self.strategy.is_chief

    # -- one replica's work ------------------------------------------------------------------------
    def prediction(self, output: Any) -> torch.Tensor:
        """What ``loss_fn`` and metrics get from a model output (see :func:`prediction_of`)."""
        return prediction_of(output)

    def model_loss(self, output: Any) -> torch.Tensor:
        """The loss the model computed (``loss_fn=None``; see :func:`loss_of`)."""
        return loss_of(output)

    def batch_stats(self, y_pred: torch.Tensor, y: Any, loss: torch.Tensor, n: int) -> torch.Tensor:
        """``[loss*n, n, metric sums...]`` of ``n`` samples (float64, summed over replicas later).
        Under mixed precision the loss is widened first, so sums keep their digits."""
        if loss.dtype in (torch.bfloat16, torch.float16):
            loss = loss.float()
        values = [loss.detach() * n if n else loss.new_zeros(()), loss.new_tensor(float(n))]
        for fn in self.metrics.values():
            values.append(fn(y_pred.detach(), y).sum().to(loss.dtype) if n else loss.new_zeros(()))
        return torch.stack([v.reshape(()) for v in values]).to(torch.float64)

    def _forward(self, batch: Batch) -> Any:
        return self.model(**batch.inputs) if batch.as_keywords else self.model(batch.inputs)

    def _forward_loss(
        self, batch: Batch, class_weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prediction, mean loss)`` of a non-empty batch; for an empty one a zero loss that still
        reaches every parameter (a replica with no samples takes part in the gradient exchange).
        Sample weights (the batch's, times ``class_weights`` of its targets) weigh each sample's loss
        as Keras does (:mod:`spread.train.weighting`)."""
        if batch.size == 0 and batch.as_keywords:
            # Hugging Face models cannot run an empty batch: no forward, zero gradients.
            params = [p for p in self.model.parameters() if p.requires_grad]
            zero = torch.stack([p.sum() for p in params]).sum() * 0.0
            return zero.reshape(1), zero
        if batch.size and self.loss_fn is not None and batch.targets is None:
            raise ValueError("Trainer got a batch without 'labels' and a loss_fn: the loss_fn has no targets")
        weights = batch.weights
        if class_weights is not None and batch.size:
            by_class = class_weights_of(class_weights, batch.targets)
            weights = by_class if weights is None else weights.to(by_class.device) * by_class
        if weights is not None and self.loss_fn is None:
            raise ValueError(
                "sample or class weights weigh each sample's loss, but Trainer(loss_fn=None) takes the "
                "model's own mean loss: pass a loss_fn"
            )
        RECORDER.set_phase(f"forward of step {self.global_step + 1}")
        with self.forward_context(), record_function("spread.forward"):
            output = self._forward(batch)
            prediction = prediction_of(output)
            if batch.size == 0:
                return prediction, prediction.sum() * 0.0
            if self.loss_fn is None:
                return prediction, loss_of(output)
            if weights is not None:
                losses = per_sample_loss(self.loss_fn, prediction, batch.targets)
                return prediction, weighted_mean(losses, weights)
            return prediction, self.loss_fn(prediction, batch.targets)

    def forward_context(self) -> AbstractContextManager[Any]:
        """Forward passes and losses run inside (autocast under bf16/fp16; backward never does)."""
        return self.precision.autocast()

    def replica_train_step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one replica's batch (``strategy.run`` calls it on each replica)."""
        b = as_batch(batch, who="Trainer")
        if self.accumulation_steps > 1:
            return self._accumulate_replica_step(b)
        prediction, loss = self._forward_loss(b, self._class_weights)
        RECORDER.set_phase(f"backward of step {self.global_step + 1}")
        with record_function("spread.backward"):
            self.precision.scale(loss).backward()
        return self.batch_stats(prediction, b.targets, loss, b.size)

    def _accumulate_replica_step(self, batch: Batch) -> torch.Tensor:
        """Micro-batches of this replica's slice; each mean loss weighted by its share of the slice
        (see spread.memory.accumulation); only the last backward exchanges gradients."""
        stats = None
        for micro in micro_batches(batch.as_data(), self.accumulation_steps, strategy=self.strategy):
            part_batch = as_batch(micro.data, who="Trainer")
            prediction, loss = self._forward_loss(part_batch, self._class_weights)
            micro.backward(self.precision.scale(loss))
            part = self.batch_stats(prediction, part_batch.targets, loss, part_batch.size)
            stats = part if stats is None else stats + part
        if stats is None:
            raise RuntimeError("micro_batches yielded no micro-batch")
        return stats

    def stop_vote(self) -> float:
        """This process's vote to stop every rank after this step: a callback's ``asks_to_stop``;
        plus ``JOIN_VOTE`` when machines wait to join the job (``--recover``: only the chief reads
        that, from the store), so every rank learns both from the step's one sum."""
        stop = 1.0 if any(cb.asks_to_stop() for cb in self.active_callbacks) else 0.0
        joining = self._recovering and self.strategy.is_chief and self.strategy.joiners_waiting()
        return stop + (JOIN_VOTE if joining else 0.0)

    def _eval_replica_step(self, batch: Any) -> torch.Tensor:
        b = as_batch(batch, who="Trainer")
        with torch.no_grad():
            prediction, loss = self._forward_loss(b)
            return self.batch_stats(prediction, b.targets, loss, b.size)

    # -- public API --------------------------------------------------------------------------------
    def fit(
        self,
        train_data: Any,
        *,
        epochs: int = 1,
        global_batch_size: int | None = None,
        batch_size: int | None = None,
        validation_data: Any = None,
        validation_split: float | None = None,
        validation_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
        steps_per_epoch: int | None = None,
        initial_epoch: int = 0,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        callbacks: Sequence[Callback] | None = None,
        verbose: int = 1,
    ) -> History:
        """Train for ``epochs`` epochs over ``train_data`` split into global batches.

        Every rank must call ``fit`` with the same arguments. Returns the History callback, whose
        ``history`` maps each log name to its per-epoch values (identical on every rank).

        Keras' arguments mean what they mean there: ``batch_size`` is the global batch (as under
        tf.distribute; default 32), ``validation_split`` holds out the last fraction of tensor data
        before shuffling, ``class_weight`` (``{class index: weight}``, training only) and
        ``sample_weight`` (one per sample of tensor data; a dataset yields ``(x, y, sample_weight)``
        instead) weigh each sample's loss, which needs a ``loss_fn`` that can give one
        (:mod:`spread.train.weighting`). ``steps_per_epoch`` beyond the data ends each epoch when
        the data runs out, with a warning, as Keras does.
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        if not 0 <= initial_epoch < epochs:
            raise ValueError(f"initial_epoch must be in [0, epochs), got {initial_epoch!r}")
        global_batch_size = resolve_global_batch_size(global_batch_size, batch_size)
        if sample_weight is not None:
            train_data = with_sample_weight(train_data, sample_weight)
        if validation_split is not None:
            if validation_data is not None:
                raise ValueError("fit got both validation_data and validation_split: pass one of them")
            train_data, validation_data = split_for_validation(train_data, validation_split)
        self._class_weights = class_weight_table(class_weight)
        if (self._class_weights is not None or sample_weight is not None) and self.loss_fn is None:
            raise ValueError(
                "class_weight and sample_weight weigh each sample's loss, but Trainer(loss_fn=None) takes "
                "the model's own mean loss: pass a loss_fn"
            )
        self._data_config = {"seed": seed, "shuffle": shuffle}
        if self.coordinator is not None:
            return self._fit_coordinated(
                train_data,
                epochs=epochs,
                global_batch_size=global_batch_size,
                steps_per_epoch=steps_per_epoch,
                seed=seed,
                shuffle=shuffle,
                validation_data=validation_data,
                validation_batch_size=validation_batch_size or global_batch_size,
                callbacks=callbacks,
                verbose=verbose,
            )

        def distribute() -> DistributedDataset:
            return self.strategy.distribute_dataset(
                train_data, global_batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder
            )

        recovering = self._recovering = recovery_requested()
        if recovering or self.strategy.awaiting_state:
            self.strategy.check_recoverable()
        train = distribute()
        steps = len(train) if hasattr(train.dataset, "__len__") else None
        if steps_per_epoch is not None:
            if steps is not None and steps_per_epoch > steps:
                warnings.warn(
                    f"steps_per_epoch={steps_per_epoch} is more than the {steps} batches of the data: each "
                    f"epoch ends after {steps} steps, when the data runs out (as in Keras). Repeat the data "
                    f"yourself for longer epochs; a schedule sized for {steps_per_epoch} steps per epoch "
                    f"will not reach its end",
                    stacklevel=2,
                )
            steps = min(steps, steps_per_epoch) if steps is not None else steps_per_epoch
        cbs = self._start_fit(epochs, steps, global_batch_size, verbose, callbacks, progress=bool(verbose))
        self.train_dataset = train
        self._resume = None
        tracer = self._tracer = self._new_tracer()
        try:
            history = self._fit_epochs(
                cbs,
                train,
                epochs=epochs,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                validation_data=validation_data,
                validation_batch_size=validation_batch_size or global_batch_size,
                redistribute=distribute if recovering else None,
            )
            if tracer is not None:
                self._finish_trace(tracer)
            return history
        except KeyboardInterrupt as interrupt:
            raise self._where_interrupted(interrupt) from None
        finally:
            if tracer is not None:
                tracer.stop()
            self._tracer = None
            self._recovering = False
            cbs.call("on_fit_exit")
            self.active_callbacks = []
            self._class_weights = None

    def _fit_coordinated(
        self,
        train_data: Any,
        *,
        epochs: int,
        global_batch_size: int,
        steps_per_epoch: int | None,
        seed: int,
        shuffle: bool,
        validation_data: Any,
        validation_batch_size: int,
        callbacks: Sequence[Callback] | None,
        verbose: int,
    ) -> History:
        """``fit`` with a coordinator (:mod:`spread.train.coordinated`): the chief drives, workers serve."""
        assert self.coordinator is not None
        progress = bool(verbose) and self.strategy.is_chief  # workers serve steps; they print nothing
        cbs = self._start_fit(
            epochs, steps_per_epoch, global_batch_size, verbose, callbacks, progress=progress
        )
        try:
            return fit_coordinated(
                self,
                self.coordinator,
                train_data,
                cbs=cbs,
                epochs=epochs,
                global_batch_size=global_batch_size,
                steps_per_epoch=steps_per_epoch,
                seed=seed,
                shuffle=shuffle,
                validation_data=validation_data,
                validation_batch_size=validation_batch_size,
            )
        finally:
            cbs.call("on_fit_exit")
            self.active_callbacks = []
            self._class_weights = None

    def _start_fit(
        self,
        epochs: int,
        steps: int | None,
        global_batch_size: int,
        verbose: int,
        callbacks: Sequence[Callback] | None,
        *,
        progress: bool,
    ) -> CallbackList:
        """What every ``fit`` sets up first: ``params``, this fit's callbacks (History, a progress
        bar when ``progress``, the trainer's, the call's), a cleared stop flag."""
        self.params = {
            "epochs": epochs,
            "steps": steps,
            "global_batch_size": global_batch_size,
            "verbose": verbose,
        }
        defaults: list[Callback] = [self.history]
        if progress:
            defaults.append(ProgressBar(verbose=verbose))
        self._fit_callbacks = [*defaults, *self.callbacks, *(callbacks or [])]
        cbs = CallbackList(self._fit_callbacks, self)
        self.active_callbacks = list(cbs)
        self.stop_training = False
        return cbs

    def train_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """One optimizer step on ``batch`` as ``fit`` takes it (what a coordinated fit's workers run)."""
        return self._train_step(batch)

    def lr_logs(self) -> dict[str, float]:
        """The learning rate for the logs, when a schedule or a callback sets it."""
        return self._lr_logs()

    def evaluate_during_fit(self, data: Any, global_batch_size: int) -> dict[str, float]:
        """Validation inside ``fit`` (no test callbacks): :meth:`evaluate`'s numbers."""
        return self._evaluate(data, global_batch_size, None)

    def _fit_epochs(
        self,
        cbs: CallbackList,
        train: DistributedDataset,
        *,
        epochs: int,
        initial_epoch: int,
        steps_per_epoch: int | None,
        validation_data: Any,
        validation_batch_size: int,
        redistribute: Callable[[], DistributedDataset] | None = None,
    ) -> History:
        """``fit``'s loop over epochs and steps (``fit`` prepares and cleans up around it). With
        ``redistribute`` (recovery without restart), a lost peer regroups the survivors, which
        continue with the training data ``redistribute()`` splits over the new group."""
        self._starting = True  # BackupAndRestore restores in its on_train_begin
        try:
            cbs.call("on_train_begin", {})
        finally:
            self._starting = False
        # Callbacks get their restored state after every on_train_begin (which starts them afresh).
        pending, self._pending_callback_states = self._pending_callback_states, None
        if pending:
            self._load_callback_states(pending)
        resume, self._resume = self._resume, None
        if self.strategy.awaiting_state:  # joined a running job: its state comes from a live peer
            resume = self._recover(None, None)  # then the loop continues at its position
        logs: dict[str, float] = {}
        comparable = self.strategy.exchange_seconds is not None  # ranks doing alike work, several processes
        watch = self.stragglers = StragglerWatch(self.strategy, self._report) if comparable else None
        recovering = redistribute is not None
        epoch = resume["epoch"] if resume else initial_epoch
        regrouped = False  # re-entering an epoch after a lost peer (recovery without restart)
        epoch_started = time.perf_counter()
        while epoch < epochs:
            self.epoch = epoch
            self.model.train()
            if not regrouped:
                cbs.call("on_epoch_begin", epoch, {})
                train.wait_clock.reset()
                epoch_started = time.perf_counter()
            train.set_epoch(epoch)
            sums = self.running_sums = RunningSums(list(self.metrics))
            first_step = 0
            if resume and epoch == resume["epoch"]:  # continue exactly after the last saved batch
                first_step = resume["batch"]
                train.load_state_dict({"epoch": epoch, "batch": first_step})
                sums.totals = resume["sums"].clone()
            has_validation = validation_data is not None
            if first_step == 0 and not regrouped:  # a resumed epoch keeps the norms of its steps before
                self.grad_norm_sums.zero_()
            regrouped = False
            waited = train.wait_clock.seconds
            position = {"epoch": epoch, "batch": first_step, "sums": sums.totals.clone()}
            lost: BaseException | None = None
            admitting = False  # machines wait to join: every rank regroups at this step boundary
            batches = iter(train)
            for step, batch in enumerate(batches, start=first_step):
                if steps_per_epoch is not None and step >= steps_per_epoch:
                    break
                cbs.call("on_train_batch_begin", step, {})
                started = time.perf_counter()
                applied, steps_before = self.strategy.recovery_progress[0], self.global_step
                if recovering:  # what a survivor goes back to: this step repeated, or the one before
                    self._keep_loop_state(applied, position)
                try:
                    with record_function("spread.step"):
                        packed, step_logs = self._train_step(batch)
                except PEER_FAILURES as exc:
                    if not recovering:
                        raise
                    lost = exc
                    if self.strategy.recovery_progress[0] == applied:  # the step did not take: repeat it
                        self.grad_norm_sums = self._loop_states[applied]["grad_norm_sums"].clone()
                        break
                    # The weights took this step before the failure (in the buffers' averaging): keep it.
                    assert self._step_packed is not None
                    packed, step_logs = self._step_packed, {}
                    self.global_step = steps_before + 1
                if self._tracer is not None:
                    self._tracer.step()
                RECORDER.set_phase(f"callbacks or data loading after step {self.global_step}")
                if watch is not None and lost is None:  # collective every few steps: every rank steps alike
                    now_waited = train.wait_clock.seconds
                    try:
                        watch.after_step(time.perf_counter() - started, now_waited - waited)
                    except PEER_FAILURES as exc:
                        if not recovering:
                            raise
                        lost = exc
                    waited = now_waited
                sums.add(packed)
                batch_logs = {**sums.results(), **step_logs, **self._lr_logs()}
                batch_logs["size"] = int(packed[1].item())
                if self.lr_schedule is not None and step_logs.get("stepped", True):
                    self.lr_schedule.after_optimizer_step(batch_logs, has_validation)
                batch_logs.pop("stepped", None)
                position = {"epoch": epoch, "batch": step + 1, "sums": sums.totals.clone()}
                if lost is not None:
                    break
                try:
                    cbs.call("on_train_batch_end", step, batch_logs)
                except PEER_FAILURES as exc:
                    if not recovering:
                        raise
                    lost = exc
                    break
                if recovering and self.join_voted and not self.stop_training:
                    admitting = True
                    break
            if lost is None and not admitting:
                self.data_wait_fraction = train.wait_clock.seconds / max(
                    time.perf_counter() - epoch_started, 1e-9
                )
                logs = {**sums.results(), **self._epoch_norm_logs(), **self._lr_logs()}
                try:  # the epoch's own collectives, before any callback sees its end: recoverable too
                    if watch is not None:
                        logs.update(watch.epoch_figures())
                    if has_validation:
                        RECORDER.set_phase(f"validation after epoch {epoch + 1}")
                        val_logs = self._evaluate(validation_data, validation_batch_size, None)
                        logs.update({f"val_{k}": v for k, v in val_logs.items()})
                except PEER_FAILURES as exc:
                    if not recovering:
                        raise
                    lost = exc  # the epoch ends again, at the new world size
                if lost is None:
                    if self.lr_schedule is not None:
                        self.lr_schedule.after_epoch(logs, has_validation)
                    try:
                        cbs.call("on_epoch_end", epoch, logs)
                    except PEER_FAILURES as exc:  # a save at the epoch's end, say
                        if not recovering:
                            raise
                        # The epoch ended on this rank: the job goes on at the next one; the callbacks
                        # after the one that failed miss this end (as a step's on_train_batch_end).
                        lost = exc
                        position = {"epoch": epoch + 1, "batch": 0, "sums": torch.zeros_like(sums.totals)}
                    else:
                        if self.stop_training:
                            break
                        epoch += 1
                        continue
            assert redistribute is not None
            batches.close()  # type: ignore[attr-defined]  # its reading thread stops now
            resume = self._recover(position, lost)
            # Back into an epoch (the step in flight, or its end again), or on at the next one's start.
            regrouped = (resume["epoch"], resume["batch"]) != (epoch + 1, 0)
            epoch = resume["epoch"]
            train = self.train_dataset = redistribute()
            watch = self.stragglers = StragglerWatch(self.strategy, self._report) if comparable else None
        self.strategy.refresh_weights()  # parameter servers: the model leaves fit holding their values
        summary = watch.summary() if watch is not None else None
        if summary is not None:
            self._report(summary)
        cbs.call("on_train_end", logs)
        return self.history

    def _train_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """One global batch: forward and backward, unscale, clip, optimizer step. Returns the summed
        ``[loss*n, n, metrics...]`` (zeros for a dropped step) and the step's own logs (``grad_norm``
        when clipping; ``stepped``: False when on_nonfinite dropped the step)."""
        self.optimizer.zero_grad(set_to_none=True)
        with explained_out_of_memory(self.strategy, self.optimizer):
            voted = self.strategy.run_training_step(self, batch)  # summed [loss*n, n, metrics..., votes]
        votes = float(voted[-1].item())
        packed, self.stop_voted, self.join_voted = voted[:-1], votes % JOIN_VOTE > 0, votes >= JOIN_VOTE
        self._step_packed = packed  # kept for a step whose weights changed before a lost peer
        loss_sum = float(packed[0].item())
        if not math.isfinite(loss_sum):
            return self._drop_step(packed, f"non-finite loss ({loss_sum})")
        self.precision.unscale(self.optimizer)  # fp16: true gradients before clipping and the step
        step_logs: dict[str, Any] = {}
        if self.clip_grad_norm is not None or self.clip_grad_value is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            norm = float(
                self.strategy.clip_gradients(
                    params, max_norm=self.clip_grad_norm, max_value=self.clip_grad_value
                )
            )
            # Under fp16 an overflow is the loss scaler's to skip; otherwise it is a failure.
            if not math.isfinite(norm) and self.precision.scaler is None:
                return self._drop_step(packed, f"non-finite gradient norm ({norm})")
            step_logs["grad_norm"] = norm
            if math.isfinite(norm):
                self.grad_norm_sums += torch.tensor([norm, 1.0], dtype=torch.float64)
        with explained_out_of_memory(self.strategy, self.optimizer):  # the first step allocates its state
            stepped = self.precision.step(self.optimizer)
        if not stepped:
            self.scaler_skipped_steps += 1
        self.global_step += 1
        return packed, step_logs

    def _recover(self, position: dict[str, Any] | None, cause: BaseException | None) -> dict[str, Any]:
        """Regroup after a lost peer (``cause``) or to admit machines waiting to join (``cause`` None);
        every rank takes the loop state of the one furthest ahead. A process that joined a running job
        (``position`` None) only takes it. Returns where the epoch continues (``{"epoch", "batch",
        "sums"}``)."""
        if position is None:
            position = {"epoch": 0, "batch": 0, "sums": RunningSums(list(self.metrics)).totals.clone()}
        self._keep_loop_state(self.strategy.recovery_progress[0], position)
        states, self._loop_states = self._loop_states, {}
        agreed = share_state(self, states) if self.strategy.awaiting_state else recover(self, states, cause)
        self.global_step = int(agreed["global_step"])
        self.grad_norm_sums = agreed["grad_norm_sums"].clone()
        self.skipped_steps = int(agreed["skipped_steps"])
        if self.lr_schedule is not None:
            self.lr_schedule.load_state_dict(agreed["lr_scheduler"])
        if "grad_scaler" in agreed:
            self.precision.load_state_dict(agreed["grad_scaler"])
        return {"epoch": int(agreed["epoch"]), "batch": int(agreed["batch"]), "sums": agreed["sums"]}

    def _keep_loop_state(self, steps_applied: int, position: dict[str, Any]) -> None:
        """Keep the loop's state at ``position`` (its epoch, batch and running sums) as the state after
        ``steps_applied`` optimizer steps, and the one before it: after a lost peer the strategy may
        take the model back one step (ShardedStrategy, when the loss came inside the step boundary),
        and the loop goes back with it."""
        self._loop_states = {k: v for k, v in self._loop_states.items() if k >= steps_applied - 1}
        self._loop_states[steps_applied] = {
            **position,
            "global_step": self.global_step,
            "grad_norm_sums": self.grad_norm_sums.clone(),
            "skipped_steps": self.skipped_steps,
            **self.schedule_state_dict(),
        }

    def _drop_step(self, packed: torch.Tensor, what: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """``on_nonfinite``: raise before the weights change, or drop this step's update."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"{what} at epoch {self.epoch}, step {self.global_step}; "
                f"the weights were not updated (use on_nonfinite='skip_step' to drop such steps)"
            )
        self.skipped_steps += 1
        return packed.new_zeros(packed.shape), {"stepped": False}

    def _new_tracer(self) -> StepTracer | None:
        """This fit's tracer, started, when ``profile`` (or ``spread run --trace``) asks for one."""
        if self._trace_window is None:
            return None
        tracer = StepTracer(self._trace_window, self.strategy.rank, self.strategy.device)
        tracer.start()
        return tracer

    def _finish_trace(self, tracer: StepTracer) -> None:
        """Close the window (a fit shorter than it writes what it has), then the chief merges every
        rank's trace into one timeline once all are written (collective: every rank traced alike)."""
        tracer.stop()
        self.strategy.gather_from_every_rank(torch.zeros(1, 1, device=self.strategy.device))
        if self.is_chief and rank_traces(tracer.window.directory):
            merge_traces(tracer.window.directory)

    def _where_interrupted(self, interrupt: KeyboardInterrupt) -> KeyboardInterrupt:
        """Ctrl-C in ``fit``: a ``KeyboardInterrupt`` saying where training stopped, raised from
        ``fit`` itself (a few lines of traceback, not the ~110 of the step it fell in). One that
        carries a message of its own (a callback's) is kept as it is."""
        if interrupt.args:
            return interrupt
        return KeyboardInterrupt(
            f"fit interrupted in epoch {self.epoch + 1}, after {self.global_step} optimizer step(s)"
        )

    def _report(self, line: str) -> None:
        """A diagnostic line from the chief (a straggler named), on stderr as warnings go."""
        if self.is_chief:
            print(line, file=sys.stderr, flush=True)

    def _lr_logs(self) -> dict[str, float]:
        """``lr`` (the first parameter group's) when a scheduler or a callback sets it."""
        if self.lr_schedule is None and not any(cb.sets_learning_rate for cb in self.active_callbacks):
            return {}
        return {"lr": float(self.optimizer.param_groups[0]["lr"])}

    def _epoch_norm_logs(self) -> dict[str, float]:
        total, count = self.grad_norm_sums.tolist()
        return {"grad_norm": total / count} if count else {}

    # -- training state (the state seam saves the Trainer beside the model and optimizer) -------------
    def state_dict(self) -> dict[str, Any]:
        """The running fit's state beyond the model and optimizer, so that a resumed fit continues
        exactly: the step, the data position and the epoch's running sums, the gradient-norm sums,
        the schedule and loss scaler, every rank's RNG streams, each callback's own state (History's
        logs, EarlyStopping's patience, ...), and what must not change for an exact resume (the
        global batch size, the optimizer's class, the data order's seed). Collective (the RNG streams
        are gathered): every rank calls it, during ``fit``."""
        if self.running_sums is None or self.train_dataset is None:
            raise RuntimeError("Trainer.state_dict() is the state of a running fit: call it during fit")
        position = self.train_dataset.state_dict()
        totals = self.running_sums.totals
        state: dict[str, Any] = {
            "config": self._resume_config(),
            "global_step": self.global_step,
            "epoch": position["epoch"],
            "batch": position["batch"],
            "sums": totals.clone() if position["batch"] else torch.zeros_like(totals),
            "grad_norm_sums": self.grad_norm_sums.clone(),
            "rng": rng.states(self.strategy),
            "callbacks": self._callback_states(),
        }
        state.update(self.schedule_state_dict())
        return state

    def schedule_state_dict(self) -> dict[str, Any]:
        """The learning-rate scheduler's (``lr_scheduler``) and the fp16 loss scaler's
        (``grad_scaler``) state, where the Trainer has them (what ``ModelCheckpoint`` saves beside
        the model and optimizer). Local: no collective."""
        state: dict[str, Any] = {}
        if self.lr_schedule is not None:
            state["lr_scheduler"] = self.lr_schedule.state_dict()
        if self.precision.scaler is not None:
            state["grad_scaler"] = self.precision.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` before a fit's first step (``BackupAndRestore`` does, in its
        ``on_train_begin``): the fit continues after the saved step. Callbacks get their state back
        once every callback's ``on_train_begin`` has run (which starts a callback afresh). Refuses,
        before changing anything, a state saved with another global batch size, optimizer or data
        seed."""
        problems = field_mismatches(state.get("config") or {}, self._resume_config())
        raise_if(problems, "the checkpoint", "Trainer configuration (an exact resume needs them unchanged)")
        self.global_step = int(state["global_step"])
        self._resume = {"epoch": int(state["epoch"]), "batch": int(state["batch"]), "sums": state["sums"]}
        self.grad_norm_sums = state["grad_norm_sums"].clone().to(torch.float64)
        if self.lr_schedule is not None and "lr_scheduler" in state:
            self.lr_schedule.load_state_dict(state["lr_scheduler"])
        if "grad_scaler" in state:
            self.precision.load_state_dict(state["grad_scaler"])
        rng.restore(state["rng"], self.strategy.rank)
        if self._starting:  # given back once every callback's on_train_begin has run
            self._pending_callback_states = dict(state.get("callbacks") or {})
        else:
            self._load_callback_states(state.get("callbacks") or {})

    def resume_at(self, global_step: int) -> None:
        """Continue the next fit after ``global_step`` optimizer steps without a saved Trainer state
        (an asynchronous parameter-server worker, whose step count the servers hold): the data
        position follows from the steps per epoch, the schedule is replayed to it."""
        steps = self.params.get("steps")
        if not steps:
            raise SpreadError(
                f"resuming under {type(self.strategy).__name__} needs a dataset with a length (or "
                "steps_per_epoch) to turn a task's step count back into a data position"
            )
        self.global_step = global_step
        epoch = global_step // steps
        sums = torch.zeros(2 + len(self.metrics), dtype=torch.float64)
        self._resume = {"epoch": epoch, "batch": global_step % steps, "sums": sums}
        if self.lr_schedule is not None:
            self.lr_schedule.replay(global_step, epoch)

    def _resume_config(self) -> dict[str, Any]:
        return {
            "global_batch_size": self.params.get("global_batch_size"),
            "optimizer": type(self.optimizer).__name__,
            **self._data_config,
        }

    def _keyed_callbacks(self) -> dict[str, Callback]:
        """The running fit's callbacks by state key: class name, ``#k`` for the k-th repeat (the
        same keys on every rank, whether a callback runs there or not)."""
        keyed: dict[str, Callback] = {}
        counts: dict[str, int] = {}
        for cb in self._fit_callbacks:
            name = type(cb).__name__
            k = counts.get(name, 0)
            counts[name] = k + 1
            keyed[name if k == 0 else f"{name}#{k}"] = cb
        return keyed

    def _callback_states(self) -> dict[str, Any]:
        """The non-empty ``state_dict()`` of every callback running on this rank (in order: some
        are collective)."""
        running = {id(cb) for cb in self.active_callbacks}
        states = {key: cb.state_dict() for key, cb in self._keyed_callbacks().items() if id(cb) in running}
        return {key: state for key, state in states.items() if state}

    def _load_callback_states(self, saved: Mapping[str, Any]) -> None:
        callbacks = self._keyed_callbacks()
        for key, state in saved.items():
            if key in callbacks:
                callbacks[key].load_state_dict(state)
            else:
                warnings.warn(
                    f"the checkpoint holds the state of a {key} callback that this fit does not have; "
                    "it is ignored",
                    stacklevel=3,
                )

    def _evaluate(self, data: Any, global_batch_size: int, cbs: CallbackList | None) -> dict[str, float]:
        if self.coordinator is None:
            dataset = self.strategy.distribute_dataset(data, global_batch_size, shuffle=False)
        else:  # the chief alone evaluates, on the whole data and the servers' current variables
            self.strategy.refresh_weights()
            dataset = DistributedDataset(data, global_batch_size, ReplicaLayout(1, 0, 1), shuffle=False)
        was_training = self.model.training
        self.model.eval()
        weights = self._evaluation_weights(cbs or [])
        sums = RunningSums(list(self.metrics))
        try:
            for step, batch in enumerate(dataset):
                sums.add(
                    self.strategy.reduce("sum", self.strategy.run(self._eval_replica_step, args=(batch,)))
                )
                if cbs is not None:
                    cbs.call("on_test_batch_end", step, sums.results())
        finally:
            weights.close()
            self.model.train(was_training)
        return sums.results()

    def _evaluation_weights(self, extra: Iterable[Callback]) -> ExitStack:
        """Enter the ``evaluation_weights()`` of this trainer's callbacks, the running fit's and
        ``extra`` (each once); closing the stack swaps the training weights back."""
        stack = ExitStack()
        seen: set[int] = set()
        for cb in [*self.callbacks, *self.active_callbacks, *extra]:
            if id(cb) not in seen and cb.runs_on(self):
                seen.add(id(cb))
                stack.enter_context(cb.evaluation_weights())
        return stack

    def evaluate(
        self,
        data: Any,
        *,
        global_batch_size: int = 256,
        callbacks: Sequence[Callback] | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over ``data`` (every sample once), identical on every rank."""
        cbs = CallbackList(list(callbacks or []), self)
        cbs.call("on_test_begin", {})
        logs = self._evaluate(data, global_batch_size, cbs)
        cbs.call("on_test_end", logs)
        return logs

    def predict(self, data: Any, *, global_batch_size: int = 256) -> torch.Tensor:
        """The model's outputs for every sample of ``data``, in dataset order, on every rank.

        ``data`` yields inputs, (inputs, targets) pairs whose targets are ignored, or dicts of the
        model's keyword arguments; a model returning a ``ModelOutput`` gives its ``logits``.
        """
        dataset = self.strategy.distribute_dataset(data, global_batch_size, shuffle=False)
        was_training = self.model.training
        self.model.eval()
        weights = self._evaluation_weights([])
        outputs = []

        def replica_predict(batch: Any) -> torch.Tensor:
            with torch.no_grad(), self.forward_context():
                if isinstance(batch, Mapping) and not {"x", "y"} <= batch.keys():
                    out = prediction_of(self.model(**batch))
                else:
                    x = batch[0] if isinstance(batch, (tuple, list)) else batch
                    x = batch["x"] if isinstance(batch, Mapping) else x
                    out = prediction_of(self.model(x))
            # Mixed precision: outputs in float32, as under "32" (autocast picks dtypes per operation).
            return out.float() if out.dtype in (torch.bfloat16, torch.float16) else out

        try:
            for batch in dataset:
                outputs.append(self.strategy.gather(self.strategy.run(replica_predict, args=(batch,))))
        finally:
            weights.close()
            self.model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)
