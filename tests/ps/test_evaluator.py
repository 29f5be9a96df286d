"""P4: the evaluator sidecar reads the latest variables while training runs; killing it loses no
training step, and a restarted evaluator goes on from the servers' current values."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from torch import nn

import spread
from spread.testing import run_ps_job

pytestmark = pytest.mark.processes

STEPS = 30


def _job(marker_dir: str) -> dict:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    restarted = os.environ.get("SPREAD_TEST_RESTARTED") == "1"
    if task["type"] == "evaluator" and restarted:
        _wait_for(os.path.join(marker_dir, "evaluator-killed"))
    strategy = spread.ParameterServerStrategy(timeout=20)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 4)
    y = x.sum(1, keepdim=True)
    if task["type"] == "evaluator":
        losses = []

        def evaluate():
            with torch.no_grad():
                losses.append(float(nn.functional.mse_loss(model(x), y)))
            if not restarted and len(losses) == 2:
                open(os.path.join(marker_dir, "evaluator-killed"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if restarted:
                open(os.path.join(marker_dir, "evaluator-resumed"), "w").close()

        count = strategy.evaluate_periodically(evaluate, interval=0.2)
        strategy.close()
        return {"evaluations": count, "losses": losses}
    for _ in range(STEPS):
        optimizer.zero_grad()
        strategy.run(lambda: nn.functional.mse_loss(model(x), y).backward())
        optimizer.step()
        time.sleep(0.05)
    if strategy.is_chief:
        _wait_for(os.path.join(marker_dir, "evaluator-resumed"))
        strategy.wait_for_workers()
        applied = strategy.server_stats()[0]["applied"]
        strategy.close()
        return {"applied": applied}
    strategy.close()
    return {}


def _wait_for(path: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_killed_evaluator_loses_no_training_step_and_a_restart_resumes(tmp_path):
    results = run_ps_job(
        _job, 2, 1, args=(str(tmp_path),), evaluators=2, rank_env_extra={4: {"SPREAD_TEST_RESTARTED": "1"}}
    )
    assert results[3].exitcode == -signal.SIGKILL  # the first evaluator died
    for rank in (0, 1, 2, 4):
        assert results[rank].ok, results[rank].describe()
    assert results[0].value["applied"] == 2 * STEPS  # training lost nothing
    resumed = results[4].value
    assert resumed["evaluations"] >= 1 and resumed["losses"]
