"""SIGTERM during fit: every rank finishes its step, one backup of that step is written, the process
exits with 143 and no traceback, and the next fit resumes exactly (at this world size or another)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.testing.processes import spread_run
from spread.train.callbacks import BackupAndRestore, Callback
from spread.train.preemption import PREEMPTED_EXIT_CODE, PreemptionWatch, TrainingPreempted

N, BATCH, EPOCHS = 100, 16, 3  # 7 steps per epoch


class _SigtermAt(Callback):
    """Sends this process SIGTERM during step ``at_step`` (before the backup callback's turn)."""

    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def on_train_batch_begin(self, step, logs=None):
        if self.trainer.global_step + 1 == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(strategy, backup_dir: Path, extra=(), save_freq=5, backup=None) -> dict:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backup = backup or BackupAndRestore(str(backup_dir), save_freq=save_freq)
    trainer = spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=[*extra, backup]
    )
    trainer.fit((x, y), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _strategies():
    return {
        "one_device": lambda: spread.OneDeviceStrategy(),
        "mirrored": lambda: spread.MirroredStrategy(num_replicas=2, intra_op_threads=1),
    }


@pytest.mark.parametrize("name", ["one_device", "mirrored"])
def test_sigterm_backs_up_the_step_in_flight_and_the_resume_is_exact(tmp_path, name):
    make = _strategies()[name]
    reference = _fit(make(), tmp_path / "ref")
    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TrainingPreempted) as info:
        _fit(make(), tmp_path / "run", extra=[_SigtermAt(8)])
    assert info.value.code == PREEMPTED_EXIT_CODE == 143 and info.value.step == 8
    assert "backed up step 8" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt-*")) == ["ckpt-0000000005", "ckpt-0000000008"]
    assert signal.getsignal(signal.SIGTERM) == handler_before  # put back
    weights = _fit(make(), tmp_path / "run")
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)


def test_sigterm_during_a_backup_lets_it_finish_and_writes_no_second_one(tmp_path):
    reference = _fit(spread.OneDeviceStrategy(), tmp_path / "ref")
    backup = BackupAndRestore(str(tmp_path / "run"), save_freq=5)
    strategy = spread.OneDeviceStrategy()
    original_save = strategy.save_checkpoint

    def save_with_sigterm(path, state, *, step, keep, blocking):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the backup of step 5 is being taken
        return original_save(path, state, step=step, keep=keep, blocking=blocking)

    strategy.save_checkpoint = save_with_sigterm  # type: ignore[method-assign]
    with pytest.raises(TrainingPreempted) as info:
        _fit(strategy, tmp_path / "run", backup=backup)
    assert info.value.step == 5
    assert [p.name for p in (tmp_path / "run").glob("ckpt-*")] == ["ckpt-0000000005"]
    weights = _fit(spread.OneDeviceStrategy(), tmp_path / "run")
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)


def test_without_the_option_sigterm_is_left_alone(tmp_path):
    handler_before = signal.getsignal(signal.SIGTERM)
    backup = BackupAndRestore(str(tmp_path / "run"), save_on_preemption=False)

    class Look(Callback):
        def on_train_batch_end(self, step, logs=None):
            self.seen = signal.getsignal(signal.SIGTERM)

    look = Look()
    _fit(spread.OneDeviceStrategy(), tmp_path / "run", extra=[look], backup=backup)
    assert look.seen == handler_before


def test_the_handler_is_put_back_when_fit_raises(tmp_path):
    handler_before = signal.getsignal(signal.SIGTERM)

    class Boom(Callback):
        def on_train_batch_end(self, step, logs=None):
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _fit(spread.OneDeviceStrategy(), tmp_path / "run", extra=[Boom()])
    assert signal.getsignal(signal.SIGTERM) == handler_before


def test_a_sigterm_not_acted_on_is_delivered_when_the_watch_stops():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        watch = PreemptionWatch()
        watch.start()
        os.kill(os.getpid(), signal.SIGTERM)
        assert watch.requested and not received  # deferred
        watch.stop()
        assert received == [signal.SIGTERM]  # not swallowed
    finally:
        signal.signal(signal.SIGTERM, previous)


SCRIPT = r"""
import json, os, signal, sys
import torch
from torch import nn
import spread
from spread.train.callbacks import BackupAndRestore, Callback

backup_dir, sigterm_at, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
strategy = spread.MultiWorkerMirroredStrategy()

class Sigterm(Callback):
    def on_train_batch_begin(self, step, logs=None):
        if self.trainer.global_step + 1 == sigterm_at and strategy.rank == 1:
            print(f"SIGTERM to the {target} at step {sigterm_at}", flush=True)
            os.kill(os.getppid() if target == "launcher" else os.getpid(), signal.SIGTERM)

g = torch.Generator().manual_seed(1)
x, y = torch.randn(100, 8, generator=g), torch.randint(0, 3, (100,), generator=g)
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
backup = BackupAndRestore(backup_dir, save_freq=4)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy,
                         callbacks=[Sigterm(), backup])
trainer.fit((x, y), epochs=3, global_batch_size=16, verbose=0)
if strategy.is_chief:
    weights = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
    print("RESULT " + json.dumps(weights), flush=True)
"""


def _spread_run(tmp_path: Path, nproc: int, backup: Path, sigterm_at: int, target: str = "launcher"):
    script = tmp_path / "preempted_train.py"
    script.write_text(SCRIPT)
    run = spread_run(script, nproc, str(backup), str(sigterm_at), target)
    return run.returncode, run.log, run.result


@pytest.mark.processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("target", ["launcher", "rank"])
def test_a_preempted_job_exits_143_after_a_backup_and_resumes_at_another_size(tmp_path, target):
    code, log, reference = _spread_run(tmp_path, 2, tmp_path / "ref", sigterm_at=0)
    assert code == 0 and reference is not None, log[-3000:]
    backup = tmp_path / "backup"
    code, log, _ = _spread_run(tmp_path, 2, backup, sigterm_at=6, target=target)
    assert code == 143, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    # The signal reaches the rank during step 6 (sent to itself) or some time later (forwarded by
    # the launcher: a step or more on a loaded machine); the backup is of the step it arrived in.
    saved = max(int(p.name.removeprefix("ckpt-")) for p in backup.glob("ckpt-*"))
    assert saved == 6 if target == "rank" else 6 <= saved < 21, log[-3000:]
    assert f"preempted (SIGTERM): backed up step {saved}" in log
    code, log, weights = _spread_run(tmp_path, 3, backup, sigterm_at=0)
    assert code == 0 and weights is not None, log[-3000:]
    for key, values in reference.items():
        torch.testing.assert_close(torch.tensor(weights[key]), torch.tensor(values), rtol=1e-5, atol=1e-6)
