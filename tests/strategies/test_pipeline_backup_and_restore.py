"""BackupAndRestore and ModelCheckpoint under PipelineStrategy: an interrupted fit resumes at the exact
step with every stage's weights, optimizer state and RNG, and equals the uninterrupted run; a
ModelCheckpoint file of a pipeline run loads into a one-device model."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import spread
from spread.testing import reap_survivors, run_ranks
from spread.train.callbacks import BackupAndRestore, Callback, ModelCheckpoint

pytestmark = pytest.mark.processes

N, BATCH, EPOCHS, SAVE_FREQ, CRASH_AT = 96, 16, 2, 4, 7  # 6 steps per epoch, 12 in all


class _Interrupt(Callback):
    """Raises on every rank at a given global step, after that step's backup (if any)."""

    def __init__(self, at_step: int) -> None:
        super().__init__()
        self.at_step = at_step

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.at_step:
            raise KeyboardInterrupt("simulated crash")


class _Resumed(Callback):
    """Records the step the first batch of this fit ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.first_step: int | None = None
        self.at: float | None = None

    def on_train_batch_begin(self, step, logs=None):
        if self.first_step is None:
            self.first_step, self.at = self.trainer.global_step, time.monotonic()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(16, 3),
    )


def _fit(strategy, backup_dir: str, *, seed: int, extra=(), ckpt: str | None = None) -> dict:
    """One fit (under ``strategy``) with a backup every SAVE_FREQ steps; returns the gathered final
    weights and optimizer state (collective)."""
    with strategy.scope():
        model = _model(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks = [BackupAndRestore(backup_dir, save_freq=SAVE_FREQ), *extra]
    if ckpt is not None:
        callbacks.append(ModelCheckpoint(ckpt, save_weights_only=False))
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
    history = trainer.fit(_data(), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    out = {
        "weights": strategy.gather_state_dict(model),
        "optimizer": strategy.gather_optimizer_state_dict(optimizer)["state"],
        "history": history.history,
    }
    model.eval()
    out["predict"] = trainer.predict(_data()[0][:20], global_batch_size=8)
    return out


def _strategy(replicas: int):
    # Fixed split points: the split must not depend on timing (the checkpoint would load either way).
    return spread.PipelineStrategy(
        stages=2, microbatches=2, schedule="1f1b", split_points=[3], replicas=replicas
    )


def _reference_then_interrupted(tmp: str, replicas: int) -> dict:
    owner = _strategy(replicas)
    try:
        torch.manual_seed(123)
        reference = _fit(owner, os.path.join(tmp, "ref"), seed=0, ckpt=os.path.join(tmp, "model.pt"))
        second = _strategy(replicas)  # a second model needs its own strategy (the owner keeps the group)
        try:
            torch.manual_seed(123)
            try:
                _fit(second, os.path.join(tmp, "run"), seed=0, extra=[_Interrupt(CRASH_AT)])
            except KeyboardInterrupt:
                pass
            else:
                raise AssertionError("the interrupted fit finished")
        finally:
            second.close()
        return reference
    finally:
        owner.close()


def _resume(tmp: str, replicas: int) -> dict:
    strategy = _strategy(replicas)
    try:
        torch.manual_seed(999)  # a restarted process: other RNG state, other initial weights
        resumed = _Resumed()
        started = time.monotonic()
        out = _fit(strategy, os.path.join(tmp, "run"), seed=7, extra=[resumed])
        out["first_step"] = resumed.first_step
        out["start_to_first_step_s"] = resumed.at - started
        return out
    finally:
        strategy.close()


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


# Hybrid 2 stages x 2 replicas: the stage split and the replica groups in one run. Two stages alone
# resume exactly too, in the SIGKILL-under-spread-run test below (one run fewer for the suite).
@pytest.mark.parametrize("replicas", [2], ids=["hybrid_2x2"])
def test_interrupted_pipeline_fit_resumes_exactly(tmp_path, replicas):
    world = 2 * replicas
    first = run_ranks(_reference_then_interrupted, world, args=(str(tmp_path), replicas), timeout=240)
    second = run_ranks(_resume, world, args=(str(tmp_path), replicas), timeout=240)
    reference = first[0]
    assert not (tmp_path / "ref").exists() and not (tmp_path / "run").exists()  # deleted after finishing
    for rank, got in enumerate(second):
        assert got["first_step"] == 4, (rank, got["first_step"])  # the backup of step 4; 3 recomputed
        diff = _max_abs_diff(got["weights"], reference["weights"])
        assert diff <= 1e-6, (rank, diff)
        assert got["optimizer"].keys() == reference["optimizer"].keys()
        for index, slots in reference["optimizer"].items():  # every stage's Adam state, restored exactly
            for key, value in slots.items():
                torch.testing.assert_close(got["optimizer"][index][key], value, rtol=0, atol=1e-6)
        for key, values in reference["history"].items():
            assert got["history"][key] == pytest.approx(values, rel=1e-6, abs=1e-7), (rank, key)
    print(
        "FIGURES pipeline resume",
        {
            "stages": 2,
            "replicas": replicas,
            "max_abs_weight_diff": max(_max_abs_diff(g["weights"], reference["weights"]) for g in second),
            "steps_recomputed": CRASH_AT - second[0]["first_step"],
            "start_to_resumed_step_s": round(max(g["start_to_first_step_s"] for g in second), 2),
        },
    )
    # A ModelCheckpoint file of the pipeline run: one-device keys, loads into one device, same outputs.
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    model = _model(5)
    model.load_state_dict(saved["model"])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(_data()[0][:20]), reference["predict"], rtol=1e-5, atol=1e-6)
    # ... and its optimizer state is the whole model's (both stages), as one device's would be.
    one = torch.optim.Adam(model.parameters(), lr=0.01)
    one.load_state_dict(saved["optimizer"])
    assert sorted(saved["optimizer"]["state"]) == list(range(len(list(model.parameters()))))


CHAOS_SCRIPT = r"""
import json, os, signal, sys, time
import torch
from torch import nn
import spread
from spread.train.callbacks import BackupAndRestore, Callback

