"""A fake trainer that drives callbacks through the hooks the way ``Trainer.fit`` does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from spread.strategies import OneDeviceStrategy
from spread.train.callbacks import Callback, CallbackList


class FakeTrainer:
    """The attributes callbacks may read, and a ``fit`` that replays given epoch logs.

    The model's weight is filled with the epoch index at the start of each epoch, so a saved or
    restored state says which epoch it came from.
    """

    def __init__(
        self, *, epochs: int = 3, steps: int | None = 4, global_batch_size: int = 8, is_chief: bool = True
    ) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.strategy = OneDeviceStrategy()  # what a callback may ask a strategy for
        self.is_chief = is_chief
        self.stop_training = False
        self.params: dict[str, Any] = {
            "epochs": epochs,
            "steps": steps,
            "global_batch_size": global_batch_size,
            "verbose": 1,
        }
        self.epoch = 0
        self.global_step = 0
        self.active_callbacks: list[Callback] = []

    def schedule_state_dict(self) -> dict[str, Any]:
        return {}  # no scheduler, no scaler

    def fit(
        self,
        callbacks: Sequence[Callback],
        epoch_logs: Sequence[dict[str, Any]] | Callable[[int], dict[str, Any]] | None = None,
        batch_logs: Callable[[int, int], dict[str, Any]] | None = None,
        steps: int | None = None,
    ) -> CallbackList:
        epochs = self.params["epochs"]
        num_steps = steps if steps is not None else self.params["steps"] or 4
        gbs = self.params["global_batch_size"]
        cbs = CallbackList(callbacks, self)
        self.active_callbacks = list(cbs)
        self.stop_training = False
        cbs.call("on_train_begin", {})
        logs: dict[str, Any] = {}
        for epoch in range(epochs):
            self.epoch = epoch
            with torch.no_grad():
                self.model.weight.fill_(float(epoch))
            cbs.call("on_epoch_begin", epoch, {})
            for step in range(num_steps):
                cbs.call("on_train_batch_begin", step, {})
                self.global_step += 1
                blogs = batch_logs(epoch, step) if batch_logs else {"loss": 1.0 / (step + 1), "accuracy": 0.5}
                cbs.call("on_train_batch_end", step, {**blogs, "size": gbs})
            if callable(epoch_logs):
                logs = epoch_logs(epoch)
            elif epoch_logs is not None:
                logs = dict(epoch_logs[epoch])
            else:
                logs = {"loss": 1.0 / (epoch + 1), "accuracy": 0.5, "val_loss": 2.0 / (epoch + 1)}
            cbs.call("on_epoch_end", epoch, logs)
            if self.stop_training:
                break
        cbs.call("on_train_end", logs)
        return cbs


@pytest.fixture
def fake_trainer() -> type[FakeTrainer]:
    return FakeTrainer
