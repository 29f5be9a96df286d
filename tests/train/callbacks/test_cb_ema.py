"""EMA: the average a hand computation gives, evaluate/predict with it (and the weights back after),
exact continuation from a backup, and the same average on every rank."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import spread
from spread.errors import SpreadError
from spread.testing import run_ranks
from spread.train.callbacks import EMA, BackupAndRestore, Callback

N, BATCH = 40, 8  # 5 steps per epoch


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class _Recorder(Callback):
    """The model's floating state before training and after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[dict[str, torch.Tensor]] = []

    def _take(self) -> None:
        sd = self.trainer.model.state_dict()
        self.states.append({k: v.clone() for k, v in sd.items() if v.is_floating_point()})

    def on_train_begin(self, logs=None):
        self._take()

    def on_train_batch_end(self, step, logs=None):
        self._take()


class _Interrupt(Callback):
    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.at_step:
            raise KeyboardInterrupt("simulated crash")


def _trainer(model, callbacks=(), strategy=None) -> spread.Trainer:
    return spread.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
        nn.CrossEntropyLoss(),
        strategy=strategy or spread.OneDeviceStrategy("cpu"),
        metrics=["accuracy"],
        callbacks=list(callbacks),
    )


def test_the_average_is_the_hand_computation():
    ema, recorder = EMA(decay=0.9), _Recorder()
    trainer = _trainer(_model(), [recorder, ema])
    trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
    states = recorder.states  # w_0 (before training), w_1 ... w_10
    assert len(states) == 11 and ema.num_updates == 10
    assert ema.shadow is not None
    assert "1.num_batches_tracked" not in ema.shadow  # integer buffers are not averaged
    assert "1.running_mean" in ema.shadow  # floating buffers are
    for key in states[0]:
        expected = states[0][key].double()
        for w in states[1:]:
            expected = 0.9 * expected + 0.1 * w[key].double()
        torch.testing.assert_close(ema.shadow[key].double(), expected, rtol=1e-6, atol=1e-7)


def test_evaluate_and_predict_use_the_average_and_give_the_weights_back():
    ema = EMA(decay=0.8)
    model = _model()
    trainer = _trainer(model, [ema])
    trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert ema.shadow is not None

    averaged = copy.deepcopy(model)
    averaged.load_state_dict({**trained, **ema.shadow})
    plain = _trainer(averaged, strategy=spread.OneDeviceStrategy("cpu"))
    assert trainer.evaluate(_data()) == plain.evaluate(_data())
    assert torch.equal(trainer.predict(_data()), plain.predict(_data()))
    for key, value in model.state_dict().items():  # swapped back
        assert torch.equal(value, trained[key]), key

    ema.use_for_evaluate = False
    live = _trainer(copy.deepcopy(model), strategy=spread.OneDeviceStrategy("cpu"))
    assert trainer.evaluate(_data()) == live.evaluate(_data())
    assert trainer.evaluate(_data()) != plain.evaluate(_data())  # the test above can fail


def test_validation_during_fit_uses_the_average():
    ema = EMA(decay=0.5)
    trainer = _trainer(_model(), [ema])
    history = trainer.fit(_data(), epochs=1, global_batch_size=BATCH, validation_data=_data(), verbose=0)
    ema.use_for_evaluate = False
    with ema.applied():
        expected = trainer.evaluate(_data(), global_batch_size=BATCH)
    assert history.history["val_loss"] == [expected["loss"]]
    assert trainer.evaluate(_data(), global_batch_size=BATCH)["loss"] != expected["loss"]


def _fit_with_backups(backup_dir, extra=(), init_seed=0) -> EMA:
    ema = EMA(decay=0.7)
    trainer = _trainer(_model(init_seed), [BackupAndRestore(str(backup_dir), save_freq=3), ema, *extra])
    trainer.fit(_data(), epochs=3, global_batch_size=BATCH, verbose=0)
    return ema


