"""TensorBoard: write the logs as TensorBoard scalars through ``torch.utils.tensorboard``.

``tensorboard`` is an optional dependency (``pip install tensorboard`` or ``spread[tensorboard]``),
so it is imported only when this callback is built, and a missing package is reported then, before
training starts, rather than after the first epoch.

Scalars: ``epoch/<name>`` for every epoch log (step = 0-based epoch), and, with an integer
``update_freq``, ``batch/<name>`` for the running train logs every ``update_freq`` batches (step =
``trainer.global_step``, the number of optimizer steps taken).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from spread.train.callbacks._monitor import as_float, check_freq, invalid
from spread.train.callbacks.base import Callback, Logs


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "The TensorBoard callback needs the `tensorboard` package, which is not installed. "
            "Install it with `pip install tensorboard` (or `pip install spread[tensorboard]`)."
        ) from exc
    return SummaryWriter


class TensorBoard(Callback):
    """Logs scalars for TensorBoard under ``log_dir`` (on the chief).

    Args:
        log_dir: directory for the event files (created if needed); view with
            ``tensorboard --logdir <log_dir>``.
        update_freq: ``"epoch"`` writes epoch scalars only; an integer N also writes the running train
            logs every N batches.
    """

    chief_only = True

    def __init__(self, log_dir: str | os.PathLike[str] = "logs", update_freq: str | int = "epoch") -> None:
        super().__init__()
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise invalid("log_dir", log_dir, "a non-empty path")
        self.log_dir = os.fspath(log_dir)
        self.update_freq = check_freq("update_freq", update_freq)
        self._writer_class = _summary_writer_class()
        self.writer: Any = None
        self._batches_since_write = 0

    def _add_scalars(self, prefix: str, logs: Logs, step: int) -> None:
        for name, value in logs.items():
            number = as_float(value)
            if name == "size" or number is None:
                continue
            self.writer.add_scalar(f"{prefix}/{name}", number, step)

    def on_train_begin(self, logs: Logs | None = None) -> None:
        if self.writer is None:
            self.writer = self._writer_class(log_dir=self.log_dir)
        self._batches_since_write = 0

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        every = self.update_freq
        if isinstance(every, str) or self.writer is None:  # "epoch"
            return
        self._batches_since_write += 1
        if self._batches_since_write >= every:
            self._batches_since_write = 0
            self._add_scalars("batch", logs or {}, self.trainer.global_step)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.writer is None:
            self.on_train_begin()
        self._add_scalars("epoch", logs or {}, epoch)
        # Flushed per epoch so TensorBoard shows progress live and a crash loses at most one epoch.
        self.writer.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def state_dict(self) -> dict[str, Any]:
        """Batches since the last batch-level write: a resumed fit writes on the same steps."""
        return {"batches_since_write": self._batches_since_write}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._batches_since_write = int(state["batches_since_write"])
