"""BackupAndRestore: an interrupted fit resumes at the exact step and ends with identical weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.train.callbacks import BackupAndRestore, Callback

N, BATCH, EPOCHS = 100, 16, 3  # 7 steps per epoch, the last one uneven


class _Interrupt(Callback):
    """Raises at a given global step: a crash in the middle of an epoch."""

    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.at_step:
            raise KeyboardInterrupt("simulated crash")


def _fit(backup_dir, extra=(), init_seed=0, save_freq=3) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks = [BackupAndRestore(str(backup_dir), save_freq=save_freq), *extra]
    trainer = spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy="one_device", callbacks=callbacks
    )
    history = trainer.fit((x, y), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    return {k: v.clone() for k, v in model.state_dict().items()}, history.history


@pytest.mark.parametrize("save_freq,crash_at", [(3, 10), ("epoch", 9), (2, 14), (1, 1)])
def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path, save_freq, crash_at):
    torch.manual_seed(123)
    reference_weights, reference_history = _fit(tmp_path / "ref", save_freq=save_freq)
    assert not (tmp_path / "ref").exists()  # deleted after a normal finish
    torch.manual_seed(123)
    with pytest.raises(KeyboardInterrupt):
        _fit(tmp_path / "run", extra=[_Interrupt(crash_at)], save_freq=save_freq)
    torch.manual_seed(999)  # a restarted process starts with other RNG state and other weights
    weights, history = _fit(tmp_path / "run", init_seed=7, save_freq=save_freq)
    for k, v in reference_weights.items():
        assert torch.equal(weights[k], v), k
    assert history == reference_history


def test_bad_save_freq():
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore("x", save_freq=0)


CHAOS_SCRIPT = r"""
import os, signal, sys, torch
from torch import nn
import spread
from spread.train.callbacks import BackupAndRestore, Callback

class KillAt(Callback):
    def on_train_batch_end(self, step, logs=None):
        attempt = os.environ.get("SPREAD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
        if (attempt == "0" and self.trainer.global_step == int(sys.argv[2])
                and self.trainer.strategy.rank == int(sys.argv[3])):
            print("CHAOS: SIGKILL rank", sys.argv[3], "at step", sys.argv[2], flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

strategy = spread.MultiWorkerMirroredStrategy()
g = torch.Generator().manual_seed(1)
x, y = torch.randn(200, 8, generator=g), torch.randint(0, 3, (200,), generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy,
                         callbacks=[BackupAndRestore(sys.argv[1], save_freq=4), KillAt()])
trainer.fit((x, y), epochs=3, global_batch_size=32, verbose=0)
if strategy.is_chief:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print("WEIGHTS", " ".join(f"{v:.10e}" for v in flat.tolist()))
strategy.close()
"""


def _launch(
    tmp_path: Path, kill_step: int, kill_rank: int, launcher: str = "spread"
) -> tuple[int, list[float], str]:
    """Run the chaos script on 2 workers with one restart allowed, under spread run or torchrun."""
    script = tmp_path / "chaos_train.py"
    script.write_text(CHAOS_SCRIPT)
    bin_dir = Path(sys.executable).parent
    if launcher == "spread":
        command = [str(bin_dir / "spread"), "run", "-n", "2", "--max-restarts", "1"]
    else:
        command = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["SPREAD_COLLECTIVE_TIMEOUT"] = "20"
    backup = tmp_path / f"backup-{launcher}-{kill_step}"
    out = subprocess.run(
        [*command, str(script), str(backup), str(kill_step), str(kill_rank)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    match = re.search(r"WEIGHTS (.*)", out.stdout)
    weights = [float(v) for v in match.group(1).split()] if match else []
    return out.returncode, weights, out.stdout + out.stderr


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    code, weights, log = _launch(tmp_path_factory.mktemp("ref"), kill_step=-1, kill_rank=-1)
    assert code == 0 and weights, log[-3000:]
    return weights


@pytest.mark.parametrize("launcher", ["spread", "torchrun"])
def test_sigkill_a_worker_restart_and_resume_equals_the_uninterrupted_run(tmp_path, uninterrupted, launcher):
    code, resumed, log = _launch(tmp_path, kill_step=11, kill_rank=1, launcher=launcher)
    assert code == 0 and resumed, log[-3000:]
    assert "CHAOS: SIGKILL rank 1 at step 11" in log
    assert max(abs(a - b) for a, b in zip(resumed, uninterrupted, strict=True)) == 0.0
