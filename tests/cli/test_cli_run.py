"""``spread run`` from the command line: help that teaches, usage errors, signals, no survivors (H5).

Signal tests start the real command in a subprocess (as a user would), wait until every rank has
written its pid, signal the launcher, and then check that nothing it started is alive.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from spread.cli.main import main
from spread.testing import process_alive, reap_survivors

pytestmark = pytest.mark.timeout(60)

SPREAD = [sys.executable, "-m", "spread.cli.main"]

SLEEPER = """
import os, subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(os.path.join(sys.argv[1], "pids" + os.environ["RANK"]), "w") as f:
    f.write(f"{os.getpid()} {helper.pid}")
time.sleep(60)
"""


def _spread(args: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SPREAD, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs
    )


def _wait_for_pids(directory: Path, count: int, proc: subprocess.Popen, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(directory.glob("pids*"))
        texts = [f.read_text() for f in files]
        if len(files) == count and all(len(t.split()) == 2 for t in texts):
            return [int(pid) for t in texts for pid in t.split()]
        assert proc.poll() is None, proc.communicate(timeout=15)
        time.sleep(0.05)
    raise AssertionError("the ranks did not start in time")


def _assert_gone(pids: list[int], launcher_pid: int, timeout: float = 5.0) -> None:
    survivors = reap_survivors(pids, timeout)
    assert not survivors, f"still alive: {survivors}"
    orphans = [p for p in psutil.process_iter(["ppid", "status"]) if p.info["ppid"] == launcher_pid]
    assert not [p for p in orphans if p.info["status"] != psutil.STATUS_ZOMBIE]


def test_top_level_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "examples:" in out and "spread run -n 4 train.py" in out


def test_run_help_lists_flags_environment_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for text in (
        "--max-restarts",
        "--kill-grace",
        "--no-prefix",
        "SPREAD_JOB_TOKEN",
        "LOCAL_RANK",
        "examples:",
        "--nnodes 2 --node-rank 1",
        "exit status",
    ):
        assert text in out


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: spread" in capsys.readouterr().err


def test_kubeflow_elastic_variables_alone_configure_an_elastic_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """PET_* as Kubeflow's training operator sets them for an elastic PyTorchJob, no flags: the
    endpoint is the rendezvous (PET_MASTER_ADDR/PORT, another name and port for the master, do not
    conflict with it, as under torchrun) and the machines are numbered by it (PET_NODE_RANK unused)."""
    import spread.cluster.launcher as launcher

    kubeflow = {
        "PET_NNODES": "1:2",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "2",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "job-worker-0:23456",
        "PET_RDZV_ID": "job-17",
        "PET_MAX_RESTARTS": "3",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "29500",
    }
    for name, value in kubeflow.items():
        monkeypatch.setenv(name, value)
    seen = []
    monkeypatch.setattr(launcher, "launch", lambda config: seen.append(config) or 0)
    assert main(["run", "t.py"]) == 0
    config = seen[0]
    assert (config.rdzv_backend, config.min_nodes, config.nnodes, config.nproc) == ("c10d", 1, 2, 2)
    assert (config.master_addr, config.master_port) == ("job-worker-0", 23456)
    assert (config.run_id, config.max_restarts, config.node_rank) == ("job-17", 3, 0)
    # Typed on the command line, a master address other than the endpoint is still refused.
    assert main(["run", "--master-addr", "elsewhere", "t.py"]) == 2


def test_a_rendezvous_backend_spread_does_not_have_from_the_environment_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse checks --rdzv-backend's choices on the command line only, not in its default (taken
    from PET_RDZV_BACKEND): an etcd rendezvous must not silently become a c10d one at an etcd address."""
    import spread.cluster.launcher as launcher

    for name, value in {
        "PET_NNODES": "1:2",
        "PET_RDZV_BACKEND": "etcd-v2",
        "PET_RDZV_ENDPOINT": "etcd:2379",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launcher, "launch", lambda config: pytest.fail("launched"))
    assert main(["run", "t.py"]) == 2
    assert "PET_RDZV_BACKEND=etcd-v2 (from the environment)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "x.py"], "must be >= 1, got 0"),
        (["-n", "two", "x.py"], "expected an integer"),
        (["--kill-grace", "-1", "x.py"], "--kill-grace"),
        (["--master-port", "70000", "x.py"], "port in [0, 65535]"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1", "x.py"],
            "--node-rank",
        ),
        (["--nnodes", "2", "--master-port", "29500", "x.py"], "--master-addr"),
        ([], "SCRIPT"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "meant"),
    [
        (["--nprocs", "2", "t.py"], "-n/--nproc-per-node"),
        (["--nproc", "2", "t.py"], "-n/--nproc-per-node"),  # was "ambiguous" between -n's spellings
        (["--num_processes=2", "t.py"], "-n/--nproc-per-node"),  # accelerate launch's
        (["--kill-grase", "3", "t.py"], "--kill-grace"),
    ],
)
def test_another_launchers_spelling_is_answered_with_the_option_meant(
    args: list[str], meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``spread run --nprocs 2 t.py`` printed the top-level usage ("usage: spread [-h] [--version]
    COMMAND") and no hint: the unknown option now gets spread run's usage and the option meant."""
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err
    assert "usage: spread run" in err
    assert f"(did you mean {meant}?)" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--standalone", "--nproc_per_node=2", "t.py"], {"nproc": 2, "nnodes": 1, "master_addr": None}),
        (["--nproc-per-node", "cpu", "t.py"], {"nproc": os.cpu_count()}),
        (
            [
                "--nnodes=1",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                "--rdzv_endpoint=localhost:29400",
                "t.py",
            ],
            {"nproc": 2, "master_addr": "localhost", "master_port": 29400},
        ),
        (["--rdzv-endpoint", "10.0.0.1", "--nnodes", "2:2", "--node_rank=1", "t.py"], {"master_port": 29400}),
        (
            ["--rdzv_id=job7", "--max_restarts=3", "--role", "trainer", "t.py"],
            {"run_id": "job7", "max_restarts": 3},
        ),
        (
            ["--master_addr=127.0.0.1", "--master_port=29511", "t.py", "--lr=1"],
            {"master_port": 29511, "args": ("--lr=1",)},
        ),
        (["--no_python", "t.py"], {"no_python": True}),
    ],
)
def test_torchrun_spellings_are_accepted(
    args: list[str], expected: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import spread.cluster.launcher as launcher

    seen = []
    monkeypatch.setattr(launcher, "launch", lambda config: seen.append(config) or 0)
    assert main(["run", *args]) == 0
    assert {name: getattr(seen[0], name) for name in expected} == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "4:1", "t.py"], "the range 4:1 is empty: MIN must be <= MAX"),
        (["--nnodes", "1:4", "t.py"], "needs --rdzv-endpoint HOST[:PORT], the same on every machine"),
        (["--standalone", "--nnodes", "2", "t.py"], "--standalone is a single-machine job"),
        (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h", "t.py"], "needs --node-rank"),
        (["--rdzv-backend", "static", "--nnodes", "1:2", "t.py"], "needs --rdzv-backend c10d"),
        (["--rdzv-conf", "join_timeout", "t.py"], "expected key=value pairs"),
        (["--rdzv-endpoint", "h:1", "--master-port", "2", "t.py"], "either --rdzv-endpoint or --master-addr"),
        (["--rdzv-backend", "etcd", "t.py"], "invalid choice: 'etcd'"),
    ],
)
def test_torchrun_options_spread_cannot_honour_are_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *args]) == 2
    assert message in capsys.readouterr().err


