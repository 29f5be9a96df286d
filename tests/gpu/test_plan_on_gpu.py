"""``spread plan`` and ``spread bench --calibrate`` on a machine with GPUs: the model is profiled on
the GPU where the script put it (timed with the device synchronised, without the CPU-only
contention terms), the cluster is this machine's GPUs, and a calibration that needs more GPUs than
there are is refused in one line.

Skipped without CUDA; run with ``SPREAD_TEST_GPU=1 python -m pytest tests/gpu``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from spread.plan.workload import measure_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (and SPREAD_TEST_GPU=1, see tests/conftest.py)"
)

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "examples" / "digits.py")


def _spread(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spread.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )


def test_a_model_on_the_gpu_is_profiled_there_without_the_cpu_only_terms():
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    x = torch.randn(64, 64, device="cuda")
    y = torch.randint(0, 10, (64,), device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    profile = measure_model(
        model, nn.CrossEntropyLoss(), x, y, optimizer=optimizer, threads=(1, 2), concurrency=(2,)
    )
    assert len(profile.compute) == 1  # one timing: CPU thread counts do not apply to GPU kernels
    assert profile.contention == {} and profile.in_process == {} and profile.optimizer_contention == {}
    assert profile.compute_seconds(64) > 0 and profile.optimizer_seconds > 0
    assert all(p.device.type == "cuda" and p.grad is None for p in model.parameters())  # not modified


def test_spread_plan_plans_this_machines_gpus(tmp_path):
    result = _spread("plan", DIGITS, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    gpus = torch.cuda.device_count()
    assert {p["devices"] for p in plan["predictions"]} == {gpus}
    assert plan["recommended"] in {p["label"] for p in plan["predictions"]}
    assert all(p["samples_per_second"] > 0 for p in plan["predictions"])


def test_spread_plan_predicts_a_larger_gpu_cluster(tmp_path):
    result = _spread(
        "plan",
        DIGITS,
        "--devices",
        "8",
        "--nodes",
        "2",
        "--link-gbps",
        "100",
        "--profile-seconds",
        "0",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "recommended:" in result.stdout and "2 node(s) x 4 device(s)" in result.stdout


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the refusal needs a machine with one GPU")
def test_calibrating_links_on_one_gpu_is_refused_in_one_line(tmp_path):
    result = _spread("bench", "--calibrate", "--output", str(tmp_path / "cal.json"), cwd=tmp_path)
    assert result.returncode == 2
    assert "GPU" in result.stderr and "CUDA_VISIBLE_DEVICES=" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "cal.json").exists()
