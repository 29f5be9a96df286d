"""Learning-rate schedules for the Trainer: any ``torch.optim.lr_scheduler``, stepped per optimizer
step or per epoch.

Stepped once per *optimizer* step (``scheduler_interval="step"``), whatever the number of replicas,
micro-batches or pipeline stages, or once per epoch (``"epoch"``, after validation, before the
callbacks' ``on_epoch_end``, so a backup taken there holds the stepped schedule). A step dropped by
``on_nonfinite="skip_step"`` does not advance the schedule; a step the fp16 loss scaler skipped
does (it counts as a training step, as the batch was consumed: Lightning does the same).

Schedulers that need a metric (``ReduceLROnPlateau``) are stepped with the log named by
``scheduler_monitor``: by default ``"val_loss"`` when ``fit`` has validation data and
``"loss"`` otherwise; per step they get the running mean of the epoch so far (the batch logs). A
missing log is an error naming the logs there are.

Every rank steps its own scheduler with the same values (logs are identical on every rank), so the
learning rates agree without any exchange. The scheduler's ``state_dict`` is saved by
``BackupAndRestore`` (resume continues the schedule exactly) and by ``ModelCheckpoint`` with
``save_weights_only=False``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

INTERVALS = ("step", "epoch")
SchedulerArg = LRScheduler | ReduceLROnPlateau | Callable[[torch.optim.Optimizer], Any]


def _as_scheduler(value: Any, optimizer: torch.optim.Optimizer) -> LRScheduler | ReduceLROnPlateau:
    scheduler = value
    if not isinstance(value, LRScheduler | ReduceLROnPlateau):
        if not callable(value):
            raise TypeError(
                "lr_scheduler must be a torch.optim.lr_scheduler scheduler or a callable building one "
                f"from the optimizer, got {type(value).__name__}"
            )
        scheduler = value(optimizer)
        if not isinstance(scheduler, LRScheduler | ReduceLROnPlateau):
            raise TypeError(
                f"lr_scheduler(optimizer) must return a torch.optim.lr_scheduler scheduler, got "
                f"{type(scheduler).__name__}"
            )
    if scheduler.optimizer is not optimizer:
        raise ValueError("lr_scheduler schedules another optimizer than the Trainer's")
    return scheduler


class LRSchedule:
    """One Trainer's scheduler, when it steps, and what a plateau scheduler monitors."""

    def __init__(
        self, scheduler: SchedulerArg, optimizer: torch.optim.Optimizer, interval: str, monitor: str | None
    ) -> None:
        if interval not in INTERVALS:
            raise ValueError(f"scheduler_interval must be one of {INTERVALS}, got {interval!r}")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(f"scheduler_monitor must be a log name or None, got {monitor!r}")
        self.scheduler = _as_scheduler(scheduler, optimizer)
        self.optimizer = optimizer
        self.interval = interval
        self.monitor = monitor
        self.needs_metric = isinstance(self.scheduler, ReduceLROnPlateau)

    @property
    def lr(self) -> float:
        """The first parameter group's current learning rate (what the logs show as ``lr``)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def monitored(self, has_validation: bool) -> str:
        if self.monitor is not None:
            return self.monitor
        return "val_loss" if has_validation and self.interval == "epoch" else "loss"

    def after_optimizer_step(self, batch_logs: Mapping[str, float], has_validation: bool) -> None:
        if self.interval == "step":
            self._step(batch_logs, has_validation)

    def after_epoch(self, logs: Mapping[str, float], has_validation: bool) -> None:
        if self.interval == "epoch":
            self._step(logs, has_validation)

    def _step(self, logs: Mapping[str, float], has_validation: bool) -> None:
        with warnings.catch_warnings():
            # The fp16 loss scaler skips the optimizer's first steps on overflow, after which torch
            # warns that the schedule stepped first: here that is intended (see the module).
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            if not self.needs_metric:
                self.scheduler.step()
                return
            name = self.monitored(has_validation)
            if name not in logs:
                raise KeyError(
                    f"lr_scheduler {type(self.scheduler).__name__} monitors {name!r} (scheduler_monitor), "
                    f"which is not in the logs; they hold {sorted(k for k in logs if k != 'size')}"
                )
            self.scheduler.step(logs[name])  # type: ignore[arg-type]

    def replay(self, steps: int, epochs: int) -> None:
        """Advance a fresh schedule to where ``steps`` optimizer steps and ``epochs`` epochs leave it
        (a rank that resumes without the backup's scheduler state). Plateau schedulers depend on
        logs that are gone, so they start afresh."""
        if self.needs_metric:
            return
        for _ in range(steps if self.interval == "step" else epochs):
            self._step({}, False)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scheduler.load_state_dict(dict(state))
