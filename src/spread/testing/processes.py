"""Check that processes a test started indirectly (through ``spread run``, torchrun) are gone.

Ranks started by a launcher are the test's grandchildren, so the suite's own leftover-children check
cannot see them; tests that kill ranks on purpose record their pids and call :func:`reap_survivors`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

import psutil


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap_survivors(pids: Iterable[int], timeout: float = 10.0) -> list[int]:
    """Wait up to ``timeout`` for every pid to end; SIGKILL and return those that did not.

    Survivors are killed so they do not leak into the next test; the caller still fails on them.
    """
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if process_alive(p)]
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return survivors
