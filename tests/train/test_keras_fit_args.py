"""Keras' ``fit`` arguments a translated script uses: ``batch_size``, ``validation_split``,
``class_weight``, ``sample_weight`` (and datasets of ``(x, y, sample_weight)``), ``steps_per_epoch``
beyond the data. Each means what it means in Keras, and every synchronous strategy equals one device."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import spread
from spread.strategies import make_strategy
from spread.testing import run_ranks

N, FEATURES, CLASSES, BATCH = 83, 6, 3, 16  # the last batch of each epoch is uneven
CLASS_WEIGHT = {0: 1.0, 1: 3.0, 2: 0.5}


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    w = torch.rand(N, generator=g) * 2
    return x, y, w


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _fit(strategy=None, *, loss_fn=None, data=None, **fit_args) -> tuple[dict, dict]:
    strategy = make_strategy(strategy)
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    x, y, _ = _data()
    trainer = spread.Trainer(model, optimizer, loss_fn or nn.CrossEntropyLoss(), strategy=strategy)
    fit_args.setdefault("epochs", 2)
    history = trainer.fit((x, y) if data is None else data, seed=3, verbose=0, **fit_args)
    weights = {k: v.detach().clone() for k, v in strategy.full_state_dict(model).items()}
    return weights, history.history


def _close(a: dict, b: dict, tolerance: float = 1e-5) -> None:
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=tolerance, atol=tolerance), key


def _weighted_reference(weights_of_sample: torch.Tensor) -> dict:
    """The same training written out by hand on one device: Keras' weighted loss, sum over n."""
    x, y, _ = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    per_sample = nn.CrossEntropyLoss(reduction="none")
    dataset = spread.OneDeviceStrategy().distribute_dataset(
        (x, y, weights_of_sample), BATCH, shuffle=True, seed=3
    )
    for epoch in range(2):
        dataset.set_epoch(epoch)
        for xb, yb, wb in dataset:
            optimizer.zero_grad()
            ((per_sample(model(xb), yb) * wb).sum() / len(yb)).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sample_weight_is_keras_weighted_loss_summed_over_the_batch_size():
    _, _, w = _data()
    weights, _ = _fit(sample_weight=w, batch_size=BATCH)
    _close(weights, _weighted_reference(w))
    plain, _ = _fit(batch_size=BATCH)
    assert any(not torch.allclose(weights[k], plain[k]) for k in weights)  # the weights did something


def test_class_weight_weighs_each_sample_by_its_class():
    _, y, _ = _data()
    table = torch.tensor([CLASS_WEIGHT[c] for c in range(CLASSES)])
    weights, _ = _fit(class_weight=CLASS_WEIGHT, batch_size=BATCH)
    _close(weights, _weighted_reference(table[y]))


def test_class_and_sample_weights_multiply_and_a_dataset_may_carry_the_weights():
    x, y, w = _data()
    table = torch.tensor([CLASS_WEIGHT[c] for c in range(CLASSES)])
    given, _ = _fit(class_weight=CLASS_WEIGHT, sample_weight=w, batch_size=BATCH)
    _close(given, _weighted_reference(w * table[y]))
    from_dataset, _ = _fit(class_weight=CLASS_WEIGHT, data=TensorDataset(x, y, w), batch_size=BATCH)
    _close(from_dataset, given)
    functional, _ = _fit(
        class_weight=CLASS_WEIGHT, sample_weight=w, batch_size=BATCH, loss_fn=nn.functional.cross_entropy
    )
    _close(functional, given)


def test_validation_split_holds_out_the_last_samples_before_shuffling():
    x, y, _ = _data()
    split_at = int(N * 0.8)
    weights, history = _fit(validation_split=0.2, batch_size=BATCH)
    by_hand, by_hand_history = _fit(
        data=(x[:split_at], y[:split_at]), validation_data=(x[split_at:], y[split_at:]), batch_size=BATCH
    )
    _close(weights, by_hand, 0.0)
    assert history["val_loss"] == by_hand_history["val_loss"] and len(history["val_loss"]) == 2


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_every_keras_argument_at_once_equals_one_device_under_thread_strategies(strategy):
    _, _, w = _data()
    args = {"class_weight": CLASS_WEIGHT, "sample_weight": w, "validation_split": 0.25, "batch_size": BATCH}
    reference, reference_history = _fit(**args)
    weights, history = _fit(make_strategy(strategy), **args)
    _close(weights, reference)
    for name in ("loss", "val_loss"):
        assert history[name] == pytest.approx(reference_history[name], rel=1e-5)


