"""The script-job harness reports a hang as a hang, with the stacks that show where it waited."""

from __future__ import annotations

import pytest

from spread.testing.processes import process_alive
from spread.testing.ps_jobs import run_ps_script

pytestmark = pytest.mark.processes


def test_a_task_still_running_at_the_deadline_is_reported_with_its_stacks(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text("import time\n\ndef wait_forever():\n    time.sleep(600)\n\nwait_forever()\n")
    runs = run_ps_script(script, 1, 1, timeout=3.0)
    assert [r.returncode for r in runs] == [None, None]
    for run in runs:
        assert not process_alive(run.pid)
        assert "still running at the deadline" in run.describe()
        assert "in wait_forever" in run.stderr, run.stderr  # faulthandler's dump of the main thread


def test_tasks_that_end_keep_their_exit_codes(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text(
        "import json, os, sys\n"
        "sys.exit(3 if json.loads(os.environ['TF_CONFIG'])['task']['type'] == 'ps' else 0)\n"
    )
    runs = run_ps_script(script, 1, 1, timeout=60.0)
    assert [r.returncode for r in runs] == [0, 3]
    assert all("Fatal Python error" not in r.stderr for r in runs)
