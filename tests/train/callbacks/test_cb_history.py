from spread.train.callbacks import CallbackList, History


def test_records_each_epoch_and_not_batches(fake_trainer):
    trainer = fake_trainer(epochs=3)
    history = History()
    trainer.fit([history])
    assert history.epoch == [0, 1, 2]
    assert history.history["loss"] == [1.0, 0.5, 1.0 / 3]
    assert history.history["val_loss"] == [2.0, 1.0, 2.0 / 3]
    assert "size" not in history.history


def test_extends_across_fit_calls(fake_trainer):
    trainer = fake_trainer(epochs=2)
    history = History()
    trainer.fit([history])
    trainer.fit([history])
    assert history.epoch == [0, 1, 0, 1]
    assert len(history.history["loss"]) == 4


def test_runs_on_every_rank(fake_trainer):
    history = History()
    assert list(CallbackList([history], fake_trainer(is_chief=False))) == [history]
