"""BackupAndRestore: an interrupted fit resumes at the exact step and ends with identical weights."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

import spread
from spread.errors import CheckpointMismatchError
from spread.strategies import StateLayout
from spread.testing import reap_survivors
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


def _fit_scheduled(backup_dir, schedule: str, extra=(), init_seed=0) -> tuple[dict, dict, dict]:
    """A fit with a learning-rate schedule, fp16 loss scaling and clipping: their state must resume."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if schedule == "one_cycle":  # per step, state-rich (phases, momentum cycling)
        options = {
            "lr_scheduler": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, 0.5, total_steps=EPOCHS * 7),
            "scheduler_interval": "step",
        }
    else:  # per epoch, driven by the logs (best value, patience counter)
        options = {
            "lr_scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(
                opt, mode="max", patience=0
            ),
            "scheduler_monitor": "loss",
        }
    trainer = spread.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        callbacks=[BackupAndRestore(str(backup_dir), save_freq=2), *extra],
        precision="fp16",
        clip_grad_norm=0.5,
        **options,
    )
    trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    history = trainer.fit((x, y), epochs=EPOCHS, global_batch_size=BATCH, verbose=0)
    state = trainer.state_dict()
    return {k: v.clone() for k, v in model.state_dict().items()}, history.history, state


@pytest.mark.parametrize("schedule", ["one_cycle", "plateau"])
def test_resume_continues_the_schedule_and_the_loss_scale_exactly(tmp_path, schedule):
    torch.manual_seed(123)
    reference_weights, reference_history, reference_state = _fit_scheduled(tmp_path / "ref", schedule)
    assert len(set(reference_history["lr"])) >= 2  # the rate changed
    assert reference_state["grad_scaler"]["scale"] != 2.0**20  # and so did the loss scale
    torch.manual_seed(123)
    with pytest.raises(KeyboardInterrupt):
        _fit_scheduled(tmp_path / "run", schedule, extra=[_Interrupt(11)])  # mid-epoch 2, after a backup
    torch.manual_seed(999)
    weights, history, state = _fit_scheduled(tmp_path / "run", schedule, init_seed=7)
    for k, v in reference_weights.items():
        assert torch.equal(weights[k], v), k
    assert history == reference_history  # lr and grad_norm included
    assert state["lr_scheduler"] == reference_state["lr_scheduler"]
    assert state["grad_scaler"] == reference_state["grad_scaler"]
    assert torch.equal(state["grad_norm_sums"], reference_state["grad_norm_sums"])


def test_bad_save_freq():
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore("x", save_freq=0)


def _fit_where_rank_1_raises() -> float:
    """R5 without a launcher: rank 1 raises at step 3; rank 0 must fail on its own, naming the op."""
    import time

    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        raise_at = _RaiseOnRank(rank=1, at_step=3)
        trainer = spread.Trainer(
            model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=[raise_at]
        )
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
        try:
            trainer.fit((x, y), epochs=2, global_batch_size=BATCH, verbose=0)
        except Exception as exc:
            exc.add_note(f"DETECTED_AFTER_S={time.time() - raise_at.raised_at_file():.3f}")
            raise
        return 0.0
    finally:
        strategy.close()


class _RaiseOnRank(Callback):
    def __init__(self, rank: int, at_step: int) -> None:
        super().__init__()
        self.rank, self.at_step = rank, at_step
        self.stamp = Path(os.environ["SPREAD_TEST_STAMP"])

    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == self.at_step and self.trainer.strategy.rank == self.rank:
            self.stamp.write_text(repr(time.time()))
            raise RuntimeError(f"rank {self.rank} fails at step {self.at_step}")

    def raised_at_file(self) -> float:
        deadline = time.time() + 5
        while not self.stamp.exists() and time.time() < deadline:
            time.sleep(0.01)
        return float(self.stamp.read_text())


