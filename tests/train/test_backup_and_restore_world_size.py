"""A backup taken at one replica count resumes at another and ends where the uninterrupted run ends.

Thread strategies in this process (Mirrored, CentralStorage: 2 -> 1, 3), MultiWorkerMirrored under
``spread run`` (a 2-process job killed by SIGKILL, resumed at 1, 3 and 4 processes), ShardedStrategy
at each stage (its backup is every rank's own shard, resharded by DCP: 2 -> 3 and 1 processes), and
the refusals of strategies whose backups are per task.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import spread
from spread.errors import CheckpointMismatchError
from spread.strategies import StateLayout
from spread.strategies.parameter_server import ServerLayout
from spread.testing.processes import spread_run
from spread.train.callbacks import BackupAndRestore, Callback

N, BATCH, EPOCHS = 100, 16, 3  # 7 steps per epoch, the last one uneven (4 samples)
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # the same sums, split and added in another order


class _Crash(Callback):
    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.at_step:
            raise KeyboardInterrupt("simulated crash")


def _make(name: str, replicas: int) -> spread.Strategy:
    if name == "mirrored":
        return spread.MirroredStrategy(num_replicas=replicas, intra_op_threads=1)
    return spread.CentralStorageStrategy(num_replicas=replicas, intra_op_threads=1)


def _fit(strategy, backup_dir: Path, crash_at: int | None = None) -> tuple[dict, dict, BackupAndRestore]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    backup = BackupAndRestore(str(backup_dir), save_freq=3)
    callbacks = [backup] + ([_Crash(crash_at)] if crash_at else [])
    trainer = spread.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        strategy=strategy,
        callbacks=callbacks,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
        scheduler_interval="step",
        clip_grad_norm=1.0,
    )
    try:
        history = trainer.fit((x, y), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    finally:
        strategy.close()
    return {k: v.clone() for k, v in model.state_dict().items()}, history.history, backup


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
@pytest.mark.parametrize("resume_at", [1, 3])
def test_a_two_replica_backup_resumes_at_another_count_and_ends_the_same(tmp_path, name, resume_at):
    reference, reference_history, _ = _fit(_make(name, 2), tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        _fit(_make(name, 2), tmp_path / "run", crash_at=10)  # mid-epoch 2, backup at step 9
    weights, history, backup = _fit(_make(name, resume_at), tmp_path / "run")
    assert backup.restored_step == 9 and backup.resumed_from_replicas == 2
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, **TOLERANCE, msg=key)
    assert history.keys() == reference_history.keys()
    for key in history:
        assert history[key] == pytest.approx(reference_history[key], rel=1e-4), key


def test_a_strategy_that_refuses_another_count_says_why_and_overwrites_nothing(tmp_path):
    class PerReplicaLayout(StateLayout):
        def refusal(self, writer):
            saved = writer["num_replicas_in_sync"]
            if saved != self.strategy.num_replicas_in_sync:
                return f"this strategy's backups are per replica ({saved} saved)"
            return None

    class PerReplicaState(spread.MirroredStrategy):
        def _state_layout(self):
            return PerReplicaLayout(self)

    with pytest.raises(KeyboardInterrupt):
        _fit(PerReplicaState(num_replicas=2, intra_op_threads=1), tmp_path / "run", crash_at=4)
    with pytest.raises(CheckpointMismatchError) as info:
        _fit(PerReplicaState(num_replicas=3, intra_op_threads=1), tmp_path / "run")
    assert info.value.problems == ["this strategy's backups are per replica (2 saved)"]
    assert (tmp_path / "run" / "ckpt-0000000003").is_dir()  # the backup is still there


def test_parameter_servers_refuse_another_worker_count_naming_what_differs():
    three_workers = SimpleNamespace(num_replicas_in_sync=3)  # all the layout reads
    writer = {"strategy": "ParameterServerStrategy", "family": "parameter_server", "num_replicas_in_sync": 2}
    text = ServerLayout(three_workers).refusal(writer)  # type: ignore[arg-type]
    assert text is not None
    assert "2 worker tasks' resume point" in text and "with 3 workers" in text


SCRIPT = Path(__file__).parent / "scripts" / "elastic_train.py"


def _spread_run(
    tmp_path: Path, nproc: int, backup: Path, crash_at: int, kind: str = "mwms"
) -> tuple[int, str, dict | None]:
    run = spread_run(SCRIPT, nproc, str(backup), str(crash_at), kind)
    return run.returncode, run.log, run.result


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "kind,sizes",
    [
        ("mwms", (1, 3, 4)),
        ("sharded-optimizer", (3, 1)),
        ("sharded-gradients", (3, 1)),
        ("sharded-parameters", (3, 1)),
    ],
)
def test_a_job_killed_at_2_processes_resumes_at_another_size(tmp_path, kind, sizes):
    code, log, reference = _spread_run(tmp_path, 2, tmp_path / "ref", crash_at=0, kind=kind)
    assert code == 0 and reference is not None, log[-3000:]
    for resume_at in sizes:
        backup = tmp_path / f"backup-{resume_at}"
        code, log, _ = _spread_run(tmp_path, 2, backup, crash_at=11, kind=kind)  # rank 1 SIGKILLed
        assert code != 0 and (backup / "ckpt-0000000009").is_dir(), log[-3000:]  # backup of step 9
        code, log, result = _spread_run(tmp_path, resume_at, backup, crash_at=0, kind=kind)
        assert code == 0 and result is not None, log[-3000:]
        assert result["restored"] == 9 and result["from"] == 2 and result["world"] == resume_at
        for key, values in reference["weights"].items():
            torch.testing.assert_close(
                torch.tensor(result["weights"][key]), torch.tensor(values), **TOLERANCE, msg=key
            )
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-4)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_pipeline_backed_up_with_one_replica_resumes_with_two(tmp_path):
    """2 stages x 1 replica (2 processes) killed, resumed as 2 stages x 2 replicas (4 processes)."""
    code, log, reference = _spread_run(tmp_path, 2, tmp_path / "ref", crash_at=0, kind="pipeline")
    assert code == 0 and reference is not None, log[-3000:]
    backup = tmp_path / "backup"
    code, log, _ = _spread_run(tmp_path, 2, backup, crash_at=11, kind="pipeline")
    assert code != 0 and (backup / "ckpt-0000000009").is_dir(), log[-3000:]
    code, log, result = _spread_run(tmp_path, 4, backup, crash_at=0, kind="pipeline")
    assert code == 0 and result is not None, log[-3000:]
    assert result["restored"] == 9 and result["from"] == 1 and result["world"] == 2
    for key, values in reference["weights"].items():
        torch.testing.assert_close(
            torch.tensor(result["weights"][key]), torch.tensor(values), **TOLERANCE, msg=key
        )
    assert result["loss"] == pytest.approx(reference["loss"], rel=1e-4)
