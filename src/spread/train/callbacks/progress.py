"""ProgressBar: what the chief prints while ``fit`` runs, shaped like Keras's progress bar.

``verbose=1`` with a person watching a terminal: one live bar per epoch (tqdm), redrawn in place,
which ends as the epoch's summary with the validation metrics::

    epoch 2/5  7/12 |███████████▋        | ETA 00:02  loss 0.1234  accuracy 0.9612  1534 samples/s
    epoch 2/5  12/12 |████████████████████| 3.1s 258ms/step  loss 0.1187  val_loss 0.2001  1534 samples/s

Without a terminal (CI logs, files) a redrawn bar would be a wall of carriage returns, so
``verbose=1`` prints the summary line alone, once per epoch (plus one line every ``log_every`` steps
when asked). ``verbose=2`` prints the summary line alone even on a terminal; ``verbose=0`` nothing.

"A terminal": stdout is one, or it is the pipe through which ``spread run`` relays this rank's
output to a terminal (the launcher then exports ``SPREAD_STDOUT_TTY=1`` and redraws the bar's
carriage-return frames in place under the rank's ``[rank 0]`` tag). The callback is chief-only, so
the other ranks print no progress at all.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from typing import IO, Any

from tqdm import tqdm

from spread import env
from spread.train.callbacks._monitor import invalid
from spread.train.callbacks.base import Callback, Logs

# Set to "1" by `spread run` (spread.cluster.launcher) when its own stdout, to which it relays every
# rank's stdout, is a terminal.
RELAYED_TERMINAL_ENV = env.STDOUT_TTY
# Columns a relayed bar leaves for the launcher's tag ("[rank 0] ", "[chief] "), so a frame never
# wraps (a wrapped frame cannot be redrawn in place).
_RELAY_TAG_COLUMNS = 12
_FALLBACK_COLUMNS = 80  # where the width cannot be known


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def _window_columns(stream: IO[str]) -> int:
    """The terminal window's width, or 0 where it reports none."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 0


def _is_relayed_to_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is this process's fd 1 and ``spread run`` relays fd 1 to a terminal."""
    if os.environ.get(RELAYED_TERMINAL_ENV) != "1":
        return False
    try:
        return stream.fileno() == 1
    except (AttributeError, ValueError, OSError):  # StringIO, a closed stream: not the relayed pipe
        return False


def _format_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if hasattr(value, "item"):  # 0-d tensor or numpy scalar
            value = value.item()
        else:
            return str(value)
    if isinstance(value, int):
        return str(value)
    # Fixed point reads best, but would print tiny losses as 0.0000.
    return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 or not math.isfinite(value) else f"{value:.4e}"


def format_logs(logs: Logs) -> str:
    """``"loss 0.1234  accuracy 0.9612"``: every log except the batch ``size`` and the ``timing/``
    figures (for History, TensorBoard and trackers; a straggler is named on its own line), in order."""
    return "  ".join(
        f"{name} {_format_value(value)}"
        for name, value in logs.items()
        if name != "size" and not name.startswith("timing/")
    )


def _per_step(seconds: float) -> str:
    """``258ms/step``, ``1.2s/step``, ``85us/step``: Keras's time per step."""
    if seconds >= 1:
        return f"{seconds:.1f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


class _EpochBar(tqdm):
    """A tqdm bar whose text after the bar (``{metrics}`` in ``bar_format``) the callback sets.

    tqdm documents overriding ``format_dict`` to show custom fields; the monitor thread is off (it
    only tunes ``miniters``, and a training process should not gain a thread for a progress bar).
    """

    monitor_interval = 0
    metrics = ""

    @property
    def format_dict(self) -> dict[str, Any]:
        return {**super().format_dict, "metrics": self.metrics}


# While an epoch runs (steps known, or not), and once it ended: the bar full, then the summary. The bar
# is 20 columns wide, as Keras's.
_RUNNING = "{desc}  {n_fmt}/{total_fmt} |{bar:20}| ETA {remaining}  {metrics}"
_RUNNING_UNKNOWN_TOTAL = "{desc}  {n_fmt}  {elapsed}  {metrics}"
_ENDED = "{desc}  {n_fmt}/{total_fmt} |{bar:20}| {metrics}"


