"""LearningRateScheduler: schedule(epoch, lr) sets every group's rate at each epoch's start, on
every rank; the rate is in the logs; a resumed fit continues it; bad schedules are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.callbacks import BackupAndRestore, LearningRateScheduler
from spread.train.callbacks import Callback


def _data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _trainer(callbacks=(), init_seed=0):
    torch.manual_seed(init_seed)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    return spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), callbacks=list(callbacks))


def test_sets_every_groups_rate_at_each_epoch_and_logs_it():
    calls = []

    def schedule(epoch, lr):
        calls.append((epoch, lr))
        return lr if epoch < 1 else lr * 0.1

    trainer = _trainer([LearningRateScheduler(schedule)])
    history = trainer.fit(_data(), epochs=3, global_batch_size=10, verbose=0)
    assert calls == [(0, 0.1), (1, 0.1), (2, pytest.approx(0.01))]
    assert history.history["lr"] == pytest.approx([0.1, 0.01, 0.001])
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([0.001, 0.001])


def test_runs_on_every_rank():
    assert not LearningRateScheduler(lambda e, lr: lr).chief_only  # every rank's optimizer needs it


def test_a_resumed_fit_continues_the_schedule(tmp_path):
    def halve(epoch, lr):
        return lr * 0.5

    class Crash(Callback):
        def on_train_batch_end(self, step, logs=None):
            if self.trainer.global_step == 7:
                raise KeyboardInterrupt

    reference = _trainer([LearningRateScheduler(halve), BackupAndRestore(str(tmp_path / "a"), save_freq=2)])
    expected = reference.fit(_data(), epochs=3, global_batch_size=10, verbose=0).history
    with pytest.raises(KeyboardInterrupt):
        crashed = [LearningRateScheduler(halve), BackupAndRestore(str(tmp_path / "b"), save_freq=2), Crash()]
        _trainer(crashed).fit(_data(), epochs=3, global_batch_size=10, verbose=0)
    resumed = _trainer([LearningRateScheduler(halve), BackupAndRestore(str(tmp_path / "b"), save_freq=2)], 5)
    history = resumed.fit(_data(), epochs=3, global_batch_size=10, verbose=0).history
    assert history == expected and history["lr"] == pytest.approx([0.05, 0.025, 0.0125])
    assert torch.equal(resumed.model.weight, reference.model.weight)


@pytest.mark.parametrize("bad", [None, -0.1, float("nan"), "0.1", True])
def test_a_bad_rate_from_the_schedule_is_refused(bad):
    trainer = _trainer([LearningRateScheduler(lambda epoch, lr: bad)])
    with pytest.raises(ValueError, match=r"schedule\(0, 0\.1\) must return a finite number >= 0"):
        trainer.fit(_data(), epochs=1, global_batch_size=10, verbose=0)


def test_a_schedule_must_be_callable():
    with pytest.raises(ValueError, match="Invalid value for argument `schedule`"):
        LearningRateScheduler(0.1)  # type: ignore[arg-type]
