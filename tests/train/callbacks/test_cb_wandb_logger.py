"""WandbLogger in W&B's offline mode, read back from the run files it writes: one run per job
however many ranks, and a resumed fit continuing the run (same id) instead of opening another."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.testing import run_ranks
from spread.train.callbacks import BackupAndRestore, Callback, WandbLogger

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

N, BATCH, EPOCHS = 64, 16, 3  # 4 steps per epoch, 12 in all
_BLOCK, _HEADER = 32768, 7  # the .wandb file is a LevelDB-style log of Record protobufs


def _records(path: Path) -> list:
    """The Records of an offline run file (W&B keeps no Python reader for them)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset = [], b"", _HEADER
    while offset + _HEADER <= len(data):
        if _BLOCK - offset % _BLOCK < _HEADER:  # a block's tail too short for a header: padding
            offset += _BLOCK - offset % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        offset += _HEADER
        pending += data[offset : offset + length]
        offset += length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _read_run(run_dir: Path) -> tuple[str, list[dict], dict]:
    """The run's id, its history rows and its config, from its directory."""
    (path,) = run_dir.glob("run-*.wandb")
    rows, config, run_id = [], {}, path.stem.removeprefix("run-")
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return run_id, rows, config


def _values(rows: list[dict], key: str) -> list:
    return [row[key] for row in rows if key in row]


class _Crash(Callback):
    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 6:
            raise KeyboardInterrupt("simulated crash")


def _fit(
    strategy: spread.Strategy, logger: WandbLogger, backup_dir: str | None = None, crash: bool = False
) -> int:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks: list[Callback] = [BackupAndRestore(backup_dir, save_freq=4)] if backup_dir else []
    callbacks += [logger, *([_Crash()] if crash else [])]
    trainer = spread.Trainer(model, optimizer, nn.MSELoss(), strategy=strategy, callbacks=callbacks)
    try:
        trainer.fit((x, y), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    finally:
        strategy.close()
    return trainer.global_step


def _rank() -> int:
    logger = WandbLogger(project="spread-test", params={"model": "linear"}, log_every_n_steps=4)
    return _fit(spread.MultiWorkerMirroredStrategy(), logger)


@pytest.mark.processes
def test_a_two_rank_fit_writes_one_offline_run_with_config_and_metrics(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    assert run_ranks(_rank, 2, env=env, timeout=180) == [12, 12]
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")  # one run, not one per rank
    run_id, rows, config = _read_run(run_dir)
    assert run_id and run_dir.name.endswith(run_id)
    assert config["strategy"] == "MultiWorkerMirroredStrategy" and config["num_replicas"] == 2
    assert config["optimizer"] == "Adam" and config["optimizer.lr"] == 0.01 and config["model"] == "linear"
    assert _values(rows, "epoch/epoch") == [0, 1, 2] and len(_values(rows, "epoch/loss")) == 3
    assert len(_values(rows, "epoch/timing/compute_ms")) == 3  # the straggler figures
    assert _values(rows, "batch/step") == [4, 8, 12] and len(_values(rows, "batch/loss")) == 3


@pytest.mark.processes  # W&B starts its wandb-core process
def test_a_resumed_fit_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = pytest.importorskip("wandb")
    try:
        _fit_crash_and_resume(tmp_path)
    finally:
        wandb.teardown()  # the wandb-core process this test's runs started


def _fit_crash_and_resume(tmp_path: Path) -> None:
    backup = str(tmp_path / "backup")
    with pytest.raises(KeyboardInterrupt):
        _fit(spread.OneDeviceStrategy(), WandbLogger(mode="offline", dir=tmp_path), backup, crash=True)
    _fit(spread.OneDeviceStrategy(), WandbLogger(mode="offline", dir=tmp_path), backup)
    # Offline, W&B writes the continuation in a directory of its own, under the same run id.
    first, second = sorted((tmp_path / "wandb").glob("offline-run-*"))
    (first_id, first_rows, _), (second_id, second_rows, _) = _read_run(first), _read_run(second)
    assert first_id == second_id
    assert _values(first_rows, "epoch/epoch") == [0]
    # Resumed at the backup of step 4, before epoch 0 ended: offline, the run's summary is not at hand,
    # so epoch 0's end is logged again there (online, the summary says it is held and it is skipped).
    assert _values(second_rows, "epoch/epoch") == [0, 1, 2]


def test_missing_wandb_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match=r"pip install wandb"):
        WandbLogger()
