"""The examples run, under `spread run`, under torchrun, and in one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _run(argv: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_digits_demo_on_two_workers_reaches_95_percent():
    out = _run([str(BIN / "spread"), "run", "-n", "2", "examples/digits.py", "--verbose", "2"])
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(
        r"\[rank 0\] digits: 2 replica\(s\) with MultiWorkerMirroredStrategy: val_accuracy (\S+)", out.stdout
    )
    assert match, out.stdout[-3000:]
    assert float(match.group(1).rstrip(",")) >= 0.95
    assert "epoch 30/30" in out.stdout  # the chief's progress lines are visible
    assert "[rank 1] epoch" not in out.stdout  # ...and only the chief prints them


def test_custom_loop_under_torchrun_unchanged():
    out = _run(
        [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/custom_loop.py",
            "--steps",
            "20",
        ]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 20 steps on 2 replica(s)" in out.stdout


@pytest.mark.parametrize("replicas", ["1", "2"])
def test_custom_loop_in_one_process(replicas):
    out = _run([sys.executable, "examples/custom_loop.py", "--replicas", replicas, "--steps", "20"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"done: 20 steps on {replicas} replica(s)" in out.stdout


def test_hf_gpt2_under_spread_run_learns_the_toy_language():
    pytest.importorskip("transformers")
    out = _run([str(BIN / "spread"), "run", "-n", "2", "examples/hf_gpt2.py"])
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"hf_gpt2: 2 replica\(s\): loss (\S+) -> (\S+)", out.stdout)
    assert match, out.stdout[-3000:]
    assert float(match.group(2)) < 0.5 * float(match.group(1))
