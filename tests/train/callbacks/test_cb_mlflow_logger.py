"""MLflowLogger against a real tracking server (``mlflow server`` on a local SQLite store, started here):
one run per job however many ranks, continued (not duplicated) by a fit resumed at another world size."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.testing import launch_ranks, run_ranks
from spread.testing.ps_jobs import free_ports
from spread.train.callbacks import BackupAndRestore, Callback, MLflowLogger, ModelCheckpoint


def _mlflow():
    """mlflow, imported when a test needs it (importing it runs `uname`: not at collection)."""
    return pytest.importorskip("mlflow")


N, BATCH, EPOCHS = 64, 16, 3  # 4 steps per epoch, 12 in all


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> str:
    """A tracking server of its own: what a job logs to, read back through the same HTTP API."""
    root = tmp_path_factory.mktemp("mlflow")
    (port,) = free_ports(1)
    log = open(root / "server.log", "w")  # noqa: SIM115 (closed with the server, below)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


class _Crash(Callback):
    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.at_step:
            raise KeyboardInterrupt("simulated crash")


def _fit(
    strategy: spread.Strategy,
    logger: MLflowLogger,
    *,
    backup_dir: str | None = None,
    ckpt_dir: str | None = None,
    crash_at: int | None = None,
    extra: tuple[Callback, ...] = (),
) -> int:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    callbacks: list[Callback] = [BackupAndRestore(backup_dir, save_freq=3)] if backup_dir else []
    callbacks.append(logger)
    if ckpt_dir:
        callbacks.append(ModelCheckpoint(os.path.join(ckpt_dir, "epoch{epoch}.pt"), verbose=0))
    if crash_at:
        callbacks.append(_Crash(crash_at))
    callbacks.extend(extra)
    trainer = spread.Trainer(model, optimizer, nn.MSELoss(), strategy=strategy, callbacks=callbacks)
    try:
        trainer.fit((x, y), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    finally:
        strategy.close()
    return trainer.global_step


def _rank(
    uri: str, experiment: str, every: int, backup_dir: str | None, ckpt_dir: str | None, crash_at: int
) -> int:
    logger = MLflowLogger(
        uri, experiment=experiment, params={"model": "linear"}, log_every_n_steps=every, log_checkpoints=True
    )
    return _fit(
        spread.MultiWorkerMirroredStrategy(),
        logger,
        backup_dir=backup_dir,
        ckpt_dir=ckpt_dir,
        crash_at=crash_at or None,
    )


def _runs(uri: str, experiment: str) -> list:
    client = _mlflow().MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in _mlflow().MlflowClient(uri).get_metric_history(run_id, key))


@pytest.mark.processes
def test_a_two_rank_fit_logs_one_run_with_params_metrics_and_checkpoints(tracking_uri, tmp_path):
    assert run_ranks(_rank, 2, args=(tracking_uri, "two-ranks", 2, None, str(tmp_path), 0), timeout=180) == [
        12,
        12,
    ]
    (run,) = _runs(tracking_uri, "two-ranks")  # one run, not one per rank
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert {
        k: params[k] for k in ("strategy", "num_replicas", "global_batch_size", "epochs", "optimizer")
    } == {
        "strategy": "MultiWorkerMirroredStrategy",
        "num_replicas": "2",
        "global_batch_size": "16",
        "epochs": "3",
        "optimizer": "SGD",
    }
    assert params["optimizer.lr"] == "0.05" and params["optimizer.momentum"] == "0.9"
    assert params["precision"] == "32" and params["accumulation_steps"] == "1" and params["model"] == "linear"
    assert _steps(tracking_uri, run.info.run_id, "epoch/loss") == [0, 1, 2]
    assert _steps(tracking_uri, run.info.run_id, "batch/loss") == [2, 4, 6, 8, 10, 12]
    assert "epoch/timing/compute_ms" in run.data.metrics  # the straggler figures of a 2-process job
    client = _mlflow().MlflowClient(tracking_uri)
    names = sorted(Path(a.path).name for a in client.list_artifacts(run.info.run_id, "checkpoints"))
    assert names == ["epoch1.pt", "epoch2.pt", "epoch3.pt"]


@pytest.mark.processes
def test_a_fit_resumed_at_another_world_size_continues_the_same_run(tracking_uri, tmp_path):
    backup = str(tmp_path / "backup")
    args = (tracking_uri, "resumed", 1, backup, None)
    # Backups at steps 3 and 6 (save_freq=3); the crash at step 5 comes after epoch 0 (steps 1-4) was
    # logged, so the resumed fit trains steps 4 and 5 and ends epoch 0 again: none is logged twice.
    crashed = launch_ranks(_rank, 2, args=(*args, 5), timeout=180)
    assert not any(r.ok for r in crashed)
    (run,) = _runs(tracking_uri, "resumed")
    assert run.info.status == "KILLED" and _steps(tracking_uri, run.info.run_id, "epoch/loss") == [0]
    assert run_ranks(_rank, 1, args=(*args, 0), timeout=180) == [12]
    (after,) = _runs(tracking_uri, "resumed")
    assert after.info.run_id == run.info.run_id and after.info.status == "FINISHED"
    assert _steps(tracking_uri, run.info.run_id, "epoch/loss") == [0, 1, 2]
    assert _steps(tracking_uri, run.info.run_id, "batch/loss") == list(range(1, 13))
    assert after.data.params["num_replicas"] == "2"  # params are the run's first; MLflow's cannot change


@pytest.mark.processes
def test_a_restart_without_a_backup_opens_a_new_run_and_a_failed_fit_says_so(tracking_uri):
    """The same logger in three fits without a backup: three runs, each ended as its fit ended."""
    logger = MLflowLogger(tracking_uri, experiment="restarts", log_every_n_steps=None)
    _fit(spread.OneDeviceStrategy(), logger)
    with pytest.raises(KeyboardInterrupt):
        _fit(spread.OneDeviceStrategy(), logger, crash_at=2)

    class Broken(Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("broken callback")

    with pytest.raises(RuntimeError, match=r"broken callback"):
        _fit(spread.OneDeviceStrategy(), logger, extra=(Broken(),))
    statuses = sorted(run.info.status for run in _runs(tracking_uri, "restarts"))
    assert statuses == ["FAILED", "FINISHED", "KILLED"]  # three fits, three runs


def test_missing_mlflow_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install mlflow"):
        MLflowLogger()


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "epoch"])
def test_bad_log_every_n_steps(every):
    with pytest.raises(ValueError, match=r"Invalid value for argument `log_every_n_steps`"):
        MLflowLogger(log_every_n_steps=every)
