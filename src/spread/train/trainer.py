"""Keras-style training on any strategy: ``fit``, ``evaluate``, ``predict`` with callbacks.

The trainer is a thin loop over the strategy's contract: the dataset is distributed by the strategy,
each step runs forward and backward on every replica (``strategy.run``), gradients arrive reduced,
the optimizer steps once in cross-replica context. Loss and metrics are summed over replicas once
per step (one small all-reduce), so every rank sees the same logs and callbacks agree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from spread.data.batches import Batch, as_batch
from spread.errors import NonFiniteLossError
from spread.memory.accumulation import check_accumulation_steps, micro_batches
from spread.strategies import Strategy, make_strategy
from spread.train.callbacks import Callback, CallbackList, History, ProgressBar
from spread.train.metrics import MetricFn, RunningSums, resolve_metrics
from spread.train.outputs import loss_of, prediction_of

NONFINITE_POLICIES = ("raise", "skip_step")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
        self.stop_training = False
        self.params: dict[str, Any] = {}
        self.epoch = 0
        self.global_step = 0
        self.skipped_steps = 0
        self.data_wait_fraction = 0.0  # share of the last epoch this rank spent waiting for batches
        self.running_sums: RunningSums | None = None  # the current epoch's loss and metric sums
        self.resume_point: dict[str, Any] | None = None  # set by BackupAndRestore in on_train_begin
        self.history = History()
        self.active_callbacks: list[Callback] = []  # the running fit's callbacks on this rank
        if not self.strategy.is_managed(model):
            self.strategy.prepare_model(model)

    @property
    def is_chief(self) -> bool:
        return self.strategy.is_chief

    # -- one replica's work ------------------------------------------------------------------------
    def batch_stats(self, y_pred: torch.Tensor, y: Any, loss: torch.Tensor, n: int) -> torch.Tensor:
        """``[loss*n, n, metric sums...]`` of ``n`` samples (float64, summed over replicas later)."""
        values = [loss.detach() * n if n else loss.new_zeros(()), loss.new_tensor(float(n))]
        for fn in self.metrics.values():
            values.append(fn(y_pred.detach(), y).sum().to(loss.dtype) if n else loss.new_zeros(()))
        return torch.stack([v.reshape(()) for v in values]).to(torch.float64)

    def _forward(self, batch: Batch) -> Any:
        return self.model(**batch.inputs) if batch.as_keywords else self.model(batch.inputs)

    def _forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prediction, mean loss)`` of a non-empty batch; for an empty one a zero loss that still
        reaches every parameter (a replica with no samples takes part in the gradient exchange)."""
        if batch.size == 0 and batch.as_keywords:
            # Hugging Face models cannot run an empty batch: no forward, zero gradients.
            params = [p for p in self.model.parameters() if p.requires_grad]
            zero = torch.stack([p.sum() for p in params]).sum() * 0.0
            return zero.reshape(1), zero
        output = self._forward(batch)
        prediction = prediction_of(output)
        if batch.size == 0:
            return prediction, prediction.sum() * 0.0
        if self.loss_fn is None:
            return prediction, loss_of(output)
        if batch.targets is None:
            raise ValueError("Trainer got a batch without 'labels' and a loss_fn: the loss_fn has no targets")
        return prediction, self.loss_fn(prediction, batch.targets)

    def replica_train_step(self, batch: Any) -> torch.Tensor:
        """Forward and backward of one replica's batch (``strategy.run`` calls it on each replica)."""
        b = as_batch(batch, who="Trainer")
        if self.accumulation_steps > 1:
            return self._accumulate_replica_step(b)
        prediction, loss = self._forward_loss(b)
        loss.backward()
        return self.batch_stats(prediction, b.targets, loss, b.size)

    def _accumulate_replica_step(self, batch: Batch) -> torch.Tensor:
        """Micro-batches of this replica's slice; each mean loss weighted by its share of the slice
        (see spread.memory.accumulation); only the last backward exchanges gradients."""
        stats = None
        whole = batch.inputs if batch.as_keywords else (batch.inputs, batch.targets)
        for micro in micro_batches(whole, self.accumulation_steps, strategy=self.strategy):
            part_batch = as_batch(micro.data, who="Trainer")
            prediction, loss = self._forward_loss(part_batch)
            micro.backward(loss)
            part = self.batch_stats(prediction, part_batch.targets, loss, part_batch.size)
            stats = part if stats is None else stats + part
        if stats is None:
            raise RuntimeError("micro_batches yielded no micro-batch")
        return stats

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
        global_batch_size: int = 32,
        validation_data: Any = None,
        validation_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
        steps_per_epoch: int | None = None,
        initial_epoch: int = 0,
        callbacks: Sequence[Callback] | None = None,
        verbose: int = 1,
    ) -> History:
        """Train for ``epochs`` epochs over ``train_data`` split into global batches.

        Every rank must call ``fit`` with the same arguments. Returns the History callback, whose
        ``history`` maps each log name to its per-epoch values (identical on every rank).
        """
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
        if not 0 <= initial_epoch < epochs:
            raise ValueError(f"initial_epoch must be in [0, epochs), got {initial_epoch!r}")
        train = self.strategy.distribute_dataset(
            train_data, global_batch_size, shuffle=shuffle, seed=seed, drop_remainder=drop_remainder
        )
        steps = len(train) if hasattr(train.dataset, "__len__") else None
        if steps_per_epoch is not None:
            steps = min(steps, steps_per_epoch) if steps is not None else steps_per_epoch
        self.params = {
            "epochs": epochs,
            "steps": steps,
            "global_batch_size": global_batch_size,
            "verbose": verbose,
        }
        defaults: list[Callback] = [self.history]
        if verbose:
            defaults.append(ProgressBar(verbose=verbose))
        cbs = CallbackList([*defaults, *self.callbacks, *(callbacks or [])], self)
        self.active_callbacks = list(cbs)
        self.stop_training = False
        self.train_dataset = train
        self.resume_point = None
        cbs.call("on_train_begin", {})
        resume, self.resume_point = self.resume_point, None
        logs: dict[str, float] = {}
        for epoch in range(resume["epoch"] if resume else initial_epoch, epochs):
            self.epoch = epoch
            self.model.train()
            cbs.call("on_epoch_begin", epoch, {})
            train.set_epoch(epoch)
            train.wait_clock.reset()
            epoch_started = time.perf_counter()
            sums = self.running_sums = RunningSums(list(self.metrics))
            first_step = 0
            if resume and epoch == resume["epoch"]:  # continue exactly after the last saved batch
                first_step = resume["batch"]
                train.load_state_dict({"epoch": epoch, "batch": first_step})
                sums.totals = resume["sums"].clone()
            for step, batch in enumerate(train, start=first_step):
                if steps_per_epoch is not None and step >= steps_per_epoch:
                    break
                cbs.call("on_train_batch_begin", step, {})
                packed = self._train_step(batch)
                sums.add(packed)
                batch_logs = sums.results()
                batch_logs["size"] = int(packed[1].item())
                cbs.call("on_train_batch_end", step, batch_logs)
            self.data_wait_fraction = train.wait_clock.seconds / max(
                time.perf_counter() - epoch_started, 1e-9
            )
            logs = sums.results()
            if validation_data is not None:
                val_logs = self._evaluate(validation_data, validation_batch_size or global_batch_size, None)
                logs.update({f"val_{k}": v for k, v in val_logs.items()})
            cbs.call("on_epoch_end", epoch, logs)
            if self.stop_training:
                break
        cbs.call("on_train_end", logs)
        self.active_callbacks = []
        return self.history

    def _train_step(self, batch: Any) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        packed = self.strategy.run_training_step(self, batch)  # summed [loss*n, n, metrics...], every rank
        loss_sum = float(packed[0].item())
        if not math.isfinite(loss_sum):
            self.optimizer.zero_grad(set_to_none=True)
            if self.on_nonfinite == "raise":
                raise NonFiniteLossError(
                    f"non-finite loss ({loss_sum}) at epoch {self.epoch}, step {self.global_step}; "
                    f"the weights were not updated (use on_nonfinite='skip_step' to drop such steps)"
                )
            self.skipped_steps += 1
            return packed.new_zeros(packed.shape)
        self.optimizer.step()
        self.global_step += 1
        return packed

    def _evaluate(self, data: Any, global_batch_size: int, cbs: CallbackList | None) -> dict[str, float]:
        dataset = self.strategy.distribute_dataset(data, global_batch_size, shuffle=False)
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
            with torch.no_grad():
                if isinstance(batch, Mapping) and not {"x", "y"} <= batch.keys():
                    return prediction_of(self.model(**batch))
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                x = batch["x"] if isinstance(batch, Mapping) else x
                return prediction_of(self.model(x))

        try:
            for batch in dataset:
                outputs.append(self.strategy.gather(self.strategy.run(replica_predict, args=(batch,))))
        finally:
            weights.close()
            self.model.train(was_training)
        return torch.cat(outputs) if outputs else torch.empty(0)
