"""ModelCheckpoint: save the model (and optionally the optimizer) during ``fit``, Keras-style.

A policy: it decides when to save and which file to keep (``save_best_only`` on ``monitor``); the
one-device weights come from the strategy (``strategy.full_state_dict``: gathered from shards or
pipeline stages where the strategy splits them, so the callback runs on every rank and the chief
writes), and the file is written by the project's one atomic writer
(:func:`spread.checkpoint.atomic.atomic_save`): a crash, a full disk or a kill at any moment leaves
either the previous file or the new one under the final name, never a torn one. Overwriting a
checkpoint in place (nanoGPT) loses both copies on a crash.

A name ending in ``.safetensors`` is written as safetensors (weights only; loadable with
``safetensors.torch.load_file`` and ``from_pretrained``-style loaders); asking for the optimizer
in one is refused, never a pickle under that name.

With ``async_save=True`` the chief copies the gathered state to host memory at the step boundary and
writes the file on a background thread (:mod:`spread.checkpoint.background`), one file in flight;
the next save and the end of ``fit`` wait for it and raise its failure, and a path enters
:attr:`ModelCheckpoint.saved` once its file is complete. Off by default (unlike ``BackupAndRestore``):
Keras code expects the file to exist when the epoch's callbacks run.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from spread.checkpoint.atomic import atomic_save
from spread.checkpoint.background import BackgroundWriter
from spread.checkpoint.export import SAFETENSORS_SUFFIX, write_safetensors
from spread.train.callbacks._monitor import (
    as_float,
    check_freq,
    invalid,
    monitor_op,
    resolve_mode,
    worst_value,
)
from spread.train.callbacks.base import Callback, Logs


class ModelCheckpoint(Callback):
    """Saves the model every epoch or every ``save_freq`` batches, optionally only when it improves.

    Args:
        filepath: where to save; may hold format fields filled from the logs and the position,
            e.g. ``"ckpt/epoch{epoch:02d}-{val_loss:.3f}.pt"``. ``epoch`` is 1-based (as printed),
            ``batch`` (1-based, step-based saves only) and ``global_step`` are also available.
        monitor: the log watched by ``save_best_only``.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (max for names containing "acc" or "auc", else min).
        save_best_only: save only when ``monitor`` beats the best value seen so far. A missing
            ``monitor`` warns once and skips saving (it does not stop training).
        save_weights_only: save ``model.state_dict()`` only; if False, save one dict with ``model``,
            ``optimizer`` (its state dict), ``epoch`` (0-based index of the epoch being trained; resume
            an epoch-end save with ``initial_epoch=epoch + 1``) and ``global_step``, plus
            ``lr_scheduler`` and ``grad_scaler`` (their state dicts) when the Trainer has them.
        save_freq: ``"epoch"``, or a positive number of batches between saves (the logs are then the
            running means of the current epoch, as in Keras).
        verbose: 1 prints a line for each save (and each skipped best-only save).
        async_save: write the file on a background thread after copying the state at the step
            boundary; False (the default): write it before training goes on.

    Load with ``torch.load(path, weights_only=True)`` (a ``.safetensors`` name: with
    ``safetensors.torch.load_file``). Runs on every rank (the one-device state is collective under
    ShardedStrategy and PipelineStrategy); only the chief writes and prints.
    """

    def __init__(
        self,
        filepath: str | os.PathLike[str],
        monitor: str = "val_loss",
        mode: str = "auto",
        save_best_only: bool = False,
        save_weights_only: bool = True,
        save_freq: str | int = "epoch",
        verbose: int = 0,
        async_save: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(filepath, (str, os.PathLike)) or not os.fspath(filepath):
            raise invalid("filepath", filepath, "a non-empty path")
        if not isinstance(monitor, str) or not monitor:
            raise invalid("monitor", monitor, "a non-empty log name")
        self.filepath = os.fspath(filepath)
        if self.filepath.endswith(SAFETENSORS_SUFFIX) and not save_weights_only:
            raise ValueError(
                f"ModelCheckpoint(filepath={self.filepath!r}, save_weights_only=False): a .safetensors "
                "file holds tensors only, not the optimizer's state and the position; use "
                "save_weights_only=True, or a .pt name for the whole state"
            )
        self.monitor = monitor
        self.mode = resolve_mode(monitor, mode)
        self.save_best_only = bool(save_best_only)
        self.save_weights_only = bool(save_weights_only)
        self.save_freq = check_freq("save_freq", save_freq)
        self.verbose = verbose
        if not isinstance(async_save, bool):
            raise invalid("async_save", async_save, "True or False")
        self.async_save = async_save
        self._writer: BackgroundWriter | None = None
        self.best = worst_value(self.mode)
        self._better = monitor_op(self.mode)
        self._batches_since_save = 0
        self._epoch = 0
        self._warned_missing = False
        # The files written in the current fit, in order (on the chief): what a tracker logger uploads.
        self.saved: list[str] = []

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._batches_since_save = 0
        self.saved = []

    def on_train_end(self, logs: Logs | None = None) -> None:
        self.wait()

    def on_fit_exit(self) -> None:
        """Leaving ``fit`` by an exception: the file in flight is still finished (a failure is
        warned about, not raised over the exception in flight); no write outlives ``fit``."""
        failure = self._writer.finish() if self._writer is not None else None
        if failure is not None:
            warnings.warn(f"{type(failure).__name__}: {failure}", RuntimeWarning, stacklevel=2)

    def wait(self) -> None:
        """Wait for the file being written in the background; raise if writing it failed."""
        if self._writer is not None:
            self._writer.wait()

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        every = self.save_freq
        if isinstance(every, str):  # "epoch"
            return
        self._batches_since_save += 1
        if self._batches_since_save >= every:
            self._batches_since_save = 0
            self._save(self._epoch, step, logs or {})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, None, logs or {})

    # -- internals ---------------------------------------------------------------------------------
    def _format_path(self, epoch: int, batch: int | None, logs: Logs) -> str:
        fields: dict[str, Any] = {name: value for name, value in logs.items() if name != "size"}
        fields["epoch"] = epoch + 1
        fields["global_step"] = self.trainer.global_step
        if batch is not None:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except (KeyError, IndexError) as exc:
            raise KeyError(
                f"ModelCheckpoint could not fill filepath={self.filepath!r}: field {exc} is not available "
                f"here. Available fields: {sorted(fields)}"
            ) from exc

    def _state(self, epoch: int) -> Any:
        trainer = self.trainer
        # Collective where the strategy's state is: every rank takes part, the chief writes.
        model_state = trainer.strategy.full_state_dict(trainer.model)
        if self.save_weights_only:
            return model_state
        optimizer_state = trainer.strategy.full_state_dict(trainer.optimizer)
        schedule = trainer.schedule_state_dict()
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "epoch": epoch,
            "global_step": self.trainer.global_step,
            **schedule,
        }

    # -- the callback's own state (resumed with the Trainer's) --------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The best value so far and the batches since the last save: after a resume,
        ``save_best_only`` does not overwrite the best file with a worse model."""
        return {"best": self.best, "batches_since_save": self._batches_since_save}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best = float(state["best"])
        self._batches_since_save = int(state["batches_since_save"])

    def _warn_missing(self, logs: Logs) -> None:
        if self._warned_missing:
            return
        self._warned_missing = True
        available = sorted(k for k in logs if k != "size")
        warnings.warn(
            f"ModelCheckpoint(save_best_only=True) monitors `{self.monitor}`, which is not in the logs "
            f"(available: {available}); skipping best-only saves until it appears.",
            stacklevel=4,
        )

    def _save(self, epoch: int, batch: int | None, logs: Logs) -> None:
        if self.save_best_only:
            current = as_float(logs.get(self.monitor))
            if current is None:
                self._warn_missing(logs)
                return
            if not self._better(current, self.best):
                if self.verbose and self.trainer.is_chief:
                    print(
                        f"epoch {epoch + 1}: {self.monitor} did not improve from {self.best:.5f}",
                        file=sys.stdout,
                        flush=True,
                    )
                return
            path = self._format_path(epoch, batch, logs)
            self._write(self._state(epoch), path)
            # Only after the write: a failed save must not raise the bar for the next one.
            previous, self.best = self.best, current
            if self.verbose and self.trainer.is_chief:
                print(
                    f"epoch {epoch + 1}: {self.monitor} improved from {previous:.5f} to {current:.5f}, "
                    f"saved {path}",
                    file=sys.stdout,
                    flush=True,
                )
            return
        path = self._format_path(epoch, batch, logs)
        self._write(self._state(epoch), path)
        if self.verbose and self.trainer.is_chief:
            print(f"epoch {epoch + 1}: saved {path}", file=sys.stdout, flush=True)

    def _write(self, state: Any, path: str) -> None:
        if not self.trainer.is_chief:
            return
        write = write_safetensors if path.endswith(SAFETENSORS_SUFFIX) else None
        if not self.async_save:
            atomic_save(state, path, write)
            self.saved.append(path)
            return
        if self._writer is None:
            self._writer = BackgroundWriter("model-checkpoint")

        def write_file(copy: Any) -> None:
            atomic_save(copy, path, write)
            self.saved.append(path)

        self._writer.submit(state, write_file, path)
