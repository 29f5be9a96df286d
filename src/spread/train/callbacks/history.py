"""History: the per-epoch record that ``Trainer.fit`` returns, as ``model.fit`` does in Keras.

The trainer adds one History to every ``fit`` call and keeps the same object across calls, so a
second ``fit`` (for example one resumed with ``initial_epoch``) extends the record instead of
replacing it. Every rank sees the same logs, so every rank's History is identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spread.train.callbacks.base import Callback, Logs


class History(Callback):
    """Records every epoch's logs.

    Attributes:
        history: log name (``"loss"``, ``"accuracy"``, ``"val_loss"``, ...) -> one value per epoch.
        epoch: the (0-based) epoch index of each recorded entry, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(value)

    def state_dict(self) -> dict[str, Any]:
        """The record so far: a resumed ``fit`` returns the whole run's History."""
        return {"history": {k: list(v) for k, v in self.history.items()}, "epoch": list(self.epoch)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {k: list(v) for k, v in state["history"].items()}
        self.epoch = [int(e) for e in state["epoch"]]

    def __repr__(self) -> str:
        return f"History(epochs={len(self.epoch)}, keys={sorted(self.history)})"
