"""One ``fit`` for a parameter-server job: the chief drives, the workers run steps (TF's ``model.fit``
with ``ParameterServerStrategy``).

``Trainer(..., strategy=ps_strategy, coordinator=ClusterCoordinator(ps_strategy))``; the same script
runs on every task. On a **worker**, ``fit`` builds the worker's own data (its share of the samples,
reshuffled on each pass, repeated as long as the chief asks) and serves the chief's steps through the
coordinator until the chief shuts it down, then ends the process (``SystemExit(0)``: a worker's
script does not go on after ``fit``, as a TF worker's does not). On the **chief**, ``fit`` schedules
one step per batch (``ceil(samples / global_batch_size)`` per epoch: an epoch is one pass over the
data, spread over the workers), collects each step's loss and metric sums in order, and runs the
only progress bar, the callbacks, the learning-rate schedule, validation and ``evaluate``, on the
current variables pulled from the servers and on the whole data.

A step is the Trainer's own (precision, clipping, ``on_nonfinite``) run on a worker under the task's
step id, so a step rerun on another worker after a failure is applied once. The learning rate a
step uses is the chief's schedule's at the moment it is scheduled (it travels with the task; the
optimizer's hyperparameters travel with each push to the servers). Up to two steps per worker are
in flight, so workers never wait for the chief's callbacks.

Refused, with the reason: synchronous mode (its steps are the training tasks' own, in lockstep),
``BackupAndRestore`` (the coordinator's exactly-once step ids already cover a lost worker; a lost
chief's resume is not built), accumulation, and datasets without a length unless
``steps_per_epoch`` is given.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, Subset

from spread.data import DistributedDataset, ReplicaLayout
from spread.errors import SpreadError
from spread.ps import ClusterCoordinator, RemoteValue
from spread.strategies.parameter_server import ParameterServerStrategy
from spread.train.callbacks import BackupAndRestore, CallbackList, History
from spread.train.metrics import RunningSums

if TYPE_CHECKING:
    from spread.train.trainer import Trainer

IN_FLIGHT_PER_WORKER = 2


class _WorkerSide:
    """A worker's trainer and its endless batches, for the scheduled step function."""

    def __init__(self, trainer: Trainer, batches: DistributedDataset) -> None:
        self.trainer = trainer
        self.batches = batches
        self._iterator = iter(batches)

    def next_batch(self) -> Any:
        for _ in range(2):  # at most one new pass: a pass with no batch at all is an empty shard
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = iter(self.batches)  # the next pass, reshuffled
        raise SpreadError("this worker's share of the training data is empty")


_WORKER: _WorkerSide | None = None


def coordinated_train_step(step: int, learning_rates: list[float]) -> torch.Tensor:
    """Run on a worker by the chief: one Trainer step on the worker's next batch at the chief's
    learning rates; returns ``[loss*n, n, metric sums...]`` (zeros for a step dropped as non-finite)."""
    if _WORKER is None:
        raise SpreadError("coordinated_train_step runs inside a worker's coordinated Trainer.fit")
    trainer = _WORKER.trainer
    groups = trainer.optimizer.param_groups
    if len(learning_rates) != len(groups):
        raise SpreadError(f"step {step}: {len(learning_rates)} learning rates for {len(groups)} groups")
    for group, lr in zip(groups, learning_rates, strict=True):
        group["lr"] = lr
    trainer.global_step = step
    packed, _ = trainer.train_step(_WORKER.next_batch())
    return packed.detach().to(torch.float64)


def check_coordinated(trainer: Trainer) -> None:
    """Refuse, naming why, what a coordinated fit cannot do (called in ``Trainer.__init__``)."""
    strategy = trainer.strategy
    if not isinstance(strategy, ParameterServerStrategy):
        raise ValueError(
            f"Trainer(coordinator=...) drives a ParameterServerStrategy job; got {type(strategy).__name__}"
        )
    if strategy.mode != "async":
        raise ValueError(
            "Trainer(coordinator=...) needs ParameterServerStrategy(mode='async'): in sync mode every "
            "training task runs the same step in lockstep, so call fit on every task without a coordinator"
        )
    if trainer.accumulation_steps > 1:
        raise ValueError("Trainer(coordinator=...) does not accumulate gradients: each scheduled step pushes")


def _worker_share(train_data: Any, worker: int, workers: int) -> Any:
    """The samples worker ``worker`` of ``workers`` trains on: every ``workers``-th one (map-style),
    or the dataset's own ``shard`` (a stream)."""
    if isinstance(train_data, IterableDataset) or not hasattr(train_data, "__len__"):
        if not hasattr(train_data, "shard"):
            raise ValueError(
                "a coordinated fit gives each worker its share of the data: a stream needs a "
                "shard(num_shards, index) method (or pass a dataset with a length)"
            )
        return train_data.shard(workers, worker)
    if isinstance(train_data, tuple | list) and all(isinstance(t, torch.Tensor) for t in train_data):
        return tuple(t[worker::workers] for t in train_data)
    return Subset(train_data, range(worker, len(train_data), workers))


