"""A machine busy with other work is named in the plan (its measured times are too slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spread.plan.machine_load import busy_cores_elsewhere, load_warning


def test_a_quiet_machine_gets_no_warning_and_a_busy_one_is_named():
    assert load_warning(0.1, 2) is None
    assert load_warning(0.25, 16) is None  # under 0.3 of a core anywhere
    warning = load_warning(1.5, 2)
    assert warning is not None and "1.5 of 2 cores busy" in warning and "by up to 4.0x" in warning
    assert "rerun `spread plan` on a quiet machine" in warning


@pytest.mark.processes
def test_a_process_spinning_on_one_core_is_counted():
    spin = "import time\nend = time.time() + 20\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        busy = busy_cores_elsewhere(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy >= 0.6, busy
