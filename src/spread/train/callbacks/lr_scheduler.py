"""LearningRateScheduler: set the learning rate at the start of each epoch, as Keras's callback does.

``schedule(epoch, lr) -> new lr`` gets the 0-based epoch index and the current rate (the first
parameter group's) and returns the rate for that epoch, set on every parameter group. It runs on
every rank (every rank's optimizer must use the same rate; logs and epochs are the same everywhere,
so the schedules agree). The rate is in the epoch's logs as ``lr``.

Resuming: ``BackupAndRestore`` restores the optimizer (its current rate) and this callback's state:
the epoch and the rate the schedule was given at that epoch's start. A fit resumed in the middle of
that epoch calls ``on_epoch_begin`` for it again; the schedule then gets the saved rate, not the one it
already produced, so a relative schedule (``lr * 0.5``) is not applied twice and continues exactly.
For per-step schedules and ``torch.optim.lr_scheduler`` objects use ``Trainer(lr_scheduler=...)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from spread.train.callbacks._monitor import invalid
from spread.train.callbacks.base import Callback, Logs


class LearningRateScheduler(Callback):
    """Learning rate from ``schedule(epoch, lr)`` at the start of every epoch.

    Args:
        schedule: ``(epoch: int, lr: float) -> float``; must return a finite number >= 0.
        verbose: 1 prints the new rate on the chief at each change.
    """

    sets_learning_rate = True

    def __init__(self, schedule: Callable[[int, float], float], verbose: int = 0) -> None:
        super().__init__()
        if not callable(schedule):
            raise invalid("schedule", schedule, "a callable (epoch, lr) -> lr")
        self.schedule = schedule
        self.verbose = verbose
        self._epoch = -1  # the epoch last begun, and the rate the schedule was given then
        self._given = 0.0

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        optimizer = self.trainer.optimizer
        current = float(optimizer.param_groups[0]["lr"])
        if epoch != self._epoch:  # else a resumed epoch: its rate came from self._given already
            self._epoch, self._given = epoch, current
        current = self._given
        lr = self.schedule(epoch, current)
        if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr < 0:
            raise ValueError(
                f"LearningRateScheduler: schedule({epoch}, {current}) must return a finite number >= 0, "
                f"got {lr!r}"
            )
        for group in optimizer.param_groups:
            group["lr"] = float(lr)
        if self.verbose and self.trainer.is_chief and lr != current:
            print(f"Epoch {epoch + 1}: LearningRateScheduler set the learning rate to {lr:g}.", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "given_lr": self._given}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._epoch, self._given = int(state["epoch"]), float(state["given_lr"])
