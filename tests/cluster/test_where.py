"""Where each rank is, on demand (issue 37 item 1): ``spread run --dump PID`` / SIGUSR1 print every
rank's collective, wait and phase, read from the store; a rank left stopped gets the same report
before the launcher stops the job; ``--dump`` never signals a process that is not a launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from spread.cluster import where
from spread.cluster.launcher import LaunchConfig, launch

# A two-rank MultiWorkerMirrored fit whose rank 1 does not progress in its third forward.
_STUCK_FIT = """
import os, signal, sys, time
import torch
from torch import nn
import spread

strategy = spread.MultiWorkerMirroredStrategy()

class Stuck(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3 and strategy.rank == 1:
            print("stuck", flush=True)
            time.sleep(float(sys.argv[1]))
        return self.linear(x)

with strategy.scope():
    model = Stuck()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((torch.randn(64, 8), torch.randint(0, 2, (64,))), epochs=1, global_batch_size=16, verbose=0)
"""

_WHERE = (sys.executable, "-m", "spread.cli._where")


@pytest.fixture
def private_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / f"spread-{os.getuid()}"


def test_dump_refuses_a_process_that_is_not_a_launcher(private_reports: Path) -> None:
    with pytest.raises(ProcessLookupError, match=r"is not a running `spread run` of this user"):
        where.ask_launcher(os.getpid())  # pytest: no report file, and no SIGUSR1 sent (it would end us)


@pytest.mark.processes
def test_dump_removes_a_report_file_left_by_a_killed_launcher(private_reports: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stale = where.report_path(sleeper.pid)  # the pid now belongs to a process that is no launcher
        stale.write_text("no report yet\n")
        with pytest.raises(ProcessLookupError, match=r"stale report file was removed"):
            where.ask_launcher(sleeper.pid)
        assert not stale.exists()
        assert sleeper.poll() is None  # never signalled
    finally:
        sleeper.kill()
        sleeper.wait()


def test_reports_are_kept_only_in_a_private_directory(private_reports: Path) -> None:
    private_reports.mkdir(mode=0o755)
    os.chmod(private_reports, 0o755)  # readable by others: refused, not used
    with pytest.raises(PermissionError, match=r"is not a private directory of this user"):
        where.report_path(1)


@pytest.mark.processes
def test_a_reader_that_fails_gives_one_line_not_an_exception() -> None:
    lines = where.read_where(
        (sys.executable, "-c", "import sys; sys.exit('boom')"), ("127.0.0.1", 1), 0, 2, "t"
    )
    assert lines == ["no report: the reader failed: boom"]


def _launcher_of(proc: subprocess.Popen, report: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not report.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the launcher did not start"
        time.sleep(0.05)


def _dump_until_a_rank_waits(job: subprocess.Popen, env: dict, seconds: float) -> list[str]:
    """``spread run --dump`` every 2 s until the report names a rank the others wait for; the last
    report when ``seconds`` pass first (the caller's assertion then shows it)."""
    report: list[str] = []
    deadline = time.monotonic() + seconds
    while "never entered" not in "".join(report):
        if time.monotonic() >= deadline:
            return report
        time.sleep(2)
        asked = subprocess.run(
            [sys.executable, "-m", "spread.cli.main", "run", "--dump", str(job.pid)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert asked.returncode == 0, asked.stderr
        report = asked.stdout.splitlines()
    return report


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_spread_run_dump_names_the_rank_the_job_waits_for(tmp_path: Path, private_reports: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(_STUCK_FIT))
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), SPREAD_HANG_REPORT_AFTER="300")
    command = [sys.executable, "-m", "spread.cli.main", "run", "-n", "2", str(script), "40"]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _launcher_of(job, private_reports / f"where-{job.pid}.txt")
        report = _dump_until_a_rank_waits(job, env, seconds=60)
        assert "never entered" in "".join(report), report
        assert report[0].startswith("where each rank is at ") and report[0].endswith("(asked by SIGUSR1):")
        assert report[1].startswith("rank 0 (pid ") and "waiting in gradient_exchange #" in report[1]
        assert "in backward of step 3" in report[1]
        assert report[2].startswith("rank 1 (pid ") and "not in a collective" in report[2]
        assert "in forward of step 3" in report[2]
        assert "rank 1 never entered gradient_exchange #" in report[3]
    finally:
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=30)
    assert "spread run:   rank 1 (pid " in err  # the job's own output has the report too
    assert not (private_reports / f"where-{job.pid}.txt").exists()  # removed when the launcher ends


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_rank_left_stopped_is_reported_with_where_every_rank_was(
    tmp_path: Path, private_reports: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "fit.py"
    script.write_text(
        textwrap.dedent(_STUCK_FIT).replace(
            'print("stuck", flush=True)',
            'print("stuck", flush=True); time.sleep(5); os.kill(os.getpid(), signal.SIGSTOP)',
        )
    )
    config = LaunchConfig(entrypoint=str(script), args=("60",), nproc=2, kill_grace=2, where_command=_WHERE)
    assert launch(config) == 128 + signal.SIGSTOP
    err = capfd.readouterr().err
    assert "where each rank is at " in err and "(rank 1 stayed stopped (SIGSTOP) for 3." in err
    assert "rank 1 never entered gradient_exchange #" in err, err
    assert err.index("rank 1 never entered") < err.index("stopped the other 1 process(es)")


_LOSE_ONE_THEN_HANG = """
import os, sys, time
import torch
from torch import nn
import spread

strategy = spread.MultiWorkerMirroredStrategy(communication="native")

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3 and os.environ["RANK"] == "2":
            os._exit(1)  # lost: the others regroup without it
        if self.calls == 6 and os.environ["RANK"] == "1":
            time.sleep(300)  # until the test ends the job: on a loaded machine 60 s ran out before a dump
        return self.linear(x)

with strategy.scope():
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((torch.randn(120, 8), torch.randint(0, 2, (120,))), epochs=1, global_batch_size=12, verbose=0)
"""


@pytest.mark.processes
@pytest.mark.timeout(150)
def test_dump_after_a_recovery_reports_the_regrouped_ranks(tmp_path: Path, private_reports: Path) -> None:
    script = tmp_path / "fit.py"
    script.write_text(textwrap.dedent(_LOSE_ONE_THEN_HANG))
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path), SPREAD_HANG_REPORT_AFTER="300")
    command = [sys.executable, "-m", "spread.cli.main", "run", "--recover", "-n", "3", str(script)]
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report: list[str] = []
    try:
        _launcher_of(job, private_reports / f"where-{job.pid}.txt")
        report = _dump_until_a_rank_waits(job, env, seconds=90)
    finally:  # a failure below shows the job's own output: which rank left when, and why
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=30)
    said = f"{report}\njob stdout:\n{out}\njob stderr:\n{err}"
    assert "never entered" in "".join(report), said
    assert report[1] == "(the job regrouped after losing ranks: 2 of 3 go on, numbered anew)", said
    assert len([line for line in report if line.startswith("rank ")]) == 2, said
    assert "rank 1 never entered gradient_exchange #" in report[-1], said
