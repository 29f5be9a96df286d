"""A parameter-server job ends by itself, however its script ends (TensorFlow's examples close
nothing): every process exits, 0 and without a traceback when the script returns, calls
``sys.exit(0)`` or ``close()``; a task whose script raises exits non-zero and is named, and the
others still end. Each job is one plain ``python script`` process per task with a TF_CONFIG and no
launcher, so nobody but the library itself can stop the servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spread.testing.processes import process_alive
from spread.testing.ps_jobs import TaskRun, run_ps_script

pytestmark = pytest.mark.processes

SCRIPTS = Path(__file__).parent / "scripts"
TIMEOUT = 150.0  # a hang shows up as processes killed at this deadline (returncode None)


def _assert_clean(run: TaskRun) -> None:
    assert run.returncode == 0, run.describe()
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.describe()


def _assert_all_gone(runs: list[TaskRun]) -> None:
    assert all(r.returncode is not None for r in runs), "\n".join(r.describe() for r in runs)
    assert not [r.pid for r in runs if process_alive(r.pid)]


def _endings(**by_task: str) -> dict[str, str]:
    return {"SPREAD_TEST_ENDINGS": json.dumps({k.replace("_", " "): v for k, v in by_task.items()})}


def test_fit_job_that_closes_nothing_ends_by_itself():
    """chief 0 returns, worker 0 calls sys.exit(0), worker 1 calls close(): all three in one job."""
    runs = run_ps_script(
        SCRIPTS / "fit_ending.py", 3, 2, env=_endings(worker_0="exit", worker_1="close"), timeout=TIMEOUT
    )
    _assert_all_gone(runs)
    for run in runs:
        _assert_clean(run)
    assert [r.stdout.strip() for r in runs[:3]] == ["trained chief 0", "trained worker 0", "trained worker 1"]
    print(f"fit job without close: every task ended after {max(r.seconds for r in runs):.1f}s")


def test_fit_job_where_a_worker_raises_names_it_and_still_ends():
    runs = run_ps_script(SCRIPTS / "fit_ending.py", 3, 2, env=_endings(worker_1="raise"), timeout=TIMEOUT)
    _assert_all_gone(runs)
    chief, worker0, worker1, *servers = runs
    assert worker1.returncode == 1 and "ValueError: worker 1 failed on purpose" in worker1.stderr
    for run in (chief, worker0, *servers):
        _assert_clean(run)
    assert "training task(s) of rank(s) [2] ended with an error" in chief.stderr


def test_fit_job_where_the_chief_raises_ends_with_the_servers_stopped():
    # A worker that starts late (a loaded machine) finds the servers already stopped and waits for
    # them to come up until the init deadline, then fails naming them: 40 s here instead of 120 s.
    env = {**_endings(chief_0="raise"), "SPREAD_INIT_TIMEOUT": "40"}
    runs = run_ps_script(SCRIPTS / "fit_ending.py", 3, 2, env=env, timeout=TIMEOUT)
    _assert_all_gone(runs)
    chief, *workers, ps0, ps1 = runs
    assert chief.returncode == 1 and "ValueError: chief 0 failed on purpose" in chief.stderr
    _assert_clean(ps0)
    _assert_clean(ps1)
    for worker in workers:  # finished first, or told clearly that the servers are gone
        assert worker.returncode == 0 or "ParameterServerError: parameter server" in worker.stderr, (
            worker.describe()
        )


@pytest.mark.parametrize(
    ("transport", "ending"), [("zmq", "return"), ("grpc", "exit"), ("zmq", "raise")], ids=str
)
def test_coordinator_job_without_shutdown_ends_by_itself(transport, ending):
    # A failing chief does not wait for workers that never connected (its error comes first): one
    # that starts late on a loaded machine finds the servers stopped and fails at its init deadline,
    # naming them (the test below makes that happen every time). 30 s here instead of 120 s.
    env = {"SPREAD_PS_TRANSPORT": transport, "SPREAD_TEST_CHIEF_ENDING": ending, "SPREAD_INIT_TIMEOUT": "30"}
    runs = run_ps_script(SCRIPTS / "coordinator_ending.py", 3, 2, env=env, timeout=TIMEOUT)
    _assert_all_gone(runs)
    chief, *workers, ps0, ps1 = runs
    assert "last loss" in chief.stdout and "accuracy" in chief.stdout, chief.describe()
    if ending == "raise":
        assert chief.returncode == 1 and "ValueError: the chief failed on purpose" in chief.stderr
        for worker in workers:  # told to stop, or (started late) told clearly that the servers are gone,
            # or (started late, after the servers answered) that the chief's coordinator is gone
            if worker.returncode != 0:
                assert (
                    "ParameterServerError: parameter server" in worker.stderr
                    or "RemoteCallError: the chief (coordinator at" in worker.stderr
                ), worker.describe()
            else:
                _assert_clean(worker)
    else:
        _assert_clean(chief)
        for worker in workers:  # the workers were told to stop
            _assert_clean(worker)
    _assert_clean(ps0)  # the servers were stopped
    _assert_clean(ps1)


def test_a_coordinator_worker_that_starts_after_a_failing_chief_ends_at_its_deadline_naming_the_servers(
    tmp_path,
):
    """Worker 1 starts only once the chief has finished the work; the chief then raises and stops the
    servers without waiting for it. The late worker cannot tell stopped servers from ones not started
    yet, so it waits for them until its init deadline (plus one call's timeout) and fails naming the
    server: never a hang."""
    env = {
        "SPREAD_TEST_LATE_DIR": str(tmp_path),
        "SPREAD_TEST_CHIEF_ENDING": "raise",
        "SPREAD_INIT_TIMEOUT": "10",
    }
    runs = run_ps_script(SCRIPTS / "coordinator_ending.py", 3, 2, env=env, timeout=TIMEOUT)
    _assert_all_gone(runs)
    chief, worker0, worker1, ps0, ps1 = runs
    assert chief.returncode == 1 and "ValueError: the chief failed on purpose" in chief.stderr
    for run in (worker0, ps0, ps1):
        _assert_clean(run)
    assert worker1.returncode == 1, worker1.describe()
    assert "ParameterServerError: parameter server" in worker1.stderr, worker1.describe()
    assert "not reachable" in worker1.stderr, worker1.describe()


def test_a_coordinator_worker_that_starts_after_all_the_work_is_still_told_to_stop(tmp_path):
    """Worker 1 starts only once worker 0 has run every task and the chief's script has ended: the
    chief still waits for it and tells it to stop (else it would wait for a chief that is gone)."""
    env = {"SPREAD_TEST_LATE_DIR": str(tmp_path)}
    runs = run_ps_script(SCRIPTS / "coordinator_ending.py", 3, 2, env=env, timeout=TIMEOUT)
    _assert_all_gone(runs)
    for run in runs:
        _assert_clean(run)
    stats = json.loads((tmp_path / "trained").read_text())
    assert stats["sessions"] == 1 and stats["completed"] == 17  # all the work, by worker 0 alone