@pytest.mark.processes
def test_r5_without_a_launcher_the_other_rank_fails_within_the_collective_timeout(tmp_path):
    from spread.testing import launch_ranks

    results = launch_ranks(
        _fit_where_rank_1_raises,
        2,
        env={"SPREAD_TEST_STAMP": str(tmp_path / "raised")},
        collective_timeout=10,
        fail_fast_grace=30,
        timeout=120,
    )
    assert results[1].error == "RuntimeError: rank 1 fails at step 3", results[1].describe()
    other = results[0]
    assert other.error and other.error.startswith(("PeerLostError", "CollectiveTimeout")), other.describe()
    assert other.error.startswith(("PeerLostError: rank 0: ", "CollectiveTimeout: rank 0: "))
    detected = float(re.search(r"DETECTED_AFTER_S=([0-9.]+)", other.traceback).group(1))
    assert detected < 10 + 15  # the collective timeout plus a margin for a loaded machine
    print("FIGURES R5 detection", {"seconds": detected, "error": other.error[:160]})


def _fit_with_an_unwritable_backup_dir(backup_dir: str) -> None:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        with strategy.scope():
            model = nn.Sequential(nn.Linear(8, 3))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        callbacks = [BackupAndRestore(backup_dir, save_freq=2)]
        trainer = spread.Trainer(
            model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks
        )
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
        trainer.fit((x, y), epochs=1, global_batch_size=BATCH, verbose=0)
    finally:
        strategy.close()


@pytest.mark.processes
def test_a_chief_that_cannot_write_the_backup_stops_every_rank_with_a_clear_error(tmp_path):
    from spread.testing import launch_ranks

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    results = launch_ranks(
        _fit_with_an_unwritable_backup_dir,
        2,
        args=(str(blocker / "backup"),),
        collective_timeout=30,
        timeout=120,
    )
    assert results[0].error and results[0].error.startswith(("FileExistsError", "NotADirectoryError"))
    assert results[1].error == (
        f"PeerFailedError: rank 1: rank 0 failed: it could not write the checkpoint of step 2 to "
        f"{blocker / 'backup'} (its log says why); stopping so that no rank runs ahead of it"
    ), results[1].describe()


# -- C6: a backup restored into another model, optimizer or strategy ---------------------------------
def _backup_once(backup_dir) -> None:
    with pytest.raises(KeyboardInterrupt):
        _fit(backup_dir, extra=[_Interrupt(4)], save_freq=2)


def _restore_into(backup_dir, model, optimizer, strategy, batch=BATCH, seed=0):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
    trainer = spread.Trainer(
        model,
        optimizer,
        nn.CrossEntropyLoss(),
        strategy=strategy,
        callbacks=[BackupAndRestore(str(backup_dir))],
    )
    trainer.fit((x, y), epochs=EPOCHS, global_batch_size=batch, seed=seed, verbose=0)


