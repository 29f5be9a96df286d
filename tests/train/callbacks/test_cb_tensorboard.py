import sys

import pytest

from spread.train.callbacks import CallbackList, TensorBoard

EventAccumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator"
).EventAccumulator


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_epoch_and_batch_scalars(fake_trainer, tmp_path):
    callback = TensorBoard(tmp_path / "tb", update_freq=2)
    fake_trainer(epochs=2, steps=4).fit([callback])
    assert callback.writer is None  # closed on train end
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) == {"epoch/loss", "epoch/accuracy", "epoch/val_loss", "batch/loss", "batch/accuracy"}
    assert scalars["epoch/val_loss"] == [(0, 2.0), (1, 1.0)]
    # Every 2 batches, against the global optimizer step.
    assert [step for step, _ in scalars["batch/loss"]] == [2, 4, 6, 8]
    assert scalars["batch/loss"][0][1] == pytest.approx(0.5)


def test_epoch_only_by_default(fake_trainer, tmp_path):
    fake_trainer(epochs=1).fit([TensorBoard(tmp_path)])
    assert not any(tag.startswith("batch/") for tag in _scalars(tmp_path))


def test_missing_tensorboard_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoard(tmp_path)


def test_chief_only(fake_trainer, tmp_path):
    assert list(CallbackList([TensorBoard(tmp_path)], fake_trainer(is_chief=False))) == []
    assert not list(tmp_path.iterdir())  # nothing written before training starts


@pytest.mark.parametrize("update_freq", [0, -3, "batch", 1.5, True])
def test_bad_update_freq(tmp_path, update_freq):
    with pytest.raises(ValueError, match=r"Invalid value for argument `update_freq`.*Received: update_freq="):
        TensorBoard(tmp_path, update_freq=update_freq)