class ProgressBar(Callback):
    """Prints training progress on the chief, like Keras's ``verbose`` argument.

    Args:
        verbose: 0 prints nothing; 1 a live bar per epoch on a terminal, else one line per epoch;
            2 one line per epoch, even on a terminal.
        log_every: when no bar is drawn, also print a line every this many steps (with the step,
            ETA and running metrics); default: none, one line per epoch.
    """

    chief_only = True

    def __init__(self, verbose: int = 1, log_every: int | None = None) -> None:
        super().__init__()
        if verbose not in (0, 1, 2) or isinstance(verbose, bool):
            raise invalid("verbose", verbose, "0, 1 or 2")
        if log_every is not None and (
            not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 1
        ):
            raise invalid("log_every", log_every, "None or a positive integer")
        self.verbose = verbose
        self.log_every = log_every
        self._bar: _EpochBar | None = None
        self._draw_bar = False
        self._epoch_start = 0.0
        self._last_batch_end = 0.0
        self._samples = 0
        self._steps_done = 0
        self._epoch = 0

    # -- text ---------------------------------------------------------------------------------------
    def _params(self) -> tuple[int | None, int | None]:
        params = self.trainer.params
        return params.get("epochs"), params.get("steps")

    def _epoch_name(self, epoch: int) -> str:
        epochs, _ = self._params()
        return f"epoch {epoch + 1}/{epochs}" if epochs else f"epoch {epoch + 1}"

    def _progress(self) -> str:
        _, steps = self._params()
        return f"{self._steps_done}/{steps}" if steps else f"{self._steps_done}"

    def _samples_per_second(self) -> str:
        elapsed = self._last_batch_end - self._epoch_start
        return f"{self._samples / elapsed if elapsed > 0 else 0.0:.0f} samples/s"

    def _running_text(self, logs: Logs) -> str:
        return "  ".join(part for part in (format_logs(logs), self._samples_per_second()) if part)

    def _summary_text(self, logs: Logs) -> str:
        """``3.1s 258ms/step  loss ...  val_loss ...  1534 samples/s``: what the epoch's line ends with."""
        elapsed = time.perf_counter() - self._epoch_start  # validation included, as in Keras
        train_seconds = self._last_batch_end - self._epoch_start
        timing = f"{elapsed:.1f}s"
        if self._steps_done:
            timing += f" {_per_step(train_seconds / self._steps_done)}"
        return f"{timing}  {self._running_text(logs)}"

    @staticmethod
    def _print(line: str) -> None:
        # Resolved at call time so redirected or captured stdout is honoured; flushed so piped
        # output appears as it happens instead of when a buffer fills. One write with its newline:
        # ``print`` writes the line and its end apart, and `spread run` on a terminal draws a line
        # that ends the bar's frames without a newline yet as one more frame (the epoch's ~150
        # characters twice, the first copy cut to the terminal's width).
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    # -- hooks --------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._draw_bar = self.verbose == 1 and (_is_tty(sys.stdout) or _is_relayed_to_terminal(sys.stdout))

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch
        self._epoch_start = self._last_batch_end = time.perf_counter()
        self._samples = 0
        self._steps_done = 0
        if self._draw_bar:
            self._bar = self._open_bar(epoch)

    def _open_bar(self, epoch: int) -> _EpochBar:
        _, steps = self._params()
        width: dict[str, Any]
        if _is_tty(sys.stdout) and _window_columns(sys.stdout):
            width = {"dynamic_ncols": True}  # follows the window as it is resized
        elif _is_tty(sys.stdout):  # a terminal that reports no size (some CI pseudo-terminals)
            width = {"ncols": _FALLBACK_COLUMNS}
        else:  # relayed by `spread run`: COLUMNS when the launcher exports it, less the rank's tag
            columns = shutil.get_terminal_size((_FALLBACK_COLUMNS, 24)).columns
            width = {"ncols": max(_FALLBACK_COLUMNS // 2, columns - _RELAY_TAG_COLUMNS)}
        return _EpochBar(
            total=steps,
            desc=self._epoch_name(epoch),
            unit="step",
            file=sys.stdout,
            bar_format=_RUNNING if steps else _RUNNING_UNKNOWN_TOTAL,
            leave=False,  # the epoch's line replaces it (on_epoch_end)
            **width,
        )

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        if self.verbose == 0:
            return
        logs = logs or {}
        self._last_batch_end = time.perf_counter()
        self._samples += int(logs.get("size", 0))
        self._steps_done = step + 1
        if self._bar is not None:
            self._bar.metrics = self._running_text(logs)
            self._bar.update(1)  # redraws at most every tqdm's mininterval (0.1 s)
            return
        _, steps = self._params()
        # The epoch's line covers its last step; printing that step twice is noise.
        if self.log_every and self._steps_done % self.log_every == 0 and self._steps_done != steps:
            parts = [self._epoch_name(self._epoch), self._progress()]
            if steps:
                per_step = (self._last_batch_end - self._epoch_start) / self._steps_done
                parts.append(f"ETA {per_step * (steps - self._steps_done):.1f}s")
            self._print("  ".join([*parts, self._running_text(logs)]))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.verbose == 0:
            return
        logs = logs or {}
        summary = self._summary_text(logs)
        line = f"{self._epoch_name(epoch)}  {self._progress()}  {summary}"
        if self._bar is not None:
            # The bar gives way to the epoch's summary with the bar full: printed as a line of its
            # own, not as a frame, so that a long summary (validation metrics) wraps instead of being
            # cut at the terminal's width.
            bar, self._bar = self._bar, None
            line = bar.format_meter(
                bar.n, bar.n, 0, prefix=bar.desc, ascii=bar.ascii, bar_format=_ENDED, metrics=summary
            )
            bar.close()  # leave=False: clears the line
        self._print(line)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._bar is not None:  # stopped mid-epoch
            self._bar.close()
            self._bar = None