def test_a_backup_resumed_with_another_data_seed_is_refused(tmp_path):
    """fit(seed=5) on a backup of fit(seed=0) would reshuffle the rest of the epoch: samples
    repeated or skipped, silently. Refused, as another batch size is."""
    _backup_once(tmp_path)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(CheckpointMismatchError) as info:
        _restore_into(tmp_path, model, optimizer, "one_device", seed=5)
    assert info.value.problems == ["seed: saved 0, now 5"]
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_c6_a_backup_restored_into_another_model_lists_every_mismatched_key(tmp_path):
    _backup_once(tmp_path)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3), nn.Softmax(-1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as info:
        _restore_into(tmp_path, model, torch.optim.Adam(model.parameters(), lr=0.01), "one_device")
    problems = info.value.problems
    assert "model: '0.weight': saved (16, 8) float32, expected (32, 8) float32" in problems
    assert "model: '3.weight': saved (3, 16) float32, expected (3, 32) float32" in problems
    assert any("optimizer: optimizer state 0.exp_avg" in p for p in problems)
    assert "ckpt-0000000004" in str(info.value) and "start afresh" in str(info.value)
    for k, v in model.state_dict().items():  # refused before anything was overwritten
        assert torch.equal(v, before[k]), k


def test_c6_a_backup_restored_with_another_batch_or_optimizer_lists_every_field(tmp_path):
    _backup_once(tmp_path)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    strategy = spread.MirroredStrategy(num_replicas=2)  # another data-parallel strategy: allowed
    with pytest.raises(CheckpointMismatchError) as info:
        _restore_into(tmp_path, model, optimizer, strategy, batch=2 * BATCH)
    assert info.value.problems == [
        f"global_batch_size: saved {BATCH}, now {2 * BATCH}",
        "optimizer: saved 'Adam', now 'SGD'",
    ]
    assert "ckpt-0000000004" in str(info.value)
    for k, v in model.state_dict().items():  # refused before any weight was overwritten
        assert torch.equal(v, before[k]), k
    print("FIGURES C6", info.value)


def test_a_backup_restored_under_another_kind_of_strategy_is_refused_by_name(tmp_path):
    _backup_once(tmp_path)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    strategy = spread.OneDeviceStrategy("cpu")
    strategy._state_layout = lambda: _OtherFamily(strategy)  # as a pipeline's or servers' layout
    with pytest.raises(CheckpointMismatchError, match="written by OneDeviceStrategy"):
        _restore_into(tmp_path, model, optimizer, strategy)


class _OtherFamily(StateLayout):
    family = "pipeline"


CHAOS_SCRIPT = r"""
import json, os, signal, sys, time
import psutil, torch
from torch import nn
import spread
from spread.train.callbacks import BackupAndRestore, Callback

# One fault schedule per run, from one environment variable (see _launch); by default a fault fires
# only on the first attempt, so the restarted group runs clean.
cfg = json.loads(os.environ.get("SPREAD_CHAOS", "{}"))
attempt = int(os.environ.get("SPREAD_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
backup_dir, report_dir = sys.argv[1], sys.argv[2]
armed = cfg.get("every_attempt", False) or attempt == 0

def say(line):  # one write per line: under torchrun all ranks share one stdout pipe
    sys.stdout.write(line + "\n")
    sys.stdout.flush()

strategy = spread.MultiWorkerMirroredStrategy()
rank = strategy.rank
say(f"PID attempt={attempt} rank={rank} pid={os.getpid()}")
with open(os.path.join(report_dir, f"token-{attempt}-{rank}"), "w") as f:  # for the S6 search only
    f.write(os.environ.get("SPREAD_JOB_TOKEN", ""))

class IdModel(nn.Module):
    # Column 0 of every sample is its id: the model trains on the rest and remembers the ids it saw.
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
        self.ids = []
    def forward(self, x):
        self.ids = [int(i) for i in x[:, 0].tolist()]
        return self.net(x[:, 1:])

class Chaos(Callback):
    def fire(self, hook):
        step = self.trainer.global_step
        if not armed or cfg.get("hook", "batch_end") != hook or step != cfg.get("step"):
            return
        if rank not in cfg.get("ranks", []):
            return
        mode = cfg.get("mode", "sigkill")
        say(f"CHAOS attempt={attempt} rank={rank} step={step} mode={mode} t={time.time():.6f}")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"chaos: rank {rank} fails at step {step}")
    def on_train_begin(self, logs=None):
        restored = backup.restored_step
        say(f"RESTORED attempt={attempt} rank={rank} step={restored}")
        self.first = True
    def on_train_batch_begin(self, step, logs=None):
        if self.first:
            self.first = False
            step = self.trainer.global_step
            say(f"RESUMED attempt={attempt} rank={rank} step={step} t={time.time():.6f}")
        self.fire("batch_begin")
    def on_epoch_begin(self, epoch, logs=None):
        self.fire("epoch_begin")
    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 2:
            listen = [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections("inet")
                      if c.status == psutil.CONN_LISTEN]
            addrs = json.dumps(listen, separators=(",", ":"))  # no spaces: one key=value field
            say(f"LISTEN attempt={attempt} rank={rank} addrs={addrs}")
            launcher = psutil.Process(os.getppid())
            job = [launcher, *launcher.children(recursive=True)]
            if rank == 0:  # every socket of the job: launcher, its store process, every rank
                every = [f"{c.laddr.ip}:{c.laddr.port}" for p in job for c in p.net_connections("inet")
                         if c.status == psutil.CONN_LISTEN]
                say(f"JOBLISTEN attempt={attempt} addrs={json.dumps(every, separators=(',', ':'))}")
            with open(os.path.join(report_dir, f"cmdlines-{attempt}-{rank}.json"), "w") as f:
                json.dump([" ".join(p.cmdline()) for p in job], f)
        self.fire("batch_end")

class BeforeBackup(Callback):  # runs before BackupAndRestore's save of the same step
    def on_train_batch_end(self, step, logs=None):
        ids = ",".join(map(str, self.trainer.model.ids))  # applied by this step's optimizer update
        say(f"IDS attempt={attempt} rank={rank} step={self.trainer.global_step} ids={ids}")
        # the save at crash_step dies at crash_point
        if armed and cfg.get("crash_point") and self.trainer.global_step == cfg["crash_step"]:
            # the previous backup, if still written in the background, is not the one to crash
            self.trainer.strategy.wait_for_checkpoint()
        if armed and rank == 0 and cfg.get("crash_point") and self.trainer.global_step == cfg["crash_step"]:
            say(f"CHAOS attempt={attempt} rank={rank} step={self.trainer.global_step} "
                  f"mode=crash_point:{cfg['crash_point']} t={time.time():.6f}")
            os.environ["SPREAD_CHECKPOINT_CRASH_AT"] = cfg["crash_point"]

g = torch.Generator().manual_seed(1)
n = 200
x = torch.cat([torch.arange(n, dtype=torch.float32)[:, None], torch.randn(n, 8, generator=g)], dim=1)
y = torch.randint(0, 3, (n,), generator=g)
torch.manual_seed(0)
with strategy.scope():
    model = IdModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
save_freq = cfg.get("save_freq", 4)
keep = cfg.get("keep_backup", False)
backup = BackupAndRestore(backup_dir, save_freq=save_freq, delete_checkpoint=not keep,
                          async_save=cfg.get("async_save", True))
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy,
                         callbacks=[BeforeBackup(), backup, Chaos()])
trainer.fit((x, y), epochs=3, global_batch_size=32, verbose=0)
if strategy.is_chief:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    say("WEIGHTS " + " ".join(f"{v:.10e}" for v in flat.tolist()))
strategy.close()
"""

STEPS_PER_EPOCH, TOTAL_STEPS, SAMPLES = 7, 21, 200


@dataclass
class Run:
    """What one launch of the chaos script printed and left behind."""

    code: int
    log: str
    seconds: float
    report_dir: Path
    backup_dir: Path
    weights: list[float] = field(default_factory=list)
    ended: float = 0.0  # time.time() when spread run returned

    def events(self, kind: str) -> list[dict]:
        """Every ``KIND key=value ...`` line, as a dict (values parsed as numbers where they are)."""
        found = []
        for line in self.log.splitlines():
            _, _, rest = line.partition("] ")  # strip spread run's "[rank R] " prefix
            rest = rest if rest.startswith(kind + " ") else line
            if not rest.startswith(kind + " "):
                continue
            fields = dict(item.split("=", 1) for item in rest[len(kind) + 1 :].split(" ") if "=" in item)
            found.append({k: _number(v) for k, v in fields.items()})
        return found

    def restored(self, attempt: int) -> int:
        steps = {e["step"] for e in self.events("RESTORED") if e["attempt"] == attempt}
        assert len(steps) == 1, steps  # every rank restored the same step
        step = steps.pop()
        return 0 if step == "None" else step

    def attempts(self) -> int:
        return len({e["attempt"] for e in self.events("PID")})

    def committed_ids(self) -> list[list[int]]:
        """The ids whose gradients reached the final weights, per global step in step order.

        A step done by attempt ``a`` counts only if the next attempt restored a state that includes
        it (its step <= the next attempt's restored step); the last attempt's steps all count.
        """
        last = max(e["attempt"] for e in self.events("PID"))
        per_step: dict[int, dict[int, list[int]]] = {}
        for e in self.events("IDS"):
            a = e["attempt"]
            if a < last and e["step"] > self.restored(a + 1):
                continue  # rolled back: recomputed by a later attempt
            ranks = per_step.setdefault(e["step"], {})
            assert e["rank"] not in ranks, f"step {e['step']} committed twice by rank {e['rank']}"
            ranks[e["rank"]] = [int(i) for i in str(e["ids"]).split(",") if i != ""]
        return [
            list(chain.from_iterable(ranks[r] for r in sorted(ranks)))
            for _, ranks in sorted(per_step.items())
        ]

    def token(self) -> str:
        tokens = {p.read_text() for p in self.report_dir.glob("token-*")}
        assert len(tokens) == 1, "every rank of every attempt shares one job token"
        return tokens.pop()


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def _launch(
    tmp_path: Path,
    chaos: dict | None = None,
    *,
    nproc: int = 2,
    max_restarts: int = 1,
    launcher: str = "spread",
    name: str = "run",
) -> Run:
    """Run the chaos script on ``nproc`` workers under spread run (or torchrun) with a hard timeout."""
    script = tmp_path / "chaos_train.py"
    script.write_text(CHAOS_SCRIPT)
    report, backup = tmp_path / f"report-{name}", tmp_path / f"backup-{name}"
    report.mkdir()
    bin_dir = Path(sys.executable).parent
    if launcher == "spread":
        command = [str(bin_dir / "spread"), "run", "-n", str(nproc), "--max-restarts", str(max_restarts)]
    else:
        command = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(nproc)]
        command += ["--max-restarts", str(max_restarts)]
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "SPREAD_JOB_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in drop}  # the defaults a user gets
    env["SPREAD_COLLECTIVE_TIMEOUT"] = "20"
    env["SPREAD_CHAOS"] = json.dumps(chaos or {})
    if launcher == "torchrun":  # torchrun knows no job token: a user exports one (never on a command line)
        env["SPREAD_JOB_TOKEN"] = secrets.token_hex(16)
    start = time.monotonic()
    out = subprocess.run(
        [*command, str(script), str(backup), str(report)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    run = Run(out.returncode, out.stdout + out.stderr, time.monotonic() - start, report, backup)
    run.ended = time.time()
    match = re.search(r"WEIGHTS (.*)", out.stdout)
    run.weights = [float(v) for v in match.group(1).split()] if match else []
    _assert_ranks_gone(run)
    _assert_listeners_gone(run)
    _assert_token_never_leaked(run)
    return run


def _assert_listeners_gone(run: Run) -> None:
    """No socket the ranks listened on (store, gloo) is still listening once spread run returned."""
    ports = {int(a.rsplit(":", 1)[1]) for e in run.events("LISTEN") for a in json.loads(e["addrs"])}
    still = [
        c.laddr
        for c in psutil.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    ]
    assert not still, f"listening sockets left behind: {still}"


def _assert_ranks_gone(run: Run) -> None:
    """No rank of any attempt outlives the launcher (they are grandchildren: conftest cannot see them)."""
    alive = reap_survivors(e["pid"] for e in run.events("PID"))
    assert not alive, f"ranks left running: {alive}"


def _assert_token_never_leaked(run: Run) -> None:
    """S6: the job token is in no output line, traceback, command line or checkpoint file."""
    token = run.token()
    assert len(token) == 32
    assert token not in run.log
    for path in run.report_dir.glob("cmdlines-*.json"):
        assert token not in path.read_text(), path
    if run.backup_dir.exists():
        for path in run.backup_dir.rglob("*"):
            assert not path.is_file() or token.encode() not in path.read_bytes(), path


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _epochs(steps: list[list[int]]) -> list[list[int]]:
    assert len(steps) == TOTAL_STEPS, f"{len(steps)} committed steps, expected {TOTAL_STEPS}"
    return [
        list(chain.from_iterable(steps[e * STEPS_PER_EPOCH : (e + 1) * STEPS_PER_EPOCH])) for e in range(3)
    ]


def _recovery(run: Run) -> dict:
    """Figures for docs/reliability.md: weights diff is added by the caller."""
    chaos = run.events("CHAOS")
    resumed = [e for e in run.events("RESUMED") if e["attempt"] == 1 and e["rank"] == 0]
    figures = {"attempts": run.attempts(), "wall_s": round(run.seconds, 1)}
    if chaos and resumed:
        figures["kill_to_resumed_s"] = round(resumed[0]["t"] - chaos[0]["t"], 2)
        figures["restored_step"] = run.restored(1)
        figures["steps_recomputed"] = chaos[0]["step"] - run.restored(1)
    print("FIGURES", json.dumps(figures))
    return figures


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Run:
    run = _launch(tmp_path_factory.mktemp("ref"), {"keep_backup": True}, max_restarts=0, name="ref")
    assert run.code == 0 and run.weights, run.log[-3000:]
    return run


def _assert_exact(run: Run, reference: Run) -> float:
    """The resumed run ends with the reference's weights and committed every sample id exactly once
    per epoch, in the reference's order (R1, R3)."""
    assert run.code == 0 and run.weights, run.log[-3000:]
    diff = _max_diff(run.weights, reference.weights)
    assert diff == 0.0
    epochs, expected = _epochs(run.committed_ids()), _epochs(reference.committed_ids())
    for got, want in zip(epochs, expected, strict=True):
        assert sorted(got) == list(range(SAMPLES))  # no duplicate, none missing
        assert got == want  # the same order as the uninterrupted run
    return diff


@pytest.mark.parametrize("launcher", ["spread", "torchrun"])
@pytest.mark.processes
def test_sigkill_a_worker_restart_and_resume_equals_the_uninterrupted_run(tmp_path, uninterrupted, launcher):
    run = _launch(tmp_path, {"mode": "sigkill", "step": 11, "ranks": [1]}, launcher=launcher)
    assert "CHAOS attempt=0 rank=1 step=11 mode=sigkill" in run.log
    _assert_exact(run, uninterrupted)
    figures = _recovery(run)
    # backups every 4 steps, written in the background: the one of step 8 may still be in flight
    assert figures["restored_step"] in (4, 8) and figures["attempts"] == 2


@pytest.mark.processes
def test_r1_sigkill_one_of_four_workers(tmp_path):
    reference = _launch(tmp_path, nproc=4, max_restarts=0, name="ref4")
    assert reference.code == 0 and reference.weights, reference.log[-3000:]
    run = _launch(tmp_path, {"mode": "sigkill", "step": 6, "ranks": [2]}, nproc=4)
    assert "CHAOS attempt=0 rank=2 step=6 mode=sigkill" in run.log
    _assert_exact(run, reference)
    figures = _recovery(run)
    # the backup of step 4 may still be in flight at the kill (asynchronous backups)
    assert figures["steps_recomputed"] in (2, 6) and figures["attempts"] == 2


# R2: kill points. (chaos, restored steps): the step the restarted group may resume from. Backups
# are asynchronous by default: a kill while the newest backup is still being written in the
# background costs that backup (never the one before), so a kill soon after a backup resumes from it
# or from the one before; a crash point inside the write itself is deterministic.
R2_POINTS = {
    "step0": ({"mode": "sigkill", "step": 0, "ranks": [1], "hook": "batch_begin"}, {0}),
    "last_step": ({"mode": "sigkill", "step": 21, "ranks": [0]}, {16, 20}),
    "last_step_synchronous": ({"mode": "sigkill", "step": 21, "ranks": [0], "async_save": False}, {20}),
    "epoch_boundary": (
        {"mode": "sigkill", "step": 14, "ranks": [1], "hook": "epoch_begin", "save_freq": "epoch"},
        {7, 14},
    ),
    "epoch_end_before_on_epoch_end": (
        {"mode": "sigkill", "step": 14, "ranks": [1], "save_freq": 7, "async_save": False},
        {14},
    ),
    "save_after_shard_write": ({"crash_point": "after_shard_write", "crash_step": 12}, {8}),
    "save_after_manifest": ({"crash_point": "after_manifest", "crash_step": 12}, {8}),
    "save_after_manifest_synchronous": (
        {"crash_point": "after_manifest", "crash_step": 12, "async_save": False},
        {8},
    ),
    "save_after_pointer": ({"crash_point": "after_pointer", "crash_step": 12}, {12}),
}


@pytest.mark.parametrize("point", list(R2_POINTS))
@pytest.mark.processes
def test_r2_kill_points(tmp_path, uninterrupted, point):
    chaos, restored = R2_POINTS[point]
    run = _launch(tmp_path, chaos)
    assert len(run.events("CHAOS")) == 1, run.log[-3000:]
    assert run.restored(1) in restored
    _assert_exact(run, uninterrupted)
    figures = _recovery(run)
    assert figures["attempts"] == 2


@pytest.mark.processes
def test_r5_a_rank_raises_the_group_restarts_and_finishes(tmp_path, uninterrupted):
    run = _launch(tmp_path, {"mode": "raise", "step": 9, "ranks": [1]})
    assert "RuntimeError: chaos: rank 1 fails at step 9" in run.log
    assert "restarting (attempt 2 of 2) after rank 1 exited with code 1" in run.log
    _assert_exact(run, uninterrupted)
    _recovery(run)


@pytest.mark.processes
def test_r5_when_restarts_run_out_spread_run_exits_with_the_failing_ranks_code(tmp_path):
    run = _launch(tmp_path, {"mode": "raise", "step": 3, "ranks": [1]}, max_restarts=0)
    assert run.code == 1, run.log[-3000:]
    cause = "rank 1 exited with code 1 (RuntimeError: chaos: rank 1 fails at step 3)"
    assert f"{cause}; stopped the other 1 process(es)" in run.log
    job_ended_after = run.ended - run.events("CHAOS")[0]["t"]  # the others stopped and reaped too
    print("FIGURES", json.dumps({"exit": run.code, "raise_to_job_end_s": round(job_ended_after, 2)}))


@pytest.mark.processes
def test_r6_a_rank_that_dies_on_every_attempt_gives_up_after_max_restarts_plus_one(tmp_path):
    run = _launch(
        tmp_path, {"mode": "sigkill", "step": 2, "ranks": [1], "every_attempt": True}, max_restarts=2
    )
    assert run.code == 137, run.log[-3000:]
    assert [e["attempt"] for e in run.events("CHAOS")] == [0, 1, 2] and run.attempts() == 3
    assert run.log.count("restarting (attempt") == 2
    assert (
        "gave up after 3 attempts; the last failure: rank 1 exited with code 137 (killed by SIGKILL)"
        in run.log
    )
    print(
        "FIGURES", json.dumps({"attempts": run.attempts(), "exit": run.code, "wall_s": round(run.seconds, 1)})
    )


@pytest.mark.processes
def test_r7_all_ranks_die_at_once_is_one_failure_per_attempt_and_no_orphans(tmp_path):
    run = _launch(
        tmp_path, {"mode": "sigkill", "step": 3, "ranks": [0, 1], "every_attempt": True}, max_restarts=1
    )
    assert run.code == 137, run.log[-3000:]
    assert run.attempts() == 2
    # Both ranks kill themselves at step 3; one may be stopped by the launcher an instant before it does.
    assert {e["attempt"] for e in run.events("CHAOS")} == {0, 1}
    assert run.log.count("restarting (attempt") == 1  # one restart per attempt, not one per dead rank
    assert "gave up after 2 attempts" in run.log
    figures = {"attempts": run.attempts(), "exit": run.code, "self_killed": len(run.events("CHAOS"))}
    print("FIGURES", json.dumps({**figures, "wall_s": round(run.seconds, 1)}))


@pytest.mark.processes
def test_s4_every_listener_during_default_training_is_on_loopback(uninterrupted):
    listeners = {e["rank"]: json.loads(e["addrs"]) for e in uninterrupted.events("LISTEN")}
    assert sorted(listeners) == [0, 1]
    assert all(listeners.values()), "each rank listens for gloo's connections"
    (job,) = [json.loads(e["addrs"]) for e in uninterrupted.events("JOBLISTEN")]
    assert set(job) > {a for addrs in listeners.values() for a in addrs}, "the store process listens too"
    outside = [a for a in job if not a.startswith(("127.", "::1:"))]
    assert outside == []
    print("FIGURES", json.dumps({"listeners": listeners, "job": job, "non_loopback": len(outside)}))


@pytest.mark.processes
def test_s6_the_job_token_is_in_no_log_command_line_or_checkpoint(uninterrupted):
    # _launch already searched this run (and every other run of this module); here: it looked somewhere.
    assert uninterrupted.backup_dir.is_dir() and list(uninterrupted.backup_dir.rglob("state.pt"))
    cmdlines = json.loads(next(uninterrupted.report_dir.glob("cmdlines-0-0.json")).read_text())
    assert any("spread" in c for c in cmdlines) and any("chaos_train.py" in c for c in cmdlines)
    assert uninterrupted.token() not in uninterrupted.log


# -- callbacks' state resumes with the Trainer's ------------------------------------------------------
def _noisy_task() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task with 30% label noise: validation loss improves for 12 epochs, then rises."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3, generator=g)

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = torch.randn(n, 8, generator=g)
        flip = torch.rand(n, generator=g) < 0.3
        return xs, torch.where(flip, torch.randint(0, 3, (n,), generator=g), (xs @ w).argmax(1))

    return make(96), make(64)


class _CrashAfterEpoch(Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"simulated preemption after epoch {epoch}")


def _early_stopped_fit(root: Path, crash_after: int | None = None):
    from spread.callbacks import CSVLogger, EarlyStopping, ModelCheckpoint

    train, validation = _noisy_task()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    stopping = EarlyStopping(patience=3, restore_best_weights=True)
    callbacks = [
        stopping,
        ModelCheckpoint(root / "best.pt", save_best_only=True),
        CSVLogger(root / "log.csv"),
        BackupAndRestore(str(root / "backup")),
        *([_CrashAfterEpoch(crash_after)] if crash_after is not None else []),
    ]
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), callbacks=callbacks)
    history = trainer.fit(train, epochs=40, global_batch_size=16, validation_data=validation, verbose=0)
    return {k: v.clone() for k, v in model.state_dict().items()}, history.history, stopping


