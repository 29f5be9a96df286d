"""Scripts written for torchrun run unchanged under ``spread run``, with the same results and exit codes.

The scripts (``scripts/``) are written here in the style of the ones people copy: a DDP tutorial
with snapshot-resume, and a nanoGPT-like train.py with gradient accumulation under ``no_sync``. Each
runs under torchrun and under ``spread run`` with torchrun's own flag spellings; rank 0's output
lines must be identical, and so must the exit codes, for a clean run, a failing rank, and a failing
rank restarted with ``--max_restarts=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent
LAUNCHERS = {"torchrun": [str(BIN / "torchrun")], "spread run": [str(BIN / "spread"), "run"]}


def _env() -> dict[str, str]:
    foreign = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in foreign and not k.startswith("TORCHELASTIC")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _both(flags: list[str], script: str, args: list[str], cwd: Path) -> dict[str, tuple[int, list[str]]]:
    """Run under each launcher (a fresh working directory each); returns (exit code, rank 0's lines)."""
    results = {}
    for name, launcher in LAUNCHERS.items():
        workdir = cwd / name.replace(" ", "_")
        workdir.mkdir()
        proc = subprocess.run(
            [*launcher, *flags, str(SCRIPTS / script), *args],
            cwd=workdir,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = proc.stdout.splitlines()
        if name == "spread run":  # spread tags every line; torchrun passes rank 0's lines through bare
            assert all(line.startswith("[rank ") for line in lines), lines
            lines = [line.removeprefix("[rank 0] ") for line in lines if line.startswith("[rank 0] ")]
        results[name] = (proc.returncode, lines)
        print(name, proc.returncode, proc.stderr[-1500:])
    return results


STANDALONE = ["--standalone", "--nproc_per_node=2"]


def test_ddp_tutorial_gives_identical_losses(tmp_path: Path) -> None:
    results = _both(STANDALONE, "ddp_tutorial.py", ["4", "1"], tmp_path)
    assert results["torchrun"] == results["spread run"]
    code, lines = results["spread run"]
    assert code == 0 and len([line for line in lines if line.startswith("Epoch")]) == 4


def test_ddp_tutorial_failing_rank_fails_the_job_under_both(tmp_path: Path) -> None:
    results = _both(
        STANDALONE, "ddp_tutorial.py", ["4", "1", "--fail-rank", "1", "--fail-epoch", "2"], tmp_path
    )
    assert results["torchrun"] == results["spread run"]
    assert results["spread run"][0] == 1  # the rank's exception: exit 1 under both launchers


def test_ddp_tutorial_restarts_from_its_snapshot_and_ends_as_uninterrupted(tmp_path: Path) -> None:
    uninterrupted = _both(STANDALONE, "ddp_tutorial.py", ["4", "1"], tmp_path / "clean")
    flags = [*STANDALONE, "--max_restarts=1"]
    args = ["4", "1", "--fail-rank", "1", "--fail-epoch", "2"]
    restarted = _both(flags, "ddp_tutorial.py", args, tmp_path / "restarted")
    assert restarted["torchrun"] == restarted["spread run"]
    code, lines = restarted["spread run"]
    assert code == 0 and "Resuming training from snapshot at Epoch 2" in lines
    final = [line for line in lines if line.startswith("final weight sum")]
    assert final and final == [line for line in uninterrupted["spread run"][1] if line.startswith("final")]


def test_nanogpt_style_script_gives_identical_losses(tmp_path: Path) -> None:
    flags = ["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    results = _both(flags, "nanogpt_style.py", ["--max_iters=4"], tmp_path)
    assert results["torchrun"] == results["spread run"]
    code, lines = results["spread run"]
    assert code == 0 and len([line for line in lines if line.startswith("iter")]) == 4


def test_nanogpt_style_crash_has_the_same_exit_code(tmp_path: Path) -> None:
    results = _both(STANDALONE, "nanogpt_style.py", ["--max_iters=4", "--crash_at=1"], tmp_path)
    assert results["torchrun"][0] == results["spread run"][0] == 1
