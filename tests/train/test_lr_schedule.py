"""Trainer(lr_scheduler=...): stepped once per optimizer step (not per replica or micro-batch) or per
epoch, as a hand-written torch loop steps it; plateau schedulers read the named log; bad input refused."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import spread
from spread.errors import NonFiniteLossError

N, BATCH = 40, 8  # 5 optimizer steps per epoch


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _trainer(strategy=None, *, scheduler=None, **kwargs):
    strategy = strategy or spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = scheduler or (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5))
    return spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, lr_scheduler=scheduler, **kwargs
    )


def _lr(trainer) -> float:
    return trainer.optimizer.param_groups[0]["lr"]


def test_step_interval_steps_once_per_optimizer_step():
    trainer = _trainer(scheduler_interval="step")
    history = trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
    assert trainer.global_step == 10
    assert _lr(trainer) == pytest.approx(0.1 * 0.5**5)  # StepLR(2) after 10 steps
    assert history.history["lr"] == pytest.approx([0.1 * 0.5**2, 0.1 * 0.5**5])


def test_epoch_interval_steps_once_per_epoch():
    trainer = _trainer(scheduler=lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5))
    history = trainer.fit(_data(), epochs=3, global_batch_size=BATCH, verbose=0)
    assert history.history["lr"] == pytest.approx([0.1, 0.05, 0.025])  # the rate each epoch used
    assert _lr(trainer) == pytest.approx(0.0125)


@pytest.mark.parametrize(
    "make",
    [
        lambda: spread.MirroredStrategy(num_replicas=3, intra_op_threads=1),
        lambda: spread.CentralStorageStrategy(num_replicas=2, intra_op_threads=1),
    ],
    ids=["mirrored", "central_storage"],
)
def test_replicas_and_micro_batches_do_not_step_the_schedule(make):
    strategy = make()
    try:
        trainer = _trainer(strategy, scheduler_interval="step", accumulation_steps=2)
        trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)
    finally:
        strategy.close()
    assert _lr(trainer) == pytest.approx(0.1 * 0.5**2)  # 5 steps, whatever the replicas and micro-batches


def test_a_scheduler_object_is_taken_as_is():
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    trainer = spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), lr_scheduler=scheduler, scheduler_interval="step"
    )
    trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)
    assert trainer.lr_schedule is not None and trainer.lr_schedule.scheduler is scheduler
    assert _lr(trainer) == pytest.approx(1.0 / 6)


def test_plateau_scheduler_steps_with_val_loss_by_default_and_loss_without_validation():
    def plateau(opt):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", patience=0, factor=0.5)

    # mode="max" on a falling loss: every epoch is "no improvement", so every epoch halves the rate.
    trainer = _trainer(scheduler=plateau)
    seen: list[float] = []
    original = trainer.lr_schedule.scheduler.step
    trainer.lr_schedule.scheduler.step = lambda metric: (seen.append(metric), original(metric))[1]
    history = trainer.fit(_data(), epochs=3, global_batch_size=BATCH, validation_data=_data(), verbose=0)
    assert seen == history.history["val_loss"]
    assert _lr(trainer) == pytest.approx(0.1 * 0.5**2)  # the first epoch sets the best value

    trainer = _trainer(scheduler=plateau)
    history = trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
    assert trainer.lr_schedule.monitored(False) == "loss"


def test_plateau_scheduler_with_a_missing_log_names_the_logs_there_are():
    trainer = _trainer(
        scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
        scheduler_monitor="val_accuracy",
    )
    with pytest.raises(KeyError, match=r"monitors 'val_accuracy'.*'loss'"):
        trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)


def test_a_dropped_non_finite_step_does_not_advance_the_schedule():
    x, y = _data()
    x = x.clone()
    x[8] = math.nan  # the second batch of the first epoch (no shuffle)
    trainer = _trainer(scheduler_interval="step", on_nonfinite="skip_step")
    trainer.fit((x, y), epochs=1, global_batch_size=BATCH, shuffle=False, verbose=0)
    assert (trainer.global_step, trainer.skipped_steps) == (4, 1)
    assert _lr(trainer) == pytest.approx(0.1 * 0.5**2)  # 4 steps
    with pytest.raises(NonFiniteLossError):
        _trainer(scheduler_interval="step").fit((x, y), epochs=1, global_batch_size=BATCH, shuffle=False)


def test_bad_scheduler_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="scheduler_interval must be one of"):
        _trainer(scheduler_interval="batch")
    with pytest.raises(TypeError, match=r"lr_scheduler must be a torch\.optim\.lr_scheduler"):
        _trainer(scheduler=0.1)
    with pytest.raises(TypeError, match=r"lr_scheduler\(optimizer\) must return"):
        _trainer(scheduler=lambda opt: None)
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="another optimizer"):
        _trainer(scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(ValueError, match="need an lr_scheduler"):
        spread.Trainer(nn.Linear(1, 1), other, nn.MSELoss(), scheduler_interval="step")
