"""One Trainer.fit for a parameter-server job: the chief schedules every step on the workers
through a ClusterCoordinator, keeps the only logs and callbacks, and evaluates once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.testing.ps_jobs import run_ps_script

SCRIPT = Path(__file__).parent / "scripts" / "coordinated_fit.py"


def _line(text: str, tag: str):
    lines = [line for line in text.splitlines() if line.startswith(tag + " ")]
    return json.loads(lines[-1].removeprefix(tag + " ")) if lines else None


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_chief_drives_one_fit_and_evaluates_once():
    runs = run_ps_script(SCRIPT, 3, 2, timeout=200)
    chief, worker0, worker1, *_ = runs
    for run in runs:
        assert run.returncode == 0, run.describe()
        assert "Traceback" not in run.stderr, run.describe()
    history = _line(chief.stdout, "HISTORY")
    assert history is not None, chief.describe()
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    assert history["lr"] == [0.2, 0.1, 0.05]  # the chief's schedule, used by the workers' steps
    assert history["val_accuracy"][-1] > 0.6  # 4 noisy clusters: chance is 0.25
    evaluate = _line(chief.stdout, "EVALUATE")
    assert evaluate["accuracy"] == pytest.approx(history["val_accuracy"][-1])  # same weights, whole data
    # 15 steps per epoch (480 samples, batches of 32), 3 epochs: every step applied once per server
    assert _line(chief.stdout, "APPLIED") == [45, 45]
    for worker in (worker0, worker1):  # workers end inside fit: no logs, no evaluate of their own
        assert "HISTORY" not in worker.stdout and "EVALUATE" not in worker.stdout
        assert "epoch" not in worker.stdout
    assert chief.stdout.count("epoch 3/3") == 1


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_failing_worker_step_fails_the_chiefs_fit_naming_the_task():
    runs = run_ps_script(SCRIPT, 3, 2, env={"SPREAD_TEST_FAIL_ON_WORKER": "1"}, timeout=200)
    chief = runs[0]
    assert all(r.returncode is not None for r in runs), "\n".join(r.describe() for r in runs)
    assert chief.returncode != 0 and "failed on a worker" in chief.stderr, chief.describe()


def _ps_strategy(mode: str):
    """A ParameterServerStrategy that never joined a job: what the checks read, and nothing else."""
    strategy = object.__new__(spread.ParameterServerStrategy)
    strategy.mode, strategy._sync_batchnorm = mode, False
    return strategy


@pytest.mark.parametrize(
    "strategy,kwargs,match",
    [
        (lambda: spread.OneDeviceStrategy(), {}, "drives a ParameterServerStrategy job"),
        (lambda: _ps_strategy("sync"), {}, "mode='async'"),
        (lambda: _ps_strategy("async"), {"accumulation_steps": 2}, "does not accumulate"),
    ],
)
def test_what_a_coordinated_fit_cannot_do_is_refused_by_name(strategy, kwargs, match):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        spread.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.MSELoss(),
            strategy=strategy(),
            coordinator=object(),
            **kwargs,
        )