def test_resume_from_a_backup_continues_the_average_exactly(tmp_path):
    reference = _fit_with_backups(tmp_path / "ref")
    with pytest.raises(KeyboardInterrupt):
        _fit_with_backups(tmp_path / "run", extra=[_Interrupt(8)])
    resumed = _fit_with_backups(tmp_path / "run", init_seed=5)  # another process, other weights
    assert reference.shadow is not None and resumed.shadow is not None
    assert resumed.num_updates == reference.num_updates == 15
    for key, value in reference.shadow.items():
        assert torch.equal(resumed.shadow[key], value), key


def test_a_backup_without_the_callback_warns_and_a_mismatched_one_is_refused(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _fit_with_backups(tmp_path / "run", extra=[_Interrupt(4)])
    trainer = _trainer(_model(), [BackupAndRestore(str(tmp_path / "run"), save_freq=3)])
    with pytest.warns(UserWarning, match="holds the state of a EMA callback that this fit does not have"):
        trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)
    ema = EMA()
    ema.set_trainer(_trainer(nn.Sequential(nn.Linear(6, 3))))
    with pytest.raises(ValueError, match="the saved EMA does not fit this model"):
        ema.load_state_dict({"decay": 0.7, "num_updates": 1, "shadow": {"0.weight": torch.zeros(3, 6)}})


@pytest.mark.parametrize("decay", [1.0, -0.1, "0.9", True])
def test_bad_decay(decay):
    with pytest.raises(ValueError, match="Invalid value for argument `decay`"):
        EMA(decay=decay)


def test_refused_where_the_model_is_not_the_current_weights():
    class Cached(spread.OneDeviceStrategy):
        def local_state_dict(self, model):
            raise SpreadError("the model is a cache of variables held elsewhere")

    trainer = _trainer(_model(), [EMA()], strategy=Cached("cpu"))
    with pytest.raises(SpreadError, match="EMA needs the current weights in every process"):
        trainer.fit(_data(), epochs=1, global_batch_size=BATCH, verbose=0)


def _mwms_ema() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy(sync_batchnorm=True)
    try:
        with strategy.scope():
            model = _model(int(os.environ["RANK"]))
        ema = EMA(decay=0.9)
        trainer = _trainer(model, [ema], strategy=strategy)
        trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
        return {"shadow": ema.shadow, "evaluate": trainer.evaluate(_data())}
    finally:
        strategy.close()


@pytest.mark.processes
def test_multi_worker_mirrored_keeps_the_one_device_average_on_every_rank():
    per_rank = run_ranks(_mwms_ema, 2, timeout=180)
    ema = EMA(decay=0.9)
    trainer = _trainer(_model(), [ema])
    trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
    expected = trainer.evaluate(_data())
    assert ema.shadow is not None
    for rank, result in enumerate(per_rank):
        for key, value in ema.shadow.items():
            torch.testing.assert_close(result["shadow"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert result["evaluate"] == pytest.approx(expected, rel=1e-5), f"rank {rank}"
    for key, value in per_rank[0]["shadow"].items():
        assert torch.equal(value, per_rank[1]["shadow"][key]), key


def _pipeline_ema() -> dict:
    strategy = spread.PipelineStrategy(stages=2, microbatches=1, split_points=[2])
    try:
        with strategy.scope():
            model = _model()
        ema = EMA(decay=0.9)
        trainer = _trainer(model, [ema], strategy=strategy)
        trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
        return {"saved": ema.state_dict(), "evaluate": trainer.evaluate(_data())}  # collective
    finally:
        strategy.close()


@pytest.mark.processes
def test_pipeline_backs_up_the_one_device_average_and_evaluates_with_it():
    """One micro-batch: the pipeline computes what one device does; each stage averages its own
    layers, and the backup state gathers them into the one-device layout."""
    per_rank = run_ranks(_pipeline_ema, 2, timeout=180)
    ema = EMA(decay=0.9)
    trainer = _trainer(_model(), [ema])
    trainer.fit(_data(), epochs=2, global_batch_size=BATCH, verbose=0)
    expected = trainer.evaluate(_data())
    assert ema.shadow is not None
    for rank, result in enumerate(per_rank):
        saved = result["saved"]
        assert saved["num_updates"] == ema.num_updates
        for key, value in ema.shadow.items():
            torch.testing.assert_close(saved["shadow"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert result["evaluate"] == pytest.approx(expected, rel=1e-5), f"rank {rank}"
