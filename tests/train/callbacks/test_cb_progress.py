"""ProgressBar: one live bar per epoch on a terminal (own, or relayed by ``spread run``), one plain
line per epoch otherwise, Keras's ``verbose`` levels, and silence on every rank but the chief.

The bar tests run a real ``Trainer.fit`` in a subprocess whose stdout is a pseudo-terminal (or the
pipe ``spread run`` relays), and read what a terminal would show.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
import tty
from pathlib import Path

import pytest

from spread.train.callbacks import CallbackList, ProgressBar
from spread.train.callbacks import progress as progress_module

# "0.3s 41ms/step": the epoch's time (validation included) and the time per training step.
TIMING = r"\d+\.\ds [\d.]+(us|ms|s)/step"


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_one_line_per_epoch_when_not_a_terminal(fake_trainer, capsys, monkeypatch):
    monkeypatch.delenv(progress_module.RELAYED_TERMINAL_ENV, raising=False)
    trainer = fake_trainer(epochs=2, steps=20, global_batch_size=16)
    trainer.fit([ProgressBar()])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 2 and "\r" not in out
    assert re.fullmatch(
        rf"epoch 1/2  20/20  {TIMING}  loss 1\.0000  accuracy 0\.5000  val_loss 2\.0000  \d+ samples/s",
        lines[0],
    ), lines[0]
    assert lines[1].startswith("epoch 2/2  20/20  ") and "val_loss 1.0000" in lines[1]


def test_relayed_terminal_flag_applies_to_fd_1_only(fake_trainer, capsys, monkeypatch):
    # The launcher's flag describes this process's fd 1; captured or redirected stdout gets lines.
    monkeypatch.setenv(progress_module.RELAYED_TERMINAL_ENV, "1")
    fake_trainer(epochs=2, steps=5).fit([ProgressBar()])
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 2 and "\r" not in out


def test_log_every_adds_step_lines(fake_trainer, capsys):
    trainer = fake_trainer(epochs=1, steps=None)
    trainer.fit([ProgressBar(log_every=3)], steps=7)
    lines = _lines(capsys)
    # Unknown epoch length: steps 3 and 6, then the epoch's line at step 7.
    assert [line.split("  ")[1] for line in lines] == ["3", "6", "7"]
    assert lines[0].startswith("epoch 1/1  3  loss 0.3333  accuracy 0.5000  ")
    assert "val_loss" in lines[2]

    fake_trainer(epochs=1, steps=10).fit([ProgressBar(log_every=4)])
    lines = _lines(capsys)
    assert [line.split("  ")[1] for line in lines] == ["4/10", "8/10", "10/10"]
    assert re.match(r"epoch 1/1  4/10  ETA \d+\.\ds  loss 0\.2500  ", lines[0]), lines[0]


def test_verbose_2_prints_one_line_per_epoch_even_on_a_terminal(fake_trainer, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_is_tty", lambda stream: True)
    fake_trainer(epochs=3, steps=20).fit([ProgressBar(verbose=2)])
    out = capsys.readouterr().out
    assert "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 3
    assert all(re.search(rf"  20/20  {TIMING}  .*val_loss .* samples/s$", line) for line in lines)


def test_verbose_0_is_silent(fake_trainer, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_is_tty", lambda stream: True)
    fake_trainer(epochs=2).fit([ProgressBar(verbose=0)])
    assert capsys.readouterr().out == ""


def test_bar_ends_as_the_epoch_line(fake_trainer, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_is_tty", lambda stream: True)
    fake_trainer(epochs=2, steps=5).fit([ProgressBar()])
    screen = _screen(capsys.readouterr().out)
    assert len(screen) == 2
    assert re.fullmatch(
        rf"epoch 1/2  5/5 \|█{{20}}\| {TIMING}  loss 1\.0000  accuracy 0\.5000  val_loss 2\.0000  "
        r"\d+ samples/s",
        screen[0],
    ), screen[0]


def test_the_epoch_line_is_one_write_with_its_newline(fake_trainer, monkeypatch):
    """``print`` wrote the epoch's line and its newline apart; a relay that read between the two took
    the line for one more frame of the bar and drew it twice (see the 80-column test below)."""
    writes: list[str] = []

    class Recorded(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(progress_module, "_is_tty", lambda stream: True)
    monkeypatch.setattr(sys, "stdout", Recorded())
    fake_trainer(epochs=2, steps=5).fit([ProgressBar()])
    lines = [text for text in writes if "val_loss" in text]
    assert len(lines) == 2 and all(text.endswith("\n") for text in lines), writes


def test_bar_of_an_epoch_of_unknown_length_ends_full(fake_trainer, capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "_is_tty", lambda stream: True)
    fake_trainer(epochs=1, steps=None).fit([ProgressBar()], steps=3)
    raw = capsys.readouterr().out
    assert "epoch 1/1  0  00:00" in raw  # while running: steps so far and time, no total, no ETA
    assert re.match(r"epoch 1/1  3/3 \|█{20}\| ", _screen(raw)[0]), raw


def test_chief_only(fake_trainer):
    assert list(CallbackList([ProgressBar()], fake_trainer(is_chief=False))) == []


def test_small_values_keep_their_digits():
    assert (
        progress_module.format_logs({"loss": 1.5e-5, "acc": 0.25, "size": 8}) == "loss 1.5000e-05  acc 0.2500"
    )


@pytest.mark.parametrize(
    ("seconds", "text"), [(2.25, "2.2s/step"), (0.0412, "41ms/step"), (8.5e-5, "85us/step")]
)
def test_time_per_step(seconds, text):
    assert progress_module._per_step(seconds) == text


@pytest.mark.parametrize(("kwargs", "name"), [({"verbose": 3}, "verbose"), ({"log_every": 0}, "log_every")])
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid value for argument `{name}`"):
        ProgressBar(**kwargs)


# -- a real fit, on a (pseudo-)terminal -------------------------------------------------------------

FIT_SCRIPT = """
import os, sys, time
import torch
from torch import nn
import spread

