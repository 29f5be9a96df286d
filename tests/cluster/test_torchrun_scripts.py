"""Scripts written for torchrun run unchanged under ``spread run``, with the same results and exit codes.

The scripts (``scripts/``) are written here in the style of the ones people copy: a DDP tutorial
with snapshot-resume, and a nanoGPT-like train.py with gradient accumulation under ``no_sync``. Each
runs under torchrun and under ``spread run`` with torchrun's own flag spellings; rank 0's output
lines must be identical, and so must the exit codes, for a clean run, a failing rank, and a failing
rank restarted with ``--max_restarts=1``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.processes, pytest.mark.timeout(900)]  # torchrun runs may be repeated

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent
LAUNCHERS = {"torchrun": [str(BIN / "torchrun")], "spread run": [str(BIN / "spread"), "run"]}


def _env() -> dict[str, str]:
    foreign = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in foreign and not k.startswith("TORCHELASTIC")}
    return {**env, "OMP_NUM_THREADS": "1"}


# Torchrun failures that are torchrun's, not the script's, and that spread run does not have:
# - a rank aborts at exit after a finished run (gloo's threads outlive the interpreter,
#   pytorch/pytorch#190489; spread run releases torch.distributed first);
# - after a restart, a rank reads the previous attempt's gloo addresses from the agent's store (one
#   store for every attempt, and env:// adds no attempt prefix): "connectFullMesh failed", or a rank
#   that waits for a peer at an address nobody answers (gloo's 30-minute default); spread run hosts a
#   fresh store per attempt.
# What the tests compare is torchrun without them, so such a torchrun run is repeated, a few times at most.
TORCHRUN_ATTEMPTS = 5
TORCHRUN_HANG = 60  # seconds; a torchrun run this long is the stale-address wait (a clean one: 5-25 s)


def _torchrun_own_failure(proc: subprocess.CompletedProcess) -> bool:
    exit_abort = "terminate called without an active exception" in proc.stderr and "SIGABRT" in proc.stderr
    return proc.returncode is None or exit_abort or "connectFullMesh failed" in proc.stderr


def _run(
    argv: list[str], cwd: Path, timeout: float, *, hang_is_an_answer: bool
) -> subprocess.CompletedProcess:
    """Run a launcher; past ``timeout`` it and every process under it are killed, and the run
    counts as a hang (returncode None) when ``hang_is_an_answer``, else the test fails."""
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, err = proc.communicate(timeout=30)
        if not hang_is_an_answer:
            raise AssertionError(f"{argv[0]} still running after {timeout}s:\n{err[-3000:]}") from None
        return subprocess.CompletedProcess(argv, None, out, err)
    finally:
        if proc.poll() is None:
            _kill_tree(proc)
            proc.communicate(timeout=30)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_tree(proc: subprocess.Popen) -> None:
    """The launcher and every process under it (torchrun starts each rank in a session of its own)."""
    tree = [*psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(tree, timeout=30)


def _both(
    flags: list[str], script: str, args: list[str], cwd: Path, *, succeeds: bool = False
) -> dict[str, tuple[int, list[str]]]:
    """Run under each launcher (a fresh working directory each); returns (exit code, rank 0's lines).

    ``succeeds``: the job must end 0, so a torchrun run that does not is torchrun's own failure
    (its restarts reuse one store; CI saw an attempt after a restart lose its peer) and is repeated.

    torchrun runs with ``--tee 3`` so that it, like spread run, tags each line with its rank: bare,
    two ranks' unbuffered prints interleave mid-line in the shared pipe ("Loading snapshotResuming").
    """
    results = {}
    for name, launcher in LAUNCHERS.items():
        torchrun = name == "torchrun"
        for attempt in range(TORCHRUN_ATTEMPTS if torchrun else 1):
            workdir = cwd / name.replace(" ", "_") / str(attempt)
            workdir.mkdir(parents=True)
            tee = ["--tee", "3"] if torchrun else []
            argv = [*launcher, *flags, *tee, str(SCRIPTS / script), *args]
            proc = _run(argv, workdir, TORCHRUN_HANG if torchrun else 240, hang_is_an_answer=torchrun)
            own_failure = _torchrun_own_failure(proc) or (succeeds and proc.returncode != 0)
            if not torchrun or not own_failure:
                break
        assert proc.returncode is not None, f"torchrun failed on its own {TORCHRUN_ATTEMPTS} times in a row"
        rank0 = "[default0]:" if torchrun else "[rank 0] "
        lines = proc.stdout.splitlines()
        assert all(line.startswith("[default" if torchrun else "[rank ") for line in lines), lines
        results[name] = (
            proc.returncode,
            [line.removeprefix(rank0) for line in lines if line.startswith(rank0)],
        )
        print(name, proc.returncode, proc.stderr[-1500:])
    return results


STANDALONE = ["--standalone", "--nproc_per_node=2"]


def test_ddp_tutorial_gives_identical_losses(tmp_path: Path) -> None:
    results = _both(STANDALONE, "ddp_tutorial.py", ["4", "1"], tmp_path, succeeds=True)
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
    uninterrupted = _both(STANDALONE, "ddp_tutorial.py", ["4", "1"], tmp_path / "clean", succeeds=True)
    flags = [*STANDALONE, "--max_restarts=1"]
    args = ["4", "1", "--fail-rank", "1", "--fail-epoch", "2"]
    restarted = _both(flags, "ddp_tutorial.py", args, tmp_path / "restarted", succeeds=True)
    # torchrun's own restart failed in every try once, under CI load (2026-11-26; it passed alone
    # right after): then there is no reference to compare with, and spread's run is checked alone.
    if restarted["torchrun"][0] == 0:
        assert restarted["torchrun"] == restarted["spread run"]
    code, lines = restarted["spread run"]
    assert code == 0 and "Resuming training from snapshot at Epoch 2" in lines
    final = [line for line in lines if line.startswith("final weight sum")]
    assert final and final == [line for line in uninterrupted["spread run"][1] if line.startswith("final")]


def test_nanogpt_style_script_gives_identical_losses(tmp_path: Path) -> None:
    flags = ["--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    results = _both(flags, "nanogpt_style.py", ["--max_iters=4"], tmp_path, succeeds=True)
    assert results["torchrun"] == results["spread run"]
    code, lines = results["spread run"]
    assert code == 0 and len([line for line in lines if line.startswith("iter")]) == 4


def test_nanogpt_style_crash_has_the_same_exit_code(tmp_path: Path) -> None:
    results = _both(STANDALONE, "nanogpt_style.py", ["--max_iters=4", "--crash_at=1"], tmp_path)
    assert results["torchrun"][0] == results["spread run"][0] == 1