def test_missing_script_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "script not found" in capsys.readouterr().err


@pytest.mark.processes
def test_a_job_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    """Without SPREAD_JOB_TOKEN a job on several machines derives its token from the user's secret
    file: one that other users can read would let them join, so it is refused before anything starts."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    secret.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if k != "SPREAD_JOB_TOKEN"}
    env["SPREAD_SECRET_FILE"] = str(secret)
    node = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", "29500"]
    result = _spread(["run", "-n", "1", *node, str(script)], env=env)
    assert result.returncode == 2
    assert (
        f"the job secret {secret} must be a regular file of this user readable by nobody else"
        in result.stderr
    )
    assert "chmod 600" in result.stderr


@pytest.mark.processes
def test_end_to_end_exit_code_arguments_and_secret_token(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        print("args", sys.argv[1:], "token", len(os.environ["SPREAD_JOB_TOKEN"]), flush=True)
        printed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank-0-printed")
        if os.environ["RANK"] == "0":
            open(printed, "w").close()
            sys.exit(0)
        deadline = time.monotonic() + 60  # rank 1 fails after rank 0 printed: its failure stops rank 0
        while not os.path.exists(printed) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3)
    """)
    )
    result = _spread(["run", "-n", "2", str(script), "--lr", "0.1", "-n", "5"])
    assert result.returncode == 3
    assert result.stdout.count("args ['--lr', '0.1', '-n', '5'] token 32") == 2
    assert "spread run: rank 1 exited with code 3" in result.stderr


