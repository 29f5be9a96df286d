"""The glibc allocator settings of the processes spread starts (``spread run``'s ranks, ``spread plan``).

glibc serves a block above its mmap threshold (128 KB at first) with fresh pages and unmaps it when
freed; it raises the threshold only when such a block is freed, and trims the heap back to the OS.
A training step frees megabytes of activations and re-allocates them in the next step, so a process
whose threshold has not yet climbed page-faults its activations in again every step, and which state
a process is in depends on its history. Measured on a 2-core VM: one LSTM step at one thread, 57-60 ms
in a fresh process, 45 after a few steps at two threads; whole two-process MultiWorkerMirrored jobs
17-21% faster with the settings below (docs/results/2026-11-27-planner-passes.md).

Spread fixes the thresholds from the first allocation at the values glibc's own adjustment ends at
on 64-bit (mmap threshold 32 MB, its ``DEFAULT_MMAP_THRESHOLD_MAX``; trim threshold twice that), as
``torch.backends.xeon.run_cpu`` preloads tcmalloc or jemalloc for the same reason. A user's own
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` wins (spread then sets neither), and
``SPREAD_TUNE_MALLOC=0`` turns this off. Other C libraries ignore the variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Mapping, MutableMapping

from spread import env as spread_env

MMAP_THRESHOLD_BYTES = 32 * 2**20
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
_VARIABLES = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD_BYTES}
# mallopt(3) parameter numbers, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tuning_wanted(environ: Mapping[str, str]) -> bool:
    """Whether spread sets the allocator here: not turned off, and the user set neither threshold."""
    if environ.get(spread_env.TUNE_MALLOC, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return not any(name in environ for name in _VARIABLES)


def tune_child_environment(environ: MutableMapping[str, str]) -> None:
    """Add the thresholds to the environment of a process about to start (glibc reads them at start)."""
    if tuning_wanted(environ):
        environ.update({name: str(value) for name, value in _VARIABLES.items()})


def tune_this_process() -> bool:
    """Set the same thresholds in this running process (``mallopt``); later allocations follow them.

    Returns whether they were set: False when turned off, set by the user, or not glibc.
    """
    if not tuning_wanted(os.environ) or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success; setting M_MMAP_THRESHOLD also stops glibc's own adjustment
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
