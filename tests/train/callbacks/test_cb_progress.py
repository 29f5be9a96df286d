import pytest

from spread.train.callbacks import CallbackList, ProgressBar
from spread.train.callbacks import progress as progress_module


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_plain_lines_when_not_a_tty(fake_trainer, capsys):
    trainer = fake_trainer(epochs=2, steps=20, global_batch_size=16)
    trainer.fit([ProgressBar()])
    lines = _lines(capsys)
    # Default: about four lines per epoch, i.e. every 5 of 20 steps; the last step is the summary.
    step_lines = [line for line in lines if "val_loss" not in line]
    assert len(lines) == 2 * 4
    assert len(step_lines) == 2 * 3
    assert lines[0].startswith("epoch 1/2  step 5/20  loss 0.2000  accuracy 0.5000")
    assert "samples/s  ETA " in lines[0] and lines[0].endswith("s")
    summary = lines[3]
    assert summary.startswith("epoch 1/2  step 20/20  loss 1.0000  accuracy 0.5000  val_loss 2.0000  ")
    assert "samples/s" in summary
    assert summary.endswith("s") and summary.split("  ")[-1][:-1].replace(".", "").isdigit()
    assert lines[-1].startswith("epoch 2/2  step 20/20")
    assert "\r" not in capsys.readouterr().out


def test_log_every_and_unknown_steps(fake_trainer, capsys):
    trainer = fake_trainer(epochs=1, steps=None)
    trainer.fit([ProgressBar(log_every=3)], steps=7)
    lines = _lines(capsys)
    assert [line.split("  ")[1] for line in lines] == ["step 3", "step 6", "step 7"]


def test_verbose_2_prints_only_epoch_summaries(fake_trainer, capsys):
    fake_trainer(epochs=3, steps=20).fit([ProgressBar(verbose=2)])
    lines = _lines(capsys)
    assert len(lines) == 3
    assert all("val_loss" in line and "samples/s" in line for line in lines)


def test_verbose_0_is_silent(fake_trainer, capsys):
    fake_trainer(epochs=2).fit([ProgressBar(verbose=0)])
    assert capsys.readouterr().out == ""


def test_tqdm_bar_on_a_tty(fake_trainer, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_is_tty", lambda stream: True)
    fake_trainer(epochs=2, steps=5).fit([ProgressBar()])
    out = capsys.readouterr().out
    assert "epoch 1/2" in out and "epoch 2/2" in out
    assert "5/5" in out
    assert "samples/s" in out and "val_loss" in out


def test_chief_only(fake_trainer):
    assert list(CallbackList([ProgressBar()], fake_trainer(is_chief=False))) == []


def test_small_values_keep_their_digits():
    assert (
        progress_module.format_logs({"loss": 1.5e-5, "acc": 0.25, "size": 8}) == "loss 1.5000e-05  acc 0.2500"
    )


@pytest.mark.parametrize(("kwargs", "name"), [({"verbose": 3}, "verbose"), ({"log_every": 0}, "log_every")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid value for argument `{name}`"):
        ProgressBar(**kwargs)
