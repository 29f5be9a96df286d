"""`spread run --workers W --ps P`: a process per role, roles from TF_CONFIG, servers stopped at the end."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spread.cluster.launcher import LaunchConfig

SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    from torch import nn
    import spread

    strategy = spread.ParameterServerStrategy()
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    with strategy.scope():
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        strategy.run(lambda: model(torch.ones(4, 3)).sum().backward())
        optimizer.step()
    if strategy.is_chief:
        strategy.wait_for_workers()
        print("applied", [s["applied"] for s in strategy.server_stats()])
    strategy.close()
    print("finished", task["type"], task["index"])
    """
)


@pytest.mark.processes
def test_spread_run_starts_every_role_and_stops_the_servers(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "spread.cli.main", "run", "--workers", "1", "--ps", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "[chief 0] applied [6, 6]" in done.stdout
    assert "[worker 0] finished worker 0" in done.stdout
    assert "[chief 0] finished chief 0" in done.stdout


@pytest.mark.processes
def test_spread_run_job_that_closes_nothing_ends_by_itself():
    """The chief stops the servers when its script ends: spread run never has to (it says so when it
    does), and nothing prints a traceback."""
    script = Path(__file__).parent / "scripts" / "fit_ending.py"
    cmd = [sys.executable, "-m", "spread.cli.main", "run", "--workers", "2", "--ps", "2", str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert (
        "Traceback" not in done.stdout + done.stderr and "Exception ignored" not in done.stdout + done.stderr
    )
    assert "still running" not in done.stderr, done.stderr  # the launcher did not stop the servers
    for task in ("chief 0", "worker 0", "worker 1"):
        assert f"[{task}] trained {task}" in done.stdout


@pytest.mark.processes
def test_example_with_the_coordinator_under_spread_run():
    cmd = [sys.executable, "-m", "spread.cli.main", "run", "--workers", "2", "--ps", "2"]
    cmd += ["examples/parameter_server.py", "--coordinator", "--epochs", "5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "'scheduled': 109, 'completed': 109" in done.stdout
    accuracy = float(done.stdout.split("validation accuracy ")[1].split(";")[0])
    assert accuracy >= 0.85, done.stdout
    assert "updates applied per server: [109, 109]" in done.stdout


def test_ps_job_config():
    config = LaunchConfig(entrypoint="x.py", workers=2, ps=1, evaluator=True)
    assert config.nproc == 5
    assert config.ps_tasks() == [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)]
    with pytest.raises(ValueError, match="ps"):
        LaunchConfig(entrypoint="x.py", workers=2)
    with pytest.raises(ValueError, match="nnodes"):
        LaunchConfig(entrypoint="x.py", ps=1, nnodes=2, master_addr="10.0.0.1", master_port=1234)
