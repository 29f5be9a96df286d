"""One Trainer.fit script, started every way the README documents, equals one device.

The same file (``scripts/fit_anywhere.py``, MultiWorkerMirroredStrategy, no ``close()``) runs as a
plain ``python`` process, as one process per task with ``TF_CONFIG``, with the variables ``srun``
sets, with only the bare torchrun variables a scheduler sets (Kubeflow's PyTorchJob, ``srun python``),
under torchrun and under ``spread run``. Each must exit 0 and give the one-device weights.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fit_anywhere.py"
BIN = Path(sys.executable).parent
# Variables of an outer launcher or scheduler that must not leak into these jobs.
_FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "SPREAD_JOB_TOKEN")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _FOREIGN and not k.startswith(("SLURM_", "TORCHELASTIC"))
    }
    return {**env, "OMP_NUM_THREADS": "1", "SPREAD_INIT_TIMEOUT": "60", **extra}


def _run_processes(envs: list[dict[str, str]], out: Path, extra: tuple[str, ...] = ()) -> None:
    """One process per env, all at once; every one must exit 0 within the deadline."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(out), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for env in envs
    ]
    try:
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]


def _run_launcher(argv: list[str], out: Path, extra: tuple[str, ...] = ()) -> None:
    result = subprocess.run(
        [*argv, str(SCRIPT), str(out), *extra], env=_clean_env(), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "replicas 2" in result.stdout


def _plain_python(out: Path, extra: tuple[str, ...] = ()) -> None:
    _run_processes([_clean_env()], out, extra)


def _tf_config(out: Path) -> None:
    cluster = {"chief": [f"127.0.0.1:{_free_port()}"], "worker": [f"127.0.0.1:{_free_port()}"]}
    tasks = [("chief", 0), ("worker", 0)]
    _run_processes(
        [
            _clean_env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": t, "index": i}}))
            for t, i in tasks
        ],
        out,
    )


def _slurm(out: Path) -> None:
    common = {
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "localhost",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    _run_processes([_clean_env(**common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)) for r in range(2)], out)


def _bare_torchrun_variables(out: Path, extra: tuple[str, ...] = ()) -> None:
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    _run_processes([_clean_env(**common, RANK=str(r)) for r in range(2)], out, extra)


def _torchrun(out: Path, extra: tuple[str, ...] = ()) -> None:
    _run_launcher([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"], out, extra)


def _spread_run(out: Path, extra: tuple[str, ...] = ()) -> None:
    _run_launcher([str(BIN / "spread"), "run", "-n", "2"], out, extra)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("reference") / "weights.pt"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--one-device"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize(
    "start",
    [_plain_python, _tf_config, _slurm, _bare_torchrun_variables, _torchrun, _spread_run],
    ids=lambda f: f.__name__.strip("_"),
)
def test_every_launch_path_trains_like_one_device(start, one_device, tmp_path: Path) -> None:
    out = tmp_path / "weights.pt"
    start(out)
    weights = torch.load(out, weights_only=True)
    assert weights.keys() == one_device.keys()
    for name, expected in one_device.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "start",
    [_plain_python, _bare_torchrun_variables, _torchrun, _spread_run],
    ids=lambda f: f.__name__.strip("_"),
)
def test_sharded_strategy_starts_every_way_and_trains_like_one_device(
    start, one_device, tmp_path: Path
) -> None:
    """ShardedStrategy(shard="parameters") joins the job the way MultiWorkerMirrored does."""
    out = tmp_path / "weights.pt"
    start(out, ("--sharded",))
    weights = torch.load(out, weights_only=True)
    for name, expected in one_device.items():
        torch.testing.assert_close(weights[name], expected, rtol=1e-5, atol=1e-6, msg=name)
