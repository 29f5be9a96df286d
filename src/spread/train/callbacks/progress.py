"""ProgressBar: what the chief prints while ``fit`` runs.

On a terminal a tqdm bar per epoch shows the step, the running loss and metrics, samples/s and
tqdm's ETA. When stdout is not a terminal (CI logs, ``spread run`` piping every rank's output) a
redrawn bar turns into a wall of carriage returns, so the callback prints plain lines instead: one
every ``log_every`` steps and one summary per epoch, e.g.::

    epoch 2/5  step 12/12  loss 0.1234  accuracy 0.9612  val_loss 0.2001  1534 samples/s  3.1s
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any

from spread.train.callbacks._monitor import invalid
from spread.train.callbacks.base import Callback, Logs

# Plain-line mode aims at about this many progress lines per epoch when log_every is not given.
_LINES_PER_EPOCH = 4
# ... and prints every this many steps when the epoch length is unknown (iterable datasets).
_DEFAULT_LOG_EVERY_UNKNOWN_STEPS = 50


def _is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
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
    """``"loss 0.1234  accuracy 0.9612"``: every log except the batch ``size``, in the given order."""
    return "  ".join(f"{name} {_format_value(value)}" for name, value in logs.items() if name != "size")


class ProgressBar(Callback):
    """Prints training progress on the chief.

    Args:
        verbose: 0 prints nothing; 1 a bar on a terminal, else plain lines every ``log_every`` steps
            plus a summary per epoch; 2 only the summary line per epoch.
        log_every: steps between plain lines (not-a-terminal mode); default: about
            ten lines per epoch, or every 50 steps when the epoch length is unknown.
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
        self._bar: Any = None
        self._dynamic = False
        self._epoch_start = 0.0
        self._last_batch_end = 0.0
        self._samples = 0
        self._steps_done = 0
        self._epoch = 0

    # -- helpers -----------------------------------------------------------------------------------
    def _params(self) -> tuple[int | None, int | None]:
        params = getattr(self.trainer, "params", None) or {}
        return params.get("epochs"), params.get("steps")

    def _resolved_log_every(self, steps: int | None) -> int:
        if self.log_every is not None:
            return self.log_every
        if steps is None:
            return _DEFAULT_LOG_EVERY_UNKNOWN_STEPS
        return max(1, math.ceil(steps / _LINES_PER_EPOCH))

    def _samples_per_second(self) -> float:
        elapsed = self._last_batch_end - self._epoch_start
        return self._samples / elapsed if elapsed > 0 else 0.0

    def _line(self, epoch: int, logs: Logs, extra: str = "") -> str:
        epochs, steps = self._params()
        parts = [
            f"epoch {epoch + 1}/{epochs}" if epochs else f"epoch {epoch + 1}",
            f"step {self._steps_done}/{steps}" if steps else f"step {self._steps_done}",
        ]
        metrics = format_logs(logs)
        if metrics:
            parts.append(metrics)
        parts.append(f"{self._samples_per_second():.0f} samples/s")
        if not extra and steps and 0 < self._steps_done < steps:
            per_step = (time.perf_counter() - self._epoch_start) / self._steps_done
            parts.append(f"ETA {per_step * (steps - self._steps_done):.1f}s")
        if extra:
            parts.append(extra)
        return "  ".join(parts)

    @staticmethod
    def _print(line: str) -> None:
        # Resolved at call time so redirected or captured stdout is honoured; flushed so piped
        # output appears as it happens instead of when a buffer fills.
        print(line, file=sys.stdout, flush=True)

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._dynamic = self.verbose == 1 and _is_tty(sys.stdout)

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch
        self._epoch_start = self._last_batch_end = time.perf_counter()
        self._samples = 0
        self._steps_done = 0
        if self._dynamic:
            from tqdm.auto import tqdm

            epochs, steps = self._params()
            self._bar = tqdm(
                total=steps,
                desc=f"epoch {epoch + 1}/{epochs}" if epochs else f"epoch {epoch + 1}",
                unit="step",
                file=sys.stdout,
                dynamic_ncols=True,
                leave=True,
            )

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        if self.verbose == 0:
            return
        logs = logs or {}
        self._last_batch_end = time.perf_counter()
        self._samples += int(logs.get("size", 0))
        self._steps_done = step + 1
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"{format_logs(logs)}  {self._samples_per_second():.0f} samples/s", refresh=False
            )
            self._bar.update(1)
            return
        if self.verbose != 1:
            return
        _, steps = self._params()
        # The epoch summary line covers the last step; printing it twice is noise.
        if self._steps_done % self._resolved_log_every(steps) == 0 and self._steps_done != steps:
            self._print(self._line(self._epoch, logs))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.verbose == 0:
            return
        logs = logs or {}
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"{format_logs(logs)}  {self._samples_per_second():.0f} samples/s", refresh=True
            )
            self._bar.close()
            self._bar = None
            return
        elapsed = time.perf_counter() - self._epoch_start
        self._print(self._line(epoch, logs, extra=f"{elapsed:.1f}s"))

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._bar is not None:  # stopped mid-epoch
            self._bar.close()
            self._bar = None
