"""The allocator settings spread gives its processes: who wins, how to turn them off, and that
``mallopt`` really moves a large block from fresh pages to the heap."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from spread.cluster.allocator import tune_child_environment, tuning_wanted

TUNED = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "67108864"}


def test_a_child_gets_both_thresholds() -> None:
    environ = {"PATH": "/bin"}
    tune_child_environment(environ)
    assert environ == {"PATH": "/bin", **TUNED}


@pytest.mark.parametrize("name", sorted(TUNED))
def test_a_threshold_the_user_set_wins_and_spread_sets_neither(name: str) -> None:
    environ = {name: "131072"}
    tune_child_environment(environ)
    assert environ == {name: "131072"}


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_turned_off(value: str) -> None:
    environ = {"SPREAD_TUNE_MALLOC": value}
    tune_child_environment(environ)
    assert environ == {"SPREAD_TUNE_MALLOC": value}
    assert tuning_wanted({"SPREAD_TUNE_MALLOC": "1"})


# A fresh interpreter allocates a 16 MB block and reports whether glibc served it with its own
# mapping (mallinfo2's hblks: blocks above the mmap threshold) or from the heap.
_PROBE = """
import ctypes, json, sys
from spread.cluster.allocator import tune_this_process
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
tuned = tune_this_process()
before = libc.mallinfo2().hblks
block = bytearray(16 * 2**20)
print(json.dumps({"tuned": tuned, "mapped": libc.mallinfo2().hblks - before}))
"""


@pytest.mark.processes
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
@pytest.mark.parametrize("switch, tuned, mapped", [("1", True, 0), ("0", False, 1)])
def test_a_16_mb_block_stays_on_the_heap_once_tuned(switch: str, tuned: bool, mapped: int) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in TUNED} | {"SPREAD_TUNE_MALLOC": switch}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, env=environ, timeout=60, check=True
    )
    assert json.loads(done.stdout) == {"tuned": tuned, "mapped": mapped}
