"""Preemption: SIGTERM becomes "save at the next step boundary and exit", not a lost step range.

Cloud schedulers and Kubernetes send SIGTERM some seconds before they kill a machine (``spread run``
forwards the one it gets to every rank; ``--kill-grace`` is the time it then allows). While a
``fit`` with :class:`~spread.callbacks.BackupAndRestore` runs, :class:`PreemptionWatch` turns SIGTERM
into a flag. After every optimizer step the ranks agree whether any of them was signalled (one
small collective: ranks are signalled at slightly different moments, and all must stop at the same
step); if so the callback writes a backup of that step and :class:`TrainingPreempted` ends the
process with exit code 143 (128 + SIGTERM: "terminated", so schedulers restart the job rather than
count it as done) and no traceback. At most the step in flight is lost; the next ``fit`` resumes at
that step, at this world size or another. A SIGTERM during a backup's write lets it finish first.

The handler is installed on the main thread only (Python delivers signals there) and the previous
one is put back when ``fit`` ends, however it ends.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class TrainingPreempted(SystemExit):
    """Raised on every rank after the preemption backup: ends the process with exit code 143 and no
    traceback (``SystemExit``), unless the script catches it."""

    def __init__(self, step: int, backup_dir: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step = step
        self.backup_dir = backup_dir

    def __str__(self) -> str:
        return f"preempted (SIGTERM): backed up step {self.step} to {self.backup_dir}; exiting"


class PreemptionWatch:
    """SIGTERM sets :attr:`requested` instead of ending the process, between :meth:`start` and
    :meth:`stop` (a no-op off the main thread, where Python cannot install handlers)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    @property
    def installed(self) -> bool:
        return self._installed

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def start(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def acknowledge(self) -> None:
        """The request was acted on (the backup is written): :meth:`stop` must not re-deliver it."""
        self.requested = False

    def stop(self) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False
        if self.requested:  # a SIGTERM that came too late for a step boundary still ends the process
            signal.raise_signal(signal.SIGTERM)
