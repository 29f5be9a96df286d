import csv
import warnings

import pytest

from spread.train.callbacks import CallbackList, CSVLogger


def _read(path, delimiter=","):
    with open(path, newline="") as f:
        return list(csv.reader(f, delimiter=delimiter))


def test_one_row_per_epoch_with_sorted_columns(fake_trainer, tmp_path):
    path = tmp_path / "logs" / "train.csv"
    fake_trainer(epochs=2).fit([CSVLogger(path)])
    assert _read(path) == [
        ["epoch", "accuracy", "loss", "val_loss"],
        ["0", "0.5", "1.0", "2.0"],
        ["1", "0.5", "0.5", "1.0"],
    ]


def test_separator(fake_trainer, tmp_path):
    path = tmp_path / "train.tsv"
    fake_trainer(epochs=1).fit([CSVLogger(path, separator="\t")])
    assert path.read_text().splitlines()[0] == "epoch\taccuracy\tloss\tval_loss"


def test_missing_keys_are_empty_and_new_keys_warn_once(fake_trainer, tmp_path):
    path = tmp_path / "train.csv"
    logs = [{"loss": 1.0, "val_loss": 2.0}, {"loss": 0.5, "extra": 1}, {"loss": 0.25, "extra": 2}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fake_trainer(epochs=3).fit([CSVLogger(path)], epoch_logs=logs)
    assert _read(path) == [
        ["epoch", "loss", "val_loss"],
        ["0", "1.0", "2.0"],
        ["1", "0.5", ""],
        ["2", "0.25", ""],
    ]
    assert len([w for w in caught if "extra" in str(w.message)]) == 1


def test_append_keeps_header_and_rows(fake_trainer, tmp_path):
    path = tmp_path / "train.csv"
    fake_trainer(epochs=1).fit([CSVLogger(path)])
    fake_trainer(epochs=2).fit([CSVLogger(path, append=True)])
    rows = _read(path)
    assert rows[0] == ["epoch", "accuracy", "loss", "val_loss"]
    assert [row[0] for row in rows[1:]] == ["0", "0", "1"]


def test_without_append_overwrites(fake_trainer, tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("old,content\n1,2\n")
    fake_trainer(epochs=1).fit([CSVLogger(path)])
    assert _read(path)[0] == ["epoch", "accuracy", "loss", "val_loss"]
    assert len(_read(path)) == 2


def test_file_is_closed_after_training(fake_trainer, tmp_path):
    logger = CSVLogger(tmp_path / "train.csv")
    fake_trainer(epochs=1).fit([logger])
    assert logger._file is None


def test_chief_only(fake_trainer, tmp_path):
    assert list(CallbackList([CSVLogger(tmp_path / "x.csv")], fake_trainer(is_chief=False))) == []


@pytest.mark.parametrize(
    ("kwargs", "name"), [({"separator": ",;"}, "separator"), ({"filename": ""}, "filename")]
)
def test_bad_arguments(tmp_path, kwargs, name):
    kwargs = {"filename": tmp_path / "x.csv", **kwargs}
    with pytest.raises(ValueError, match=f"Invalid value for argument `{name}`"):
        CSVLogger(**kwargs)


def test_a_restored_logger_keeps_the_rows_up_to_the_backup_and_appends(fake_trainer, tmp_path):
    """Resumed from a backup taken after epoch 1 while epoch 2's row was already written: the row of
    the epoch trained again is not doubled, and the earlier rows are not truncated away."""
    path = tmp_path / "log.csv"
    first = CSVLogger(path)
    fake_trainer(epochs=3).fit([first])
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and first.state_dict() == {"lines": 4}
    resumed = CSVLogger(path)
    resumed.set_trainer(fake_trainer())
    resumed.on_train_begin()
    resumed.load_state_dict({"lines": 3})  # the backup after epoch 1: header and epochs 0, 1
    resumed.on_epoch_end(2, {"loss": 0.125, "accuracy": 0.5, "val_loss": 0.25})
    resumed.on_train_end()
    assert path.read_text().splitlines() == [*lines[:3], "2,0.5,0.125,0.25"]
