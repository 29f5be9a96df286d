"""`spread run --workers 1 --ps 2 --recover`: parameter server 1 SIGKILLed mid-training is started again
at its address and restored from the chief's backup while the training tasks wait; nothing else is
restarted. Sync mode ends with the uninterrupted run's weights (the steps since the backup replayed);
async mode applies every step at most once per server. A replacement that never serves fails the job
naming the server, and no process is left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spread.checkpoint import CheckpointManager
from spread.ps.server import state_digest
from spread.testing import reap_survivors
from spread.testing.time_budget import budget

SCRIPT = Path(__file__).parent / "scripts" / "lose_a_server.py"
KILL_AT = 5  # after the chief's step 5; its backups are of steps 3 and 6
STEPS_PER_TASK = 10


def _run(
    tmp_path: Path, mode: str, kill_at: int, *, comes_back: bool = True, restore_timeout: float = 60
) -> dict:
    work = tmp_path / f"{mode}-{kill_at}-{comes_back}"
    work.mkdir()
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "SPREAD_JOB_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", SPREAD_PS_RESTORE_TIMEOUT=str(restore_timeout))
    spread_bin = str(Path(sys.executable).parent / "spread")
    command = [spread_bin, "run", "--workers", "1", "--ps", "2", "--recover", "--kill-grace", "3"]
    args = [str(SCRIPT), mode, str(work), str(kill_at), "back" if comes_back else "never-back"]
    out = subprocess.run([*command, *args], capture_output=True, text=True, timeout=budget(240), env=env)
    log = out.stdout + out.stderr
    pids = {
        (m[1], int(m[2]), int(m[3])): int(m[4])
        for m in re.finditer(r"PID (\w+) (\d+) (\d+) (\d+)", out.stdout)
    }
    alive = reap_survivors(pids.values())
    assert not alive, f"tasks left running: {alive}\n{log[-3000:]}"
    result: dict = {"code": out.returncode, "log": log, "pids": pids, "work": work}
    if out.returncode == 0:
        weights, ledger = re.search(r"WEIGHTS (.*)", out.stdout), re.search(r"LEDGER (.*)", out.stdout)
        assert weights and ledger, log[-3000:]
        result["weights"] = [float(v) for v in weights.group(1).split()]
        result["ledger"] = json.loads(ledger.group(1))
        result["ends"] = {
            (m[1], int(m[2])): int(m[3]) for m in re.finditer(r"END (\w+) (\d+) (\d+)", out.stdout)
        }
    return result


def _check_restored_in_place(run: dict) -> list[int]:
    """Only server 1 was started again (once); the training tasks and server 0 kept their processes;
    the restored server held exactly the backup it was restored from. Returns what the chief replayed."""
    log = run["log"]
    assert run["code"] == 0, log[-4000:]
    assert "parameter server 1 was lost; --recover: started it again at" in log, log[-4000:]
    assert "restarting" not in log
    assert sorted(run["pids"]) == [
        ("chief", 0, 0),
        ("ps", 0, 0),
        ("ps", 1, 0),
        ("ps", 1, 1),
        ("worker", 0, 0),
    ]
    assert run["ends"] == {
        ("chief", 0): run["pids"][("chief", 0, 0)],
        ("worker", 0): run["pids"][("worker", 0, 0)],
    }
    chief = re.search(
        r"\[chief 0\] spread: rank 0: parameter server 1 \(.*?\) was lost during (.*?) \(.*\); "
        r"restored it in place from backup (\d+)-(\w+) \(state sha256 (\w+)\) after [\d.]+s"
        r"(?:; replayed this task's steps (\d+)-(\d+))?",
        log,
    )
    assert chief, log[-4000:]
    worker = re.search(
        r"\[worker 0\] spread: rank 1: .* it was restored in place from backup (\S+) \(state sha256 (\w+)\)",
        log,
    )
    assert worker and worker[1] == f"{chief[2]}-{chief[3]}" and worker[2] == chief[4], log[-4000:]
    step = int(chief[2])
    found = CheckpointManager(run["work"] / "backup").load_latest(step=step)
    assert found is not None
    saved = found[1]["objects"]["parameter_servers"]["value"]
    assert saved["backup_id"] == f"{chief[2]}-{chief[3]}"
    assert state_digest(saved["servers"]["servers"]["1"]) == chief[4]  # restored = the backup, every tensor
    return list(range(int(chief[5]), int(chief[6]) + 1)) if chief[5] else []


@pytest.fixture(scope="module")
def uninterrupted_sync(tmp_path_factory) -> dict:
    reference = _run(tmp_path_factory.mktemp("reference"), "sync", -1)
    assert reference["code"] == 0, reference["log"][-4000:]
    return reference


@pytest.mark.processes
@pytest.mark.parametrize(
    ("kill_at", "found_by", "replayed"),
    [
        (KILL_AT, "push (step 5)", [3, 4]),  # the backup of step 3; step 5 in flight
        # Lost just before the chief's backup of step 6: its snapshot finds it while the worker's push
        # of step 6 waits at server 0 for the chief's share (the worker must not wait for that answer
        # before it replays steps 3-5 to server 1: PSClient fails a push fast).
        (6, "state", [3, 4, 5]),
    ],
)
def test_sync_a_lost_server_is_restored_in_place_and_the_job_ends_with_the_uninterrupted_weights(
    tmp_path, uninterrupted_sync, kill_at, found_by, replayed
):
    reference = uninterrupted_sync
    run = _run(tmp_path, "sync", kill_at)
    assert f"was lost during {found_by} (" in run["log"], run["log"][-4000:]
    assert _check_restored_in_place(run) == replayed
    assert run["weights"] == reference["weights"]  # bit for bit
    assert [s["version"] for s in run["ledger"]] == [STEPS_PER_TASK, STEPS_PER_TASK]


@pytest.mark.processes
def test_async_a_lost_server_is_restored_in_place_and_no_step_is_applied_twice(tmp_path):
    run = _run(tmp_path, "async", KILL_AT)
    assert _check_restored_in_place(run) == []  # async mode replays nothing (documented)
    ids = [set(s["applied_ids"]) for s in run["ledger"]]
    for server in run["ledger"]:
        assert server["applied"] == len(server["applied_ids"])  # no step applied twice
    every = {f"w{t}" for t in (0, 1)}
    assert {i.split(".")[0] for i in ids[0]} == every and len(
        ids[0]
    ) == 2 * STEPS_PER_TASK  # server 0 lost nothing
    assert ids[1] <= ids[0]  # server 1: the backup's steps and those after the restore
    last = {i for i in ids[0] if i.endswith(f".{STEPS_PER_TASK - 1}")}
    assert last <= ids[1], (last, ids[1])


@pytest.mark.processes
def test_a_server_that_never_comes_back_fails_the_job_naming_it(tmp_path):
    run = _run(tmp_path, "sync", KILL_AT, comes_back=False, restore_timeout=8)
    log = run["log"]
    assert run["code"] != 0, log[-4000:]
    assert "parameter server 1 was lost; --recover: started it again at" in log
    assert re.search(
        r"ParameterServerError: parameter server 1 \(127\.0\.0\.1:\d+\): push \(step 5\) failed: lost \(.*\) "
        r"and not back and restored from its backup within 8s",
        log,
    ), log[-4000:]
    assert ("ps", 1, 1) in run["pids"]  # the replacement started, hung, and was stopped with the job
