import os
import warnings

import pytest
import torch
from torch import nn

from spread.train.callbacks import CallbackList, ModelCheckpoint


def _weight(path) -> float:
    state = torch.load(path, weights_only=True)
    return float(state["weight"].flatten()[0])


def test_saves_every_epoch_with_formatted_names(fake_trainer, tmp_path):
    trainer = fake_trainer(epochs=3)
    trainer.fit([ModelCheckpoint(tmp_path / "ckpt" / "e{epoch:02d}-{val_loss:.3f}.pt")])
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["e01-2.000.pt", "e02-1.000.pt", "e03-0.667.pt"]
    assert _weight(tmp_path / "ckpt" / "e02-1.000.pt") == 1.0
    state = torch.load(tmp_path / "ckpt" / "e03-0.667.pt", weights_only=True)
    assert state.keys() == trainer.model.state_dict().keys()


def test_save_best_only_min(fake_trainer, tmp_path):
    losses = [0.5, 0.7, 0.3, 0.4]
    trainer = fake_trainer(epochs=4)
    checkpoint = ModelCheckpoint(tmp_path / "best.pt", save_best_only=True)
    trainer.fit([checkpoint], epoch_logs=[{"loss": 1.0, "val_loss": v} for v in losses])
    assert checkpoint.best == 0.3
    assert _weight(tmp_path / "best.pt") == 2.0  # the epoch with val_loss 0.3


def test_save_best_only_auto_is_max_for_accuracy(fake_trainer, tmp_path):
    accuracies = [0.5, 0.9, 0.7]
    checkpoint = ModelCheckpoint(tmp_path / "best-{epoch}.pt", monitor="val_accuracy", save_best_only=True)
    assert checkpoint.mode == "max"
    fake_trainer(epochs=3).fit([checkpoint], epoch_logs=[{"val_accuracy": a} for a in accuracies])
    assert sorted(os.listdir(tmp_path)) == ["best-1.pt", "best-2.pt"]


def test_full_state_with_optimizer(fake_trainer, tmp_path):
    trainer = fake_trainer(epochs=2)
    trainer.optimizer.state[trainer.model.weight]["momentum_buffer"] = torch.ones(1, 2)
    trainer.fit([ModelCheckpoint(tmp_path / "full.pt", save_weights_only=False)])
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "epoch", "global_step"}
    assert state["epoch"] == 1 and state["global_step"] == 8
    assert state["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert float(state["model"]["weight"].flatten()[0]) == 1.0


def test_full_state_holds_the_schedule_and_the_loss_scaler(tmp_path):
    import spread

    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = spread.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        scheduler_interval="step",
        precision="fp16",
    )
    data = (torch.randn(8, 3), torch.randint(0, 2, (8,)))
    trainer.fit(
        data,
        epochs=1,
        global_batch_size=4,
        verbose=0,
        callbacks=[ModelCheckpoint(tmp_path / "full.pt", save_weights_only=False)],
    )
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(state) == {"model", "optimizer", "epoch", "global_step", "lr_scheduler", "grad_scaler"}
    assert state["lr_scheduler"]["last_epoch"] == 2 and state["lr_scheduler"]["_last_lr"] == [0.025]
    assert state["grad_scaler"]["scale"] == trainer.precision.scaler.get_scale()


def test_save_freq_in_batches(fake_trainer, tmp_path):
    trainer = fake_trainer(epochs=2, steps=4)
    trainer.fit([ModelCheckpoint(tmp_path / "s{global_step}-e{epoch}-b{batch}.pt", save_freq=3)])
    assert sorted(os.listdir(tmp_path)) == ["s3-e1-b3.pt", "s6-e2-b2.pt"]


def test_missing_monitor_warns_once_and_goes_on(fake_trainer, tmp_path):
    trainer = fake_trainer(epochs=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            [ModelCheckpoint(tmp_path / "best.pt", save_best_only=True)], epoch_logs=lambda e: {"loss": 1.0}
        )
    messages = [str(w.message) for w in caught if "val_loss" in str(w.message)]
    assert len(messages) == 1 and "`val_loss`" in messages[0]
    assert os.listdir(tmp_path) == []


