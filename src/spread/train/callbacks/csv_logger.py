"""CSVLogger: one CSV row per epoch (``epoch`` then the logs), for spreadsheets and pandas.

Columns are fixed when the first row is written (or read from the header of the file being appended
to), because a CSV cannot grow columns afterwards: a log missing from a later epoch is written as an
empty cell, and a log that first appears later is left out, with one warning naming it. Each row is
flushed, so the file is readable while training runs and complete up to the last epoch on a crash.
``epoch`` is the 0-based index, as in Keras's CSVLogger and ``History.epoch``.

Resumed by ``BackupAndRestore``, the logger keeps the file's lines up to the backup (its state is
how many lines the file had then) and appends after them: the file ends as the uninterrupted run's,
never truncated by the restart and without the rows of epochs trained again.
"""

from __future__ import annotations

import csv
import os
import warnings
from collections.abc import Mapping
from typing import IO, Any

from spread.checkpoint.atomic import atomic_save
from spread.train.callbacks._monitor import invalid
from spread.train.callbacks.base import Callback, Logs


def _cell(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


class CSVLogger(Callback):
    """Appends one row per epoch to ``filename`` (on the chief).

    Args:
        filename: the CSV file; its directory is created if needed.
        separator: the field delimiter (one character).
        append: add to an existing file (keeping its columns) instead of overwriting it.
    """

    chief_only = True

    def __init__(self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False) -> None:
        super().__init__()
        if not isinstance(filename, (str, os.PathLike)) or not os.fspath(filename):
            raise invalid("filename", filename, "a non-empty path")
        if not isinstance(separator, str) or len(separator) != 1:
            raise invalid("separator", separator, "a single character")
        self.filename = os.fspath(filename)
        self.separator = separator
        self.append = bool(append)
        self.keys: list[str] | None = None
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._warned: set[str] = set()
        self._lines = 0  # lines the file holds (header included), as this logger wrote or found them
        self._resume_lines: int | None = None  # a restored state: keep that many lines, append after

    def _existing_header(self) -> list[str] | None:
        try:
            with open(self.filename, newline="") as f:
                header = next(csv.reader(f, delimiter=self.separator), None)
        except FileNotFoundError:
            return None
        return header or None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self.keys = None
        self._resume_lines = None
        if self._file is not None:
            self._file.close()
        self._file = self._writer = None  # opened at the first row, once a restored state is known

    def _open(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.filename))
        os.makedirs(directory, exist_ok=True)
        if self._resume_lines is not None:
            try:
                with open(self.filename, newline="") as f:
                    kept = f.readlines()[: self._resume_lines]
            except FileNotFoundError:
                kept = []
            atomic_save("".join(kept).encode(), self.filename, lambda data, f: f.write(data))
            self._lines = len(kept)
        elif self.append:
            try:
                with open(self.filename, newline="") as f:
                    self._lines = sum(1 for _ in f)
            except FileNotFoundError:
                self._lines = 0
        else:
            self._lines = 0
        header = self._existing_header() if self._lines else None
        if header is not None:
            self.keys = [k for k in header if k != "epoch"]
        mode = "a" if self._lines else "w"
        self._file = open(self.filename, mode, newline="")  # noqa: SIM115 (closed on train end)
        self._writer = csv.writer(self._file, delimiter=self.separator)

    def state_dict(self) -> dict[str, Any]:
        """How many lines the file holds now: a resumed fit keeps those and appends after them."""
        return {"lines": self._lines}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._resume_lines = int(state["lines"])

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self._writer is None or self._file is None:
            self._open()
        assert self._file is not None
        logs = {k: v for k, v in (logs or {}).items() if k != "size"}
        if self.keys is None:
            self.keys = sorted(logs)
            self._writer.writerow(["epoch", *self.keys])
            self._lines += 1
        dropped = sorted(set(logs) - set(self.keys) - self._warned)
        if dropped:
            self._warned.update(dropped)
            warnings.warn(
                f"CSVLogger: logs {dropped} appeared after the columns of {self.filename!r} were fixed "
                f"({self.keys}); they are not written.",
                stacklevel=2,
            )
        self._writer.writerow([epoch, *(_cell(logs[k]) if k in logs else "" for k in self.keys)])
        self._lines += 1
        self._file.flush()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._writer = None