def test_weights_survive_gradient_accumulation():
    _, _, w = _data()
    strategy = spread.OneDeviceStrategy()
    with strategy.scope():
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    x, y, _ = _data()
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, accumulation_steps=2)
    args = {"class_weight": CLASS_WEIGHT, "sample_weight": w, "batch_size": BATCH}
    trainer.fit((x, y), epochs=2, seed=3, verbose=0, **args)
    reference, _ = _fit(class_weight=CLASS_WEIGHT, sample_weight=w, batch_size=BATCH)
    _close(model.state_dict(), reference)


def test_batch_size_is_the_global_batch_and_may_not_contradict_global_batch_size():
    by_keras_name, _ = _fit(batch_size=BATCH)
    by_our_name, _ = _fit(global_batch_size=BATCH)
    _close(by_keras_name, by_our_name, 0.0)
    with pytest.raises(ValueError, match=r"global_batch_size=16 and batch_size=8: they name the same thing"):
        _fit(global_batch_size=16, batch_size=8)


def test_steps_per_epoch_beyond_the_data_warns_as_keras_does():
    with pytest.warns(UserWarning, match=r"steps_per_epoch=70 is more than the 6 batches of the data"):
        _, history = _fit(batch_size=BATCH, steps_per_epoch=70)
    assert len(history["loss"]) == 2


def _unreducible_loss(prediction, target):  # a scalar mean, no reduction= to ask for per-sample values
    return nn.functional.cross_entropy(prediction, target)


@pytest.mark.parametrize(
    ("fit_args", "error", "message"),
    [
        ({"class_weight": {0: 2.0}, "loss_fn": _unreducible_loss}, TypeError, r"the loss_fn must give one"),
        ({"sample_weight": torch.ones(N - 1)}, ValueError, r"sample_weight holds 82 weights for 83 samples"),
        ({"class_weight": {-1: 2.0}}, ValueError, r"class_weight maps class indices"),
        ({"class_weight": {0: float("nan")}}, ValueError, r"class_weight maps class indices"),
        ({"validation_split": 1.5}, ValueError, r"validation_split must be a fraction in \(0, 1\)"),
        (
            {"validation_split": 0.2, "validation_data": (torch.zeros(2, FEATURES), torch.zeros(2).long())},
            ValueError,
            r"both validation_data and validation_split",
        ),
        (
            {"validation_split": 0.2, "data": TensorDataset(*_data()[:2])},
            TypeError,
            r"a TensorDataset cannot be split: pass validation_data instead",
        ),
        (
            {"sample_weight": torch.ones(N), "data": TensorDataset(*_data()[:2])},
            TypeError,
            r"a dataset yields \(x, y, sample_weight\) triples instead",
        ),
    ],
    ids=[
        "loss-without-reduction",
        "weights-length",
        "negative-class",
        "nan-weight",
        "split-range",
        "split-and-data",
        "split-dataset",
        "weights-and-dataset",
    ],
)
def test_bad_keras_arguments_get_a_clear_error_before_training(fit_args, error, message):
    with pytest.raises(error, match=message):
        _fit(batch_size=BATCH, **fit_args)


def test_weights_need_a_loss_fn_not_the_models_own_loss():
    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(FEATURES, CLASSES)

        def forward(self, x, labels):
            logits = self.linear(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    x, y, _ = _data()
    model = OwnLoss()
    trainer = spread.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None)
    with pytest.raises(ValueError, match=r"Trainer\(loss_fn=None\) takes the model's own mean loss"):
        trainer.fit({"x": x, "labels": y}, batch_size=BATCH, class_weight=CLASS_WEIGHT, verbose=0)


def _multi_worker_fit() -> dict:
    _, _, w = _data()
    args = {"class_weight": CLASS_WEIGHT, "sample_weight": w, "validation_split": 0.25, "batch_size": BATCH}
    weights, history = _fit(spread.MultiWorkerMirroredStrategy(), **args)
    return {"weights": weights, "history": history}


@pytest.mark.processes
def test_every_keras_argument_at_once_equals_one_device_under_multi_worker_mirrored():
    _, _, w = _data()
    args = {"class_weight": CLASS_WEIGHT, "sample_weight": w, "validation_split": 0.25, "batch_size": BATCH}
    reference, reference_history = _fit(**args)
    for out in run_ranks(_multi_worker_fit, 2, timeout=240):
        _close(out["weights"], reference)
        assert out["history"]["val_loss"] == pytest.approx(reference_history["val_loss"], rel=1e-5)