def test_missing_format_field_names_it(fake_trainer, tmp_path):
    trainer = fake_trainer(epochs=1)
    with pytest.raises(KeyError, match="val_auc"):
        trainer.fit([ModelCheckpoint(tmp_path / "{val_auc}.pt")])


def _checkpoint_on(trainer, path) -> ModelCheckpoint:
    checkpoint = ModelCheckpoint(path)
    CallbackList([checkpoint], trainer)
    return checkpoint


@pytest.mark.parametrize("failure", ["replace", "save"])
def test_failed_write_keeps_previous_file_and_leaves_no_temp(fake_trainer, tmp_path, monkeypatch, failure):
    trainer = fake_trainer()
    path = tmp_path / "model.pt"
    checkpoint = _checkpoint_on(trainer, path)
    checkpoint.on_epoch_end(0, {"val_loss": 1.0})
    before = path.read_bytes()

    if failure == "replace":

        def boom(*args, **kwargs):
            raise OSError("disk on fire")

        monkeypatch.setattr(os, "replace", boom)
    else:

        def half_save(obj, f, *args, **kwargs):
            f.write(b"half a checkpoint")
            raise OSError("disk full")

        monkeypatch.setattr(torch, "save", half_save)
    with torch.no_grad():
        trainer.model.weight.fill_(42.0)
    with pytest.raises(OSError):
        checkpoint.on_epoch_end(1, {"val_loss": 0.5})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.pt"]


def test_failed_best_save_does_not_raise_the_bar(fake_trainer, tmp_path, monkeypatch):
    trainer = fake_trainer()
    checkpoint = ModelCheckpoint(tmp_path / "best.pt", save_best_only=True)
    CallbackList([checkpoint], trainer)
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError("no")))
        with pytest.raises(OSError):
            checkpoint.on_epoch_end(0, {"val_loss": 0.5})
    assert checkpoint.best == float("inf")
    checkpoint.on_epoch_end(1, {"val_loss": 0.5})
    assert (tmp_path / "best.pt").exists()


def test_runs_on_every_rank_and_only_the_chief_writes(fake_trainer, tmp_path):
    # Every rank takes part (the one-device state is collective under Sharded and Pipeline).
    checkpoint = ModelCheckpoint(tmp_path / "m.pt")
    assert list(CallbackList([checkpoint], fake_trainer(is_chief=False))) == [checkpoint]
    fake_trainer(is_chief=False).fit([checkpoint])
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"mode": "best"}, "mode"),
        ({"save_freq": 0}, "save_freq"),
        ({"save_freq": "batch"}, "save_freq"),
        ({"save_freq": True}, "save_freq"),
        ({"monitor": ""}, "monitor"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid value for argument `{name}`.*Received: {name}="):
        ModelCheckpoint(tmp_path / "m.pt", **kwargs)


def test_a_safetensors_name_is_written_as_safetensors(fake_trainer, tmp_path):
    """A ``.safetensors`` name holds safetensors (it held a torch pickle before), loadable without
    torch.load; tied weights (one storage, two names) are written as two tensors."""
    from safetensors.torch import load_file

    trainer = fake_trainer(epochs=2)
    trainer.model.extra = torch.nn.Linear(2, 1)
    trainer.model.extra.weight = trainer.model.weight  # tied
    trainer.fit([ModelCheckpoint(tmp_path / "model-{epoch}.safetensors")])
    saved = load_file(tmp_path / "model-2.safetensors")
    assert set(saved) == set(trainer.model.state_dict())
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(saved[key], value), key


def test_a_safetensors_name_with_the_optimizer_is_refused():
    with pytest.raises(ValueError, match=r"safetensors.*save_weights_only=True"):
        ModelCheckpoint("model.safetensors", save_weights_only=False)
