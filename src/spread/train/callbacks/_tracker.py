"""What the experiment-tracker callbacks (MLflowLogger, WandbLogger) share: one run per job.

Only the chief talks to the tracker (``chief_only``), so a job of any number of ranks makes one
run, not one per rank. The run's id is the callback's ``state_dict``: a fit resumed by
``BackupAndRestore`` (new processes, any world size) reopens that run instead of opening another,
and skips the points the tracker already holds (the steps trained again after the backup). A fit
without a restored state opens a new run: a plain restart is a new run.

The run is opened lazily, at the first epoch, because a restored state arrives after every
``on_train_begin``. It ends with the fit: finished after ``on_train_end``, killed when the fit left
by ``KeyboardInterrupt`` or ``SystemExit`` (Ctrl-C, a preemption's exit), failed otherwise.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from spread.train.callbacks._monitor import as_float, invalid
from spread.train.callbacks.base import Callback, Logs
from spread.train.callbacks.model_checkpoint import ModelCheckpoint

FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


def _param_value(value: Any) -> Any:
    """A hyperparameter as a tracker stores it: scalars as they are, tensors as numbers, the rest as text."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _exit_status() -> str:
    """How the fit being left ended (``on_fit_exit`` runs in ``fit``'s ``finally``, so the exception
    in flight is the fit's)."""
    error = sys.exc_info()[1]
    return KILLED if isinstance(error, (KeyboardInterrupt, SystemExit)) else FAILED


class TrackerLogger(Callback):
    """Base of the tracker callbacks: subclasses open, reopen, log to and close one run."""

    chief_only = True

    def __init__(
        self, *, log_every_n_steps: int | None, log_checkpoints: bool, params: Mapping[str, Any] | None
    ) -> None:
        super().__init__()
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise invalid("log_every_n_steps", log_every_n_steps, "a positive integer or None")
        if params is not None and not isinstance(params, Mapping):
            raise invalid("params", params, "a mapping of names to values")
        self.log_every_n_steps = log_every_n_steps
        self.log_checkpoints = bool(log_checkpoints)
        self.user_params = dict(params or {})
        self.run_id: str | None = None
        self._active = False  # a run is open in this process
        self._last_step = -1  # the last optimizer step (and epoch) the run holds: not logged again
        self._last_epoch = -1
        self._uploaded: dict[int, int] = {}  # id(ModelCheckpoint) -> how many of its saves are logged

    # -- what a tracker implements -------------------------------------------------------------------
    def _create_run(self) -> str:
        """Open a new run; return its id."""
        raise NotImplementedError

    def _reopen_run(self, run_id: str) -> tuple[int, int]:
        """Continue run ``run_id``; return the last step and epoch it holds (-1: none, or unknown)."""
        raise NotImplementedError

    def _log_params(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def _log_metrics(self, prefix: str, metrics: dict[str, float], step: int) -> None:
        """``metrics`` as ``<prefix>/<name>`` at ``step`` (the optimizer step for ``batch``, the
        0-based epoch for ``epoch``)."""
        raise NotImplementedError

    def _log_artifact(self, path: str) -> None:
        raise NotImplementedError

    def _end_run(self, status: str) -> None:
        raise NotImplementedError

    # -- the hooks -----------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.run_id = None  # each fit opens a run, unless a restored state names one (after this hook)
        self._active = False
        self._last_step = self._last_epoch = -1
        self._uploaded = {}

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._ensure_run()
        self._upload_checkpoints()  # the previous epoch's, whatever the callbacks' order

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        every, global_step = self.log_every_n_steps, self.trainer.global_step
        if every is None or global_step % every or global_step <= self._last_step:
            return
        self._ensure_run()
        self._log_metrics("batch", _numbers(logs), global_step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self._ensure_run()
        if epoch > self._last_epoch:
            self._log_metrics("epoch", _numbers(logs), epoch)

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._ensure_run()
        self._upload_checkpoints()
        self._active = False
        self._end_run(FINISHED)

    def on_fit_exit(self) -> None:
        if not self._active:  # ended by on_train_end, or never opened
            return
        self._active = False
        status = _exit_status()
        try:
            self._upload_checkpoints()
        finally:
            self._end_run(status)

    def state_dict(self) -> dict[str, Any]:
        """The run's id: a fit resumed from a backup continues this run."""
        return {"run_id": self.run_id} if self.run_id is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = str(state["run_id"])

    # -- internals -----------------------------------------------------------------------------------
    def _ensure_run(self) -> None:
        if self._active:
            return
        if self.run_id is not None:
            self._last_step, self._last_epoch = self._reopen_run(self.run_id)
        else:
            self.run_id = self._create_run()
            self._log_params(self.run_params())
        self._active = True

    def run_params(self) -> dict[str, Any]:
        """What the run records of the job: strategy, replicas, batch, epochs, optimizer and its
        hyperparameters, precision, accumulation, then the user's ``params``."""
        trainer = self.trainer
        optimizer = trainer.optimizer
        params: dict[str, Any] = {
            "strategy": type(trainer.strategy).__name__,
            "num_replicas": trainer.strategy.num_replicas_in_sync,
            "global_batch_size": trainer.params.get("global_batch_size"),
            "epochs": trainer.params.get("epochs"),
            "steps_per_epoch": trainer.params.get("steps"),
            "optimizer": type(optimizer).__name__,
            "precision": trainer.precision.name,
            "accumulation_steps": trainer.accumulation_steps,
        }
        for name, value in optimizer.defaults.items():
            if value is not None:
                params[f"optimizer.{name}"] = _param_value(value)
        params.update({name: _param_value(value) for name, value in self.user_params.items()})
        return {name: value for name, value in params.items() if value is not None}

    def _upload_checkpoints(self) -> None:
        """The files the fit's ModelCheckpoints wrote since the last upload, when ``log_checkpoints``."""
        if not self.log_checkpoints or not self._active:
            return
        for callback in self.trainer.active_callbacks:
            if not isinstance(callback, ModelCheckpoint):
                continue
            callback.wait()  # a file still being written in the background is uploaded whole
            done = self._uploaded.get(id(callback), 0)
            for path in dict.fromkeys(callback.saved[done:]):  # a best-only path saved twice: once
                if os.path.exists(path):
                    self._log_artifact(path)
            self._uploaded[id(callback)] = len(callback.saved)


def _numbers(logs: Logs | None) -> dict[str, float]:
    numbers = {name: as_float(value) for name, value in (logs or {}).items() if name != "size"}
    return {name: number for name, number in numbers.items() if number is not None}
