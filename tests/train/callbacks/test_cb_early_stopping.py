import warnings

import pytest

from spread.train.callbacks import CallbackList, EarlyStopping


def _run(fake_trainer, values, monitor="val_loss", **kwargs):
    trainer = fake_trainer(epochs=len(values), steps=1)
    stopper = EarlyStopping(monitor=monitor, **kwargs)
    history = []
    trainer.fit([stopper], epoch_logs=lambda e: history.append(e) or {monitor: values[e]})
    return trainer, stopper, history


def test_patience_zero_stops_at_first_non_improvement(fake_trainer):
    trainer, stopper, epochs = _run(fake_trainer, [1.0, 0.9, 0.95, 0.8])
    assert epochs == [0, 1, 2]
    assert trainer.stop_training and stopper.stopped_epoch == 2
    assert stopper.best == 0.9 and stopper.best_epoch == 1


def test_patience_counts_epochs_without_improvement(fake_trainer):
    _, stopper, epochs = _run(fake_trainer, [1.0, 1.1, 1.2, 1.3, 1.4], patience=2)
    assert epochs == [0, 1, 2]
    assert stopper.wait == 2


def test_runs_to_the_end_while_improving(fake_trainer):
    trainer, stopper, epochs = _run(fake_trainer, [1.0, 0.9, 0.8])
    assert epochs == [0, 1, 2]
    assert not trainer.stop_training and stopper.stopped_epoch == 0


def test_min_delta_must_be_exceeded(fake_trainer):
    _, stopper, epochs = _run(fake_trainer, [1.0, 0.95, 0.92, 0.5], min_delta=0.1, patience=1)
    assert epochs == [0, 1]
    assert stopper.best == 1.0


def test_auto_mode_maximises_accuracy(fake_trainer):
    _, stopper, epochs = _run(fake_trainer, [0.5, 0.6, 0.55], monitor="val_accuracy")
    assert stopper.mode == "max"
    assert epochs == [0, 1, 2] and stopper.stopped_epoch == 2


def test_explicit_max_mode(fake_trainer):
    _, _, epochs = _run(fake_trainer, [0.5, 0.4, 0.6], monitor="score", mode="max")
    assert epochs == [0, 1]


def test_baseline_keeps_the_counter_running(fake_trainer):
    values = [1.0, 0.9, 0.95, 0.3]
    _, _, without = _run(fake_trainer, values, patience=2)
    _, stopper, with_baseline = _run(fake_trainer, values, patience=2, baseline=0.5)
    assert without == [0, 1, 2, 3]
    assert with_baseline == [0, 1, 2] and stopper.stopped_epoch == 2


def test_start_from_epoch_ignores_warm_up(fake_trainer):
    _, stopper, epochs = _run(fake_trainer, [1.0, 2.0, 3.0, 4.0, 5.0], start_from_epoch=2)
    assert epochs == [0, 1, 2, 3]
    assert stopper.best == 3.0 and stopper.best_epoch == 2


def test_restore_best_weights_after_stopping(fake_trainer):
    # The fake trainer fills the weight with the epoch index, so the weight names the epoch.
    trainer, stopper, epochs = _run(
        fake_trainer, [0.5, 0.3, 0.4, 0.6, 0.1], patience=2, restore_best_weights=True
    )
    assert epochs == [0, 1, 2, 3]
    assert stopper.best_epoch == 1
    assert trainer.model.weight.flatten().tolist() == [1.0, 1.0]
    assert stopper.best_weights["weight"].device.type == "cpu"


def test_restore_best_weights_without_stopping(fake_trainer):
    trainer, stopper, _ = _run(fake_trainer, [0.5, 0.3, 0.4], patience=5, restore_best_weights=True)
    assert stopper.stopped_epoch == 0
    assert trainer.model.weight.flatten().tolist() == [1.0, 1.0]


def test_no_restore_by_default(fake_trainer):
    trainer, stopper, _ = _run(fake_trainer, [0.5, 0.3, 0.4, 0.6], patience=1)
    assert stopper.stopped_epoch == 2 and stopper.best_weights is None
    assert trainer.model.weight.flatten().tolist() == [2.0, 2.0]


def test_missing_monitor_warns_once_and_never_stops(fake_trainer):
    trainer = fake_trainer(epochs=4, steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit([EarlyStopping()], epoch_logs=lambda e: {"loss": 1.0})
    assert len([w for w in caught if "`val_loss`" in str(w.message)]) == 1
    assert not trainer.stop_training and trainer.epoch == 3


def test_runs_on_every_rank_and_stops_there_too(fake_trainer):
    trainer = fake_trainer(epochs=3, steps=1, is_chief=False)
    stopper = EarlyStopping()
    assert list(CallbackList([stopper], trainer)) == [stopper]
    trainer.fit([stopper], epoch_logs=[{"val_loss": 1.0}, {"val_loss": 2.0}, {"val_loss": 3.0}])
    assert trainer.stop_training and stopper.stopped_epoch == 1


def test_state_resets_between_fits(fake_trainer):
    trainer = fake_trainer(epochs=3, steps=1)
    stopper = EarlyStopping()
    trainer.fit([stopper], epoch_logs=[{"val_loss": 1.0}, {"val_loss": 2.0}, {"val_loss": 3.0}])
    trainer.fit([stopper], epoch_logs=[{"val_loss": 9.0}, {"val_loss": 8.0}, {"val_loss": 7.0}])
    assert stopper.best == 7.0 and stopper.stopped_epoch == 0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"patience": -1}, "patience"),
        ({"patience": 1.5}, "patience"),
        ({"mode": "lowest"}, "mode"),
        ({"start_from_epoch": -2}, "start_from_epoch"),
        ({"min_delta": "0.1"}, "min_delta"),
        ({"baseline": "low"}, "baseline"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid value for argument `{name}`.*Received: {name}="):
        EarlyStopping(**kwargs)
