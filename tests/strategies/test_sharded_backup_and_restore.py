"""ShardedStrategy's backups are written per rank through DCP: each rank saves its own pieces of the
parameters and of their per-element optimizer state, nothing is gathered to one rank on the way out,
and a corrupt shard makes the restore fall back to the previous backup. (Resuming at the same and at
other world sizes: tests/strategies/test_sharded.py and tests/train/test_backup_and_restore_world_size.py.)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from _sharded_cases import every_stage
from torch import nn

import spread
from spread.errors import CheckpointMismatchError
from spread.strategies.checkpointing import Saved
from spread.strategies.sharded_state import ShardedLayout
from spread.testing import run_ranks
from spread.train.callbacks import BackupAndRestore, Callback

STAGES = ("optimizer", "gradients", "parameters")
WORLD = 2
N, BATCH = 96, 16  # 6 steps an epoch


class _Crash(Callback):
    """Every rank raises at the same step (after the backups of steps 3, 6 and 9)."""

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 10:
            raise RuntimeError("simulated crash")


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 64, generator=g), torch.randint(0, 4, (N,), generator=g)


def _fit(strategy, backup: BackupAndRestore, *, width: int = 1024, crash: bool = False) -> dict:
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks = [backup, *([_Crash()] if crash else [])]
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
    trainer.fit(_data(), epochs=2, global_batch_size=BATCH, seed=7, verbose=0)
    return strategy.full_state_dict(model)


def _save_without_gathering(strategy, root: str) -> dict:
    """Fit with backups while counting the calls that would build the one-device state."""
    gathers: list[str] = []
    saving = [False]

    def watch(owner, name):
        original = getattr(owner, name)

        def watched(*args, **kwargs):
            if saving[0]:
                gathers.append(name)
            return original(*args, **kwargs)

        setattr(owner, name, watched)

    for name in ("full_state_dict", "unsharded"):
        watch(strategy, name)
    for name in ("all_gather_into", "all_gather_into_async"):
        watch(strategy.collectives, name)
    backup = BackupAndRestore(f"{root}/{strategy.shard}", save_freq=3, delete_checkpoint=False)
    save = backup._save

    def watched_save():
        saving[0] = True
        try:
            return save()
        finally:
            saving[0] = False

    backup._save = watched_save  # type: ignore[method-assign]
    _fit(strategy, backup)
    latest = Path(root, strategy.shard, (Path(root, strategy.shard) / "latest").read_text().strip())
    return {"gathers": gathers, "files": {p.name: p.stat().st_size for p in latest.iterdir()}}


def _no_gather_job(root: str) -> dict:
    return every_stage(STAGES, lambda strategy, rank: _save_without_gathering(strategy, root))


@pytest.mark.processes
def test_each_rank_saves_its_own_half_and_nothing_is_gathered(tmp_path):
    per_rank = run_ranks(_no_gather_job, WORLD, args=(str(tmp_path),), timeout=240)
    numel = 64 * 1024 + 1024 + 1024 * 4 + 4
    full = 3 * numel * 4  # fp32 parameters and Adam's two moments
    for rank, stages in enumerate(per_rank):
        for stage, result in stages.items():
            assert result["gathers"] == [], f"rank {rank}, shard={stage}: {result['gathers']}"
            files = result["files"]
            for r in range(WORLD):  # each rank's file holds its half, not the whole model
                size = files[f"__{r}_0.distcp"]
                assert 0.45 * full < size < 0.55 * full, f"shard={stage}: rank {r} wrote {size} of {full}"
            assert files["state.pt"] < 0.1 * full, f"shard={stage}: the replicated part holds weights"


def _corrupt_then_resume(strategy, root: str) -> dict:
    rank = int(os.environ["RANK"])
    directory = f"{root}/{strategy.shard}"
    reference = _fit(strategy, BackupAndRestore(f"{directory}-ref", save_freq=3))
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(strategy, BackupAndRestore(directory, save_freq=3), crash=True)
    strategy.collectives.barrier(name="test.crashed")
    if rank == 0:  # damage rank 1's shard of the newest backup (step 9)
        shard = Path(directory, "ckpt-0000000009", "__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    strategy.collectives.barrier(name="test.corrupted")
    refused = re.escape("model: '0.weight': saved (1024, 64) float32, expected (512, 64) float32")
    with (
        pytest.warns(RuntimeWarning, match="ckpt-0000000009 is unusable"),
        pytest.raises(CheckpointMismatchError, match=refused),
    ):
        _fit(strategy, BackupAndRestore(directory, save_freq=3), width=512)  # another model
    backup = BackupAndRestore(directory, save_freq=3)
    with pytest.warns(RuntimeWarning, match="falling back to an older one"):
        resumed = _fit(strategy, backup)
    return {"restored": backup.restored_step, "reference": reference, "resumed": resumed}


def _corrupt_job(root: str) -> dict:
    return every_stage(STAGES, lambda strategy, rank: _corrupt_then_resume(strategy, root))


@pytest.mark.processes
def test_a_corrupt_shard_falls_back_to_the_previous_backup_and_ends_the_same(tmp_path):
    per_rank = run_ranks(_corrupt_job, WORLD, args=(str(tmp_path),), timeout=300)
    for rank, stages in enumerate(per_rank):
        for stage, result in stages.items():
            assert result["restored"] == 6, f"rank {rank}, shard={stage}"
            for key, value in result["reference"].items():
                assert torch.equal(result["resumed"][key], value), f"rank {rank}, shard={stage}, {key}"


def _one_device_backup_then_resume(root: str) -> dict:
    """A backup of the gathered one-device state (what a strategy holding whole copies writes)
    resumes into the shards and ends as the uninterrupted run."""
    strategy = spread.ShardedStrategy(shard="parameters")
    try:
        reference = _fit(strategy, BackupAndRestore(f"{root}/ref", save_freq=3))
        strategy._state_layout = lambda: _GatheredLayout(strategy)  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit(strategy, BackupAndRestore(f"{root}/run", save_freq=3), crash=True)
        assert not any(Path(root, "run", "ckpt-0000000009").glob("*.distcp"))
        del strategy._state_layout
        backup = BackupAndRestore(f"{root}/run", save_freq=3)
        resumed = _fit(strategy, backup)
        return {"restored": backup.restored_step, "reference": reference, "resumed": resumed}
    finally:
        strategy.close()


class _GatheredLayout(ShardedLayout):
    """Writes the one-device state, gathered (as MultiWorkerMirrored's layout does)."""

    def module_state(self, model):
        return Saved(self.full_state_dict(model))

    def optimizer_state(self, optimizer):
        return Saved(self.full_state_dict(optimizer))


@pytest.mark.processes
def test_a_backup_of_the_one_device_state_still_resumes(tmp_path):
    per_rank = run_ranks(_one_device_backup_then_resume, WORLD, args=(str(tmp_path),), timeout=240)
    for rank, result in enumerate(per_rank):
        assert result["restored"] == 9, rank
        for key, value in result["reference"].items():
            assert torch.equal(result["resumed"][key], value), f"rank {rank}, {key}"
