"""Trainer.fit / evaluate / predict: same results under every strategy, same logs on every rank."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import spread
from spread.errors import NonFiniteLossError
from spread.testing import run_ranks

N, GLOBAL_BATCH, EPOCHS = 90, 16, 2  # each epoch ends with an uneven batch of 10


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return x, y


def _fit(strategy) -> dict:
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
    history = trainer.fit(
        _data(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, validation_data=_data(), verbose=0, seed=3
    )
    evaluation = trainer.evaluate(_data(), global_batch_size=32)
    predictions = trainer.predict(_data()[0], global_batch_size=32)
    return {
        "history": history.history,
        "evaluate": evaluation,
        "predict": predictions,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "steps": trainer.global_step,
    }


def _fit_mwms() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        return _fit(strategy)
    finally:
        strategy.close()


@pytest.fixture(scope="module")
def reference():
    return _fit(spread.OneDeviceStrategy("cpu"))


def _assert_same(result: dict, reference: dict) -> None:
    for k, v in reference["weights"].items():
        torch.testing.assert_close(result["weights"][k], v, rtol=1e-5, atol=1e-6)
    for name, values in reference["history"].items():
        assert result["history"][name] == pytest.approx(values, rel=1e-5, abs=1e-6), name
    for name, value in reference["evaluate"].items():
        assert result["evaluate"][name] == pytest.approx(value, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(result["predict"], reference["predict"], rtol=1e-5, atol=1e-5)
    assert result["steps"] == reference["steps"] == EPOCHS * math.ceil(N / GLOBAL_BATCH)


def test_reference_is_sane(reference):
    assert set(reference["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert reference["predict"].shape == (N, 2)
    assert reference["evaluate"]["accuracy"] > 0.8


def test_mirrored_trainer_equals_one_device(reference):
    strategy = spread.MirroredStrategy(num_replicas=3, intra_op_threads=1)
    try:
        _assert_same(_fit(strategy), reference)
    finally:
        strategy.close()


@pytest.mark.processes
def test_multi_worker_trainer_equals_one_device_and_ranks_agree(reference):
    results = run_ranks(_fit_mwms, 2, timeout=120)
    for result in results:
        _assert_same(result, reference)
    assert results[0]["history"] == results[1]["history"]
    assert results[0]["evaluate"] == results[1]["evaluate"]


class _NaNAfter(nn.Module):
    """Produces a NaN output from the given call onwards."""

    def __init__(self, bad_from_call: int) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 2)
        self.calls = 0
        self.bad_from_call = bad_from_call

    def forward(self, x):
        self.calls += 1
        out = self.linear(x)
        return out * float("nan") if self.calls == self.bad_from_call else out


def test_nonfinite_loss_raises_before_the_weights_change():
    model = _NaNAfter(bad_from_call=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy="one_device")
    with pytest.raises(NonFiniteLossError, match="non-finite loss"):
        trainer.fit(_data(), epochs=1, global_batch_size=16, verbose=0)
    assert trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_loss_skip_step_leaves_weights_unchanged():
    model = _NaNAfter(bad_from_call=1)
    before = {k: v.clone() for k, v in model.state_dict().items() if k != "calls"}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), on_nonfinite="skip_step")
    trainer.fit(_data(), epochs=1, global_batch_size=N, verbose=0)  # one step, and it is bad
    assert trainer.skipped_steps == 1 and trainer.global_step == 0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"epochs": 0}, "epochs"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"initial_epoch": 5}, "initial"),
    ],
)
def test_bad_fit_arguments(kwargs, match):
    model = nn.Linear(6, 2)
    trainer = spread.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=match):
        trainer.fit(_data(), **{"epochs": 1, **kwargs}, verbose=0)


def test_bad_trainer_arguments():
    model = nn.Linear(6, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="on_nonfinite"):
        spread.Trainer(model, opt, nn.CrossEntropyLoss(), on_nonfinite="ignore")
    with pytest.raises(ValueError, match="unknown metric"):
        spread.Trainer(model, opt, nn.CrossEntropyLoss(), metrics=["f7"])
    with pytest.raises(ValueError, match="unknown strategy"):
        spread.Trainer(model, opt, nn.CrossEntropyLoss(), strategy="tpu")


# -- Ctrl-C: where fit stopped, in a few lines (issue 39) -------------------------------------------
class _CtrlCAt(spread.callbacks.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.step:
            raise KeyboardInterrupt


def test_ctrl_c_in_fit_says_where_training_stopped_from_fit_itself():
    import traceback

    model = nn.Linear(4, 2)
    trainer = spread.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss())
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    with pytest.raises(KeyboardInterrupt) as raised:
        trainer.fit(data, epochs=2, global_batch_size=8, verbose=0, callbacks=[_CtrlCAt(2)])
    assert str(raised.value) == "fit interrupted in epoch 1, after 3 optimizer step(s)"
    printed = traceback.format_exception(raised.value)
    assert len("".join(printed).splitlines()) <= 8, "".join(printed)  # not the step's ~110 lines


_CTRL_C_SCRIPT = """
import os, signal, threading, torch, spread
from torch import nn

class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2))
    def forward(self, x):
        return self.layers(x)

class Interrupt(spread.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the terminal sends it

strategy = spread.MirroredStrategy(num_replicas=2)
with strategy.scope():
    model = Slow()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((torch.randn(512, 64), torch.randint(0, 2, (512,))), epochs=5, global_batch_size=16,
            verbose=0, callbacks=[Interrupt()])
"""


@pytest.mark.processes
def test_ctrl_c_under_plain_python_prints_a_short_traceback(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_CTRL_C_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "KeyboardInterrupt: fit interrupted in epoch 1, after " in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) <= 10, done.stderr
