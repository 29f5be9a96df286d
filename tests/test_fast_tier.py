"""The fast tier (``scripts/test.sh --fast``) refuses a process started by a test not marked for it."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conftest


def test_starting_a_process_in_the_fast_tier_fails_naming_the_mark():
    if not conftest.FAST_TIER:
        pytest.skip("checks the fast tier's guard; run by the test below under SPREAD_TEST_FAST=1")
    with pytest.raises(RuntimeError, match=r"not marked pytest\.mark\.processes"):
        subprocess.run([sys.executable, "-c", "pass"], check=False, timeout=60)
    with pytest.raises(RuntimeError, match=r"not marked pytest\.mark\.processes"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(RuntimeError, match=r"not marked pytest\.mark\.processes"):
        os.fork()


GUARD_TEST = test_starting_a_process_in_the_fast_tier_fails_naming_the_mark.__name__


@pytest.mark.processes
def test_the_guard_is_installed_in_the_fast_tier_only():
    here = Path(__file__)
    env = {**os.environ, "SPREAD_TEST_FAST": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{here}::{GUARD_TEST}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=here.parent.parent,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout + result.stderr
    assert not conftest.FAST_TIER  # this test runs in the full suite, where nothing is refused