class SlowSteps(spread.callbacks.Callback):
    # Steps longer than tqdm's 0.1 s redraw interval, so that the bar is redrawn within an epoch.
    def on_train_batch_end(self, step, logs=None):
        time.sleep(0.12)

torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x.sum(1) > 0).long()
distributed = "WORLD_SIZE" in os.environ
strategy = spread.MultiWorkerMirroredStrategy() if distributed else spread.OneDeviceStrategy()
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
trainer.fit((x, y), epochs=2, global_batch_size=64, validation_data=(x[:64], y[:64]),
            callbacks=[SlowSteps()], verbose=int(sys.argv[1]))
print("done", flush=True)
"""


def _screen(raw: str) -> list[str]:
    """What a terminal shows of ``raw``: per line, the last frame drawn over it with carriage returns."""
    screen = []
    for line in raw.split("\n"):
        frames = [frame for frame in line.split("\r") if frame.strip()]
        if frames:
            screen.append(frames[-1].rstrip())
    return screen


def _frames(raw: str) -> list[str]:
    return [frame for frame in re.split(r"[\r\n]", raw) if frame.strip()]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (progress_module.RELAYED_TERMINAL_ENV, "COLUMNS")}
    path = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", **extra}


def _run_on_pty(args: list[str], env: dict[str, str], columns: int, cwd: Path, timeout: float = 90) -> str:
    """Run ``args`` with stdout on a pseudo-terminal ``columns`` wide; everything it showed there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    tty.setraw(slave)  # no "\n" -> "\r\n" translation: the bytes as the program wrote them
    with open(cwd / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(args, stdout=slave, stderr=stderr, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(f"{args[:4]} still running after {timeout}s")
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=30) == 0, (cwd / "stderr.txt").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(master)
    return b"".join(chunks).decode()


def _check_bar_run(raw: str, prefix: str, width: int) -> None:
    """Both epochs drawn as live bars no wider than ``width``, each ending as its epoch line."""
    assert "\r" in raw
    # (a frozen frame may stay on screen where another rank's line interrupted the bar)
    screen = [line for line in _screen(raw) if line.startswith(prefix) and " ETA " not in line]
    assert len(screen) == 3 and screen[2] == f"{prefix}done", screen
    for epoch, line in enumerate(screen[:2], start=1):
        assert re.fullmatch(
            rf"{re.escape(prefix)}epoch {epoch}/2  4/4 \|█{{20}}\| {TIMING}  loss [\d.]+  accuracy [\d.]+  "
            r"val_loss [\d.]+  val_accuracy [\d.]+  \d+ samples/s",
            line,
        ), line
    running = [frame for frame in _frames(raw) if " ETA " in frame]
    assert any(re.search(rf"^{re.escape(prefix)}epoch 1/2  [123]/4 \|", frame) for frame in running), running
    assert all(len(frame) <= width for frame in running), max(running, key=len)


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_live_bar_on_a_terminal(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    raw = _run_on_pty([sys.executable, str(script), "1"], _env(), columns=100, cwd=tmp_path)
    _check_bar_run(raw, prefix="", width=100)

    # A terminal that reports no size (0 columns) still gets a visible bar, 80 columns wide.
    raw = _run_on_pty([sys.executable, str(script), "1"], _env(), columns=0, cwd=tmp_path)
    _check_bar_run(raw, prefix="", width=80)

    lines = _run_on_pty([sys.executable, str(script), "2"], _env(), columns=100, cwd=tmp_path)
    assert "\r" not in lines and len(_screen(lines)) == 3


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_live_bar_through_a_relaying_launcher(tmp_path):
    # What `spread run` does when its own stdout is a terminal: the rank's stdout is a pipe, and the
    # environment says that the pipe ends on a terminal COLUMNS wide.
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    env = _env(**{progress_module.RELAYED_TERMINAL_ENV: "1", "COLUMNS": "90"})
    _check_bar_run(
        _run_on_pipe(script, env, tmp_path), prefix="", width=90 - progress_module._RELAY_TAG_COLUMNS
    )

    plain = _run_on_pipe(script, _env(), tmp_path)  # not relayed to a terminal: lines
    assert "\r" not in plain and len(plain.splitlines()) == 3


def _run_on_pipe(script: Path, env: dict[str, str], cwd: Path) -> str:
    # bytes, not text: text mode would turn the bar's carriage returns into newlines
    result = subprocess.run(
        [sys.executable, str(script), "1"], capture_output=True, env=env, cwd=cwd, timeout=90
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode()


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_spread_run_on_a_terminal_shows_rank_0s_bar_only(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    raw = _run_on_pty(
        [sys.executable, "-m", "spread.cli.main", "run", "-n", "2", str(script), "1"],
        _env(),
        columns=120,
        cwd=tmp_path,
        timeout=150,
    )
    _check_bar_run(raw, prefix="[rank 0] ", width=120)
    assert "[rank 1] done" in raw
    assert not [frame for frame in _frames(raw) if frame.startswith("[rank 1] epoch")]


def _terminal(raw: str, columns: int) -> list[str]:
    """The rows an automatic-margin terminal ``columns`` wide shows after ``raw``: a character past
    the last column wraps to the next row, and a carriage return goes back only to its row's start."""
    rows: list[list[str]] = [[]]
    row = col = 0
    for char in raw:
        if char == "\r":
            col = 0
        elif char == "\n":
            row, col = row + 1, 0
        else:
            if col == columns:
                row, col = row + 1, 0
            while len(rows) <= row:
                rows.append([])
            line = rows[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = char
            col += 1
        while len(rows) <= row:
            rows.append([])
    return ["".join(line).rstrip() for line in rows]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_spread_run_on_an_80_column_terminal_shows_each_epoch_line_once(tmp_path):
    """The epoch's line (~150 characters with validation metrics) reached the relay without its
    newline (``print`` writes the two apart) and was drawn as a bar frame first: that copy wrapped,
    and the carriage return before the real line went back only to its last row, so its first row
    stayed on screen. No frame drawn in place may be wider than the terminal."""
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    columns = 80
    raw = _run_on_pty(
        [sys.executable, "-m", "spread.cli.main", "run", "-n", "1", str(script), "1"],
        _env(),
        columns=columns,
        cwd=tmp_path,
        timeout=150,
    )
    overwritten = [frame for line in raw.split("\n") for frame in line.split("\r")[:-1]]
    assert all(len(frame) < columns for frame in overwritten), max(overwritten, key=len)
    screen = _terminal(raw, columns)
    for epoch in (1, 2):
        shown = [row for row in screen if row.startswith(f"[rank 0] epoch {epoch}/2  4/4 |")]
        assert len(shown) == 1, "\n".join(screen)
        assert len(shown[0]) == columns and "val_accuracy" not in shown[0]  # the line wraps, once
    assert [row for row in screen if row][-1] == "[rank 0] done"