@pytest.mark.processes
def test_no_prefix_passes_output_through(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('plain')\n")
    result = _spread(["run", "--no-prefix", str(script)])
    assert (result.returncode, result.stdout) == (0, "plain\n")


@pytest.mark.parametrize(("signum", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.processes
def test_sigint_and_sigterm_stop_every_rank_and_helper(tmp_path: Path, signum: int, expected: int) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        [*SPREAD, "run", "-n", "2", "--kill-grace", "2", str(script), str(tmp_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        start = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=15)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=15)
    assert proc.returncode == expected, err
    assert elapsed < 10
    assert f"received {signal.Signals(signum).name}; forwarded it to 2 process(es)" in err
    _assert_gone(pids, proc.pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.processes
def test_sigkilled_launcher_takes_its_ranks_along(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen(
        [*SPREAD, "run", "-n", "2", str(script), str(tmp_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    ranks, helpers = pids[0::2], pids[1::2]
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in helpers:  # PDEATHSIG covers the ranks only; their helpers are not the launcher's to reach
        if process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert not [p for p in ranks if process_alive(p)]


@pytest.mark.processes
def test_launcher_imports_without_torch() -> None:
    code = (
        "import sys, spread.cli.main, spread.cli.run, spread.cluster.launcher; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, "spread run would import torch at start-up: " + result.stderr


FITTING = """
import os, sys, time
import torch
from torch import nn
import spread

class Slow(spread.callbacks.Callback):
    def on_train_batch_end(self, step, logs=None):
        if step == 1:
            with open(os.path.join(sys.argv[1], "pids" + os.environ["RANK"]), "w") as f:
                f.write(f"{os.getpid()} {os.getpid()}")
        time.sleep(0.05)

x = torch.randn(4096, 8)
y = (x.sum(1) > 0).long()
strategy = spread.MultiWorkerMirroredStrategy()
with strategy.scope():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
try:
    trainer.fit((x, y), epochs=100, global_batch_size=16, verbose=0, callbacks=[Slow()])
finally:
    print("finally ran", flush=True)
"""


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_ctrl_c_during_fit_ends_each_rank_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C during ``Trainer.fit`` under ``spread run`` printed every rank's traceback of the step
    it was in (~110 lines a rank); now one line a rank, saying where in the script it was. The
    KeyboardInterrupt still propagates through the script (its ``finally`` runs) and the job ends 130."""
    script = tmp_path / "fit.py"
    script.write_text(FITTING)
    proc = subprocess.Popen(
        [*SPREAD, "run", "-n", "2", str(script), str(tmp_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2, proc, timeout=60)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=15)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    for rank in (0, 1):
        assert f"[rank {rank}] finally ran" in out
        lines = [line for line in err.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert len(lines) == 1, err
        assert re.fullmatch(
            rf"\[rank {rank}\] KeyboardInterrupt"
            rf"(: fit interrupted in epoch \d+, after \d+ optimizer step\(s\))?"
            rf" \(at {re.escape(str(script))}:\d+, in \S+\)",
            lines[0],
        )
    _assert_gone(pids, proc.pid)


@pytest.mark.processes
def test_ctrl_c_reaches_the_ranks_keyboard_interrupt_handlers(tmp_path: Path) -> None:
    """As a terminal delivers Ctrl-C to torchrun's ranks: each rank gets SIGINT, so a script's
    ``except KeyboardInterrupt:`` save runs before the job ends with 130."""
    script = tmp_path / "saver.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        folder = sys.argv[1]
        try:
            with open(os.path.join(folder, "pids" + os.environ["RANK"]), "w") as f:
                f.write(f"{os.getpid()} {os.getpid()}")
            time.sleep(60)
        except KeyboardInterrupt:
            with open(os.path.join(folder, "saved" + os.environ["RANK"]), "w") as f:
                f.write("saved")
            sys.exit(130)
    """)
    )
    proc = subprocess.Popen(
        [*SPREAD, "run", "-n", "2", str(script), str(tmp_path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=15)
    assert proc.returncode == 130, err
    assert sorted(p.name for p in tmp_path.glob("saved*")) == ["saved0", "saved1"]
    _assert_gone(pids, proc.pid)