def fit_coordinated(
    trainer: Trainer,
    coordinator: ClusterCoordinator,
    train_data: Any,
    *,
    cbs: CallbackList,
    epochs: int,
    global_batch_size: int,
    steps_per_epoch: int | None,
    seed: int,
    shuffle: bool,
    validation_data: Any,
    validation_batch_size: int,
) -> History:
    """``Trainer.fit`` under a coordinator: serve on a worker (never returns), drive on the chief."""
    global _WORKER
    strategy = trainer.strategy
    assert isinstance(strategy, ParameterServerStrategy)
    workers = strategy.cluster.world_size - 1
    if not strategy.is_chief:
        share = _worker_share(train_data, strategy.rank - 1, workers)
        batches = DistributedDataset(
            share, global_batch_size, ReplicaLayout(1, 0, 1), shuffle=shuffle, seed=seed + strategy.rank
        )
        _WORKER = _WorkerSide(trainer, batches)
        coordinator.schedule(coordinated_train_step, args=(0, [0.0]))  # serves, then SystemExit(0)
    if any(isinstance(cb, BackupAndRestore) for cb in cbs):
        raise ValueError(
            "BackupAndRestore does not combine with Trainer(coordinator=...): the coordinator already "
            "reruns a lost worker's step exactly once, and a lost chief's resume is not built; fit "
            "without a coordinator on every task to use it"
        )
    if workers < 1:
        raise SpreadError("a coordinated fit needs at least one worker task")
    if steps_per_epoch is None:
        if not hasattr(train_data, "__len__") or isinstance(train_data, IterableDataset):
            raise ValueError("a coordinated fit over a stream needs steps_per_epoch")
        samples = len(train_data[0]) if isinstance(train_data, tuple | list) else len(train_data)
        steps_per_epoch = math.ceil(samples / global_batch_size)
    trainer.params["steps"] = steps_per_epoch
    window = IN_FLIGHT_PER_WORKER * workers
    pending: deque[tuple[int, RemoteValue]] = deque()
    total_steps = epochs * steps_per_epoch
    scheduled = 0

    def schedule_ahead() -> None:
        nonlocal scheduled
        while scheduled < total_steps and len(pending) < window:
            rates = [float(g["lr"]) for g in trainer.optimizer.param_groups]
            pending.append((scheduled, coordinator.schedule(coordinated_train_step, args=(scheduled, rates))))
            scheduled += 1

    cbs.call("on_train_begin", {})
    logs: dict[str, float] = {}
    for epoch in range(epochs):
        trainer.epoch = epoch
        cbs.call("on_epoch_begin", epoch, {})
        sums = trainer.running_sums = RunningSums(list(trainer.metrics))
        for step in range(steps_per_epoch):
            cbs.call("on_train_batch_begin", step, {})
            schedule_ahead()
            number, value = pending.popleft()
            packed = _fetch(value, number, coordinator.worker_timeout)
            sums.add(packed)
            trainer.global_step = number + 1
            batch_logs = {**sums.results(), **trainer.lr_logs(), "size": int(packed[1].item())}
            if trainer.lr_schedule is not None:
                trainer.lr_schedule.after_optimizer_step(batch_logs, validation_data is not None)
            cbs.call("on_train_batch_end", step, batch_logs)
            if trainer.stop_training:
                break
        logs = {**sums.results(), **trainer.lr_logs()}
        if validation_data is not None:
            val_logs = trainer.evaluate_during_fit(validation_data, validation_batch_size)
            logs.update({f"val_{k}": v for k, v in val_logs.items()})
        if trainer.lr_schedule is not None:
            trainer.lr_schedule.after_epoch(logs, validation_data is not None)
        cbs.call("on_epoch_end", epoch, logs)
        if trainer.stop_training:
            break
    coordinator.join()  # steps already scheduled (an early stop) finish before the weights are read
    strategy.refresh_weights()
    cbs.call("on_train_end", logs)
    return trainer.history


def _fetch(value: RemoteValue, step: int, timeout: float) -> torch.Tensor:
    try:
        result = value.fetch(timeout=timeout)
    except TimeoutError:
        raise SpreadError(
            f"coordinated fit: step {step} brought no result within {timeout:g}s (no worker finished it; "
            "see the workers' logs)"
        ) from None
    if not isinstance(result, torch.Tensor):
        raise SpreadError(f"coordinated fit: step {step} returned {type(result).__name__}, not its sums")
    return result
