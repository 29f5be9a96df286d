"""Check that processes a test started indirectly (through ``spread run``, torchrun) are gone.

Ranks started by a launcher are the test's grandchildren, so the suite's own leftover-children check
cannot see them; tests that kill ranks on purpose record their pids and call :func:`reap_survivors`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from spread.testing.time_budget import budget


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


@dataclass
class SpreadRun:
    """What ``spread run`` of a test script did: exit code, output, and its ``RESULT <json>`` line."""

    returncode: int
    log: str  # stdout then stderr
    result: Any  # the JSON after the first "RESULT " on stdout, or None


def spread_run(
    script: Path, nproc: int, *args: str, timeout: float = 240.0, flags: tuple[str, ...] = ()
) -> SpreadRun:
    """Run ``spread run -n nproc script args...`` as a user would (no inherited rank variables,
    one intra-op thread per rank, a 20 s collective timeout), under a hard ``timeout`` (an idle
    machine's: stretched by :func:`spread.testing.time_budget.time_scale`). ``flags`` go to
    ``spread run`` itself (``--recover``)."""
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", SPREAD_COLLECTIVE_TIMEOUT="20")
    spread_bin = str(Path(sys.executable).parent / "spread")
    out = subprocess.run(
        [spread_bin, "run", "-n", str(nproc), *flags, str(script), *args],
        capture_output=True,
        text=True,
        timeout=budget(timeout),
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if "RESULT " in line]
    result = json.loads(lines[0].split("RESULT ", 1)[1]) if lines else None
    return SpreadRun(out.returncode, out.stdout + out.stderr, result)