kill = json.loads(os.environ.get("SPREAD_CHAOS", "{}"))
attempt = int(os.environ.get("SPREAD_RESTART_COUNT", "0"))
strategy = spread.PipelineStrategy(stages=2, microbatches=2, schedule="1f1b", split_points=[3])
rank = strategy.rank

def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

say(f"PID attempt={attempt} rank={strategy.rank} pid={os.getpid()}")

class Chaos(Callback):
    def on_train_begin(self, logs=None):
        self.first = True
    def on_train_batch_begin(self, step, logs=None):
        if self.first:
            self.first = False
            say(f"RESUMED attempt={attempt} rank={rank} step={self.trainer.global_step} t={time.time()}")
    def on_train_batch_end(self, step, logs=None):
        step = self.trainer.global_step
        if attempt == 0 and rank == kill.get("rank") and step == kill.get("step"):
            say(f"CHAOS attempt={attempt} rank={rank} step={step} t={time.time()}")
            os.kill(os.getpid(), signal.SIGKILL)

g = torch.Generator().manual_seed(1)
x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
callbacks = [BackupAndRestore(sys.argv[1], save_freq=4), Chaos()]
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
trainer.fit((x, y), epochs=2, global_batch_size=16, verbose=0)
state = strategy.gather_state_dict(model)
if strategy.is_chief:
    say("WEIGHTS " + " ".join(f"{v:.10e}" for t in state.values() for v in t.reshape(-1).tolist()))
strategy.close()
"""


def _spread_run(tmp_path, name: str, chaos: dict, max_restarts: int) -> tuple[str, list[float]]:
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "pipeline_chaos.py"
    script.write_text(CHAOS_SCRIPT)
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SPREAD_JOB_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["SPREAD_CHAOS"], env["SPREAD_COLLECTIVE_TIMEOUT"] = json.dumps(chaos), "20"
    command = [
        str(Path(sys.executable).parent / "spread"),
        "run",
        "-n",
        "2",
        "--max-restarts",
        str(max_restarts),
    ]
    out = subprocess.run(
        [*command, str(script), str(tmp_path / f"backup-{name}")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    log = out.stdout + out.stderr
    pids = [int(p) for p in re.findall(r"PID attempt=\d+ rank=\d+ pid=(\d+)", log)]
    alive = reap_survivors(pids)
    assert not alive, f"ranks left running: {alive}"
    assert out.returncode == 0, log[-4000:]
    match = re.search(r"WEIGHTS (.*)", out.stdout)
    assert match, log[-4000:]
    return log, [float(v) for v in match.group(1).split()]


def test_sigkilled_stage_under_spread_run_restarts_and_resumes_exactly(tmp_path):
    import re

    _, reference = _spread_run(tmp_path, "ref", {}, max_restarts=0)
    log, weights = _spread_run(tmp_path, "run", {"rank": 1, "step": 6}, max_restarts=1)
    assert "restarting (attempt 2 of 2) after rank 1 exited with code 137 (killed by SIGKILL)" in log
    resumed = [
        (int(r), int(s), float(t))
        for r, s, t in re.findall(r"RESUMED attempt=1 rank=(\d) step=(\d+) t=(\S+)", log)
    ]
    assert sorted((r, s) for r, s, _ in resumed) == [(0, 4), (1, 4)]  # the backup of step 4
    killed_at = float(re.search(r"CHAOS attempt=0 rank=1 step=6 t=(\S+)", log).group(1))
    diff = max(abs(a - b) for a, b in zip(weights, reference, strict=True))
    assert diff == 0.0
    figures = {
        "max_abs_weight_diff": diff,
        "steps_recomputed": 2,
        "kill_to_resumed_s": round(min(t for *_, t in resumed) - killed_at, 2),
    }
    print("FIGURES pipeline sigkill", figures)
