"""EarlyStopping: stop ``fit`` when a monitored log has stopped improving (Keras semantics).

Not chief-only on purpose: every rank receives the same (already reduced) logs, takes the same
decision and sets ``trainer.stop_training`` at the same epoch, so all ranks leave the loop together.
Running it on the chief alone would leave the other ranks waiting in the next epoch's collectives.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from spread.train.callbacks._monitor import as_float, invalid, monitor_op, resolve_mode
from spread.train.callbacks.base import Callback, Logs


class EarlyStopping(Callback):
    """Stops training after ``patience`` epochs without improvement of ``monitor``.

    Args:
        monitor: the epoch log to watch (``"val_loss"`` needs validation data in ``fit``).
        min_delta: smallest change that counts as an improvement (its sign is ignored).
        patience: epochs without improvement after which training stops.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for names containing "acc" or "auc", else min).
        baseline: a value to beat; while the monitored value has not beaten it, the patience
            counter keeps running even when the value improves on its own best.
        restore_best_weights: keep a CPU copy of the weights of the best epoch and load it back when
            training ends (whether or not it stopped early). Memory: one copy of the model on the host.
        start_from_epoch: epochs (0-based index) before this one are not monitored (warm-up).
        verbose: 1 prints (on the chief) when training stops and when weights are restored.

    Attributes ``best``, ``best_epoch``, ``wait`` and ``stopped_epoch`` (0 if it never stopped) are
    readable after ``fit``.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
        verbose: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(monitor, str) or not monitor:
            raise invalid("monitor", monitor, "a non-empty log name")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
            raise invalid("patience", patience, "a non-negative integer")
        if (
            not isinstance(start_from_epoch, int)
            or isinstance(start_from_epoch, bool)
            or start_from_epoch < 0
        ):
            raise invalid("start_from_epoch", start_from_epoch, "a non-negative integer")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)):
            raise invalid("min_delta", min_delta, "a number")
        if baseline is not None and (isinstance(baseline, bool) or not isinstance(baseline, (int, float))):
            raise invalid("baseline", baseline, "None or a number")
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode)
        self.min_delta = abs(float(min_delta))
        self.patience = patience
        self.baseline = None if baseline is None else float(baseline)
        self.restore_best_weights = bool(restore_best_weights)
        self.start_from_epoch = start_from_epoch
        self.verbose = verbose
        self._better = monitor_op(self.mode)
        self._warned_missing = False
        self._reset()

    def _reset(self) -> None:
        self.wait = 0
        self.stopped_epoch = 0
        self.best: float | None = None
        self.best_epoch = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def _is_improvement(self, current: float, reference: float | None) -> bool:
        if reference is None:
            return True
        # Shift current by min_delta towards "worse", so it must beat reference by more than min_delta.
        shifted = current + self.min_delta if self.mode == "min" else current - self.min_delta
        return self._better(shifted, reference)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        # copy=True: on a CPU model .to("cpu") would return the live tensors, which training overwrites.
        # Through the strategy (every rank calls it alike): the one-device weights where the model
        # is split or sharded over the ranks (collective there).
        weights = self.trainer.strategy.full_state_dict(self.trainer.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}

    def _print(self, message: str) -> None:
        if self.verbose and self.trainer.is_chief:
            print(message, file=sys.stdout, flush=True)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._reset()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = logs or {}
        current = as_float(logs.get(self.monitor))
        if current is None:
            if not self._warned_missing:
                self._warned_missing = True
                warnings.warn(
                    f"EarlyStopping monitors `{self.monitor}`, which is not in the epoch logs (available: "
                    f"{sorted(logs)}); it will not stop training.",
                    stacklevel=2,
                )
            return
        if epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            # Nothing recorded yet: the current weights are the best known.
            self.best_weights = self._snapshot()
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self._snapshot()
            # Patience restarts only once the value beats the baseline as well as its own best.
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.trainer.stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.stopped_epoch > 0:
            self._print(f"epoch {self.stopped_epoch + 1}: early stopping ({self.monitor} did not improve)")
        if self.restore_best_weights and self.best_weights is not None:
            self._print(f"restoring model weights from the end of the best epoch: {self.best_epoch + 1}")
            self.trainer.strategy.load_full_state_dict(self.trainer.model, self.best_weights)

    def state_dict(self) -> dict[str, Any]:
        """Patience, the best value and epoch (and the best weights, one-device, when kept): a
        resumed fit stops where the uninterrupted one would and restores the same weights."""
        state: dict[str, Any] = {
            "wait": self.wait,
            "stopped_epoch": self.stopped_epoch,
            "best": self.best,
            "best_epoch": self.best_epoch,
        }
        if self.best_weights is not None:
            state["best_weights"] = self.best_weights
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.wait = int(state["wait"])
        self.stopped_epoch = int(state["stopped_epoch"])
        self.best = None if state["best"] is None else float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.best_weights = dict(state["best_weights"]) if "best_weights" in state else None