def test_a_resumed_run_stops_early_and_keeps_the_best_file_as_the_uninterrupted_one(tmp_path):
    """EarlyStopping's patience and best weights and ModelCheckpoint's best value are in the backup:
    a run preempted while the monitored value is not improving resumes counting, stops at the same
    epoch, restores the same weights and never overwrites best.pt with a worse model; the CSV log
    keeps the epochs before the preemption and ends as the uninterrupted run's."""
    weights, history, stopping = _early_stopped_fit(tmp_path / "ref")
    assert (stopping.stopped_epoch, stopping.best_epoch) == (14, 11)  # the task as designed
    best = torch.load(tmp_path / "ref" / "best.pt", weights_only=True)
    with pytest.raises(KeyboardInterrupt):
        _early_stopped_fit(tmp_path / "run", crash_after=12)  # waiting since epoch 11's best
    resumed_weights, resumed_history, resumed_stopping = _early_stopped_fit(tmp_path / "run")
    assert (resumed_stopping.stopped_epoch, resumed_stopping.best_epoch) == (14, 11)
    assert resumed_history == history
    for key, value in weights.items():
        assert torch.equal(resumed_weights[key], value), key
    resumed_best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    for key, value in best.items():
        assert torch.equal(resumed_best[key], value), key
    assert (tmp_path / "run" / "log.csv").read_text() == (tmp_path / "ref" / "log.csv").read_text()
