"""``benchmarks/goodput.py``: its settings, its table, that a node dies whole, and a CI-sized run of the
spread mode with one kill (it completes, has its row, and its final weights are compared; no timing
threshold)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from spread.testing.processes import reap_survivors

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import goodput  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "spread-restart,nope"], "unknown mode"),
        (["--modes", ","], "unknown mode"),
        (["--steps", "50", "--batches", "16"], "positive multiple of --batches"),
        (["--steps", "0"], "positive multiple of --batches"),
        (["--save-every", "0"], "--save-every must be >= 1"),
        (["--kill-every", "10", "--back-after", "10"], "--kill-every > --back-after > 0"),
        (["--back-after", "0"], "--kill-every > --back-after > 0"),
        (["--kills", "-1"], "--kills must be >= 0"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--exit-grace", "-1"], "--exit-grace >= 0"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        goodput.parse_args(argv)
    assert message in capsys.readouterr().err


def test_defaults_are_the_issue_s_schedule():
    args = goodput.parse_args([])
    assert (args.kill_every, args.back_after, args.kills) == (60.0, 20.0, 0)
    assert args.modes == ["spread-restart", "spread-recover", "torchrun-dcp", "torchft-ddp"]


def test_each_node_gets_its_own_cpus_or_none():
    assert goodput.node_cpus(2, 0) == [set(), set()]
    available = sorted(os.sched_getaffinity(0))
    if len(available) >= 2:
        first, second = goodput.node_cpus(2, 1)
        assert first == {available[0]} and second == {available[1]}
    with pytest.raises(SystemExit, match="needs"):
        goodput.node_cpus(2, len(available))


def test_every_mode_runs_the_same_workload_and_the_node_0_hosts():
    job = goodput.Job(sys.executable, Path("/tmp/x"), 1234, 32, 16, 8, 2, 2, 2.0, True)
    for mode in goodput.MODES.values():
        host, other = mode.node_commands(job, 0), mode.node_commands(job, 1)
        for command in host + other:
            assert "--quick" in command and "--steps" in command and str(job.started) in command
        assert len(host) == len(other) >= 1
    spread_host = " ".join(goodput.MODES["spread-restart"].node_commands(job, 0)[0])
    assert "is_host=1" in spread_host and "--nnodes 1:2" in spread_host and "--max-restarts" in spread_host
    assert "is_host=0" in " ".join(goodput.MODES["torchrun-dcp"].node_commands(job, 1)[0])
    groups = [c[c.index("--group") + 1] for c in goodput.MODES["torchft-ddp"].node_commands(job, 1)]
    assert groups == ["2", "3"]  # node 1 holds replica groups 2 and 3 of 4


def _run(mode: str, failures: bool, ok: bool = True, **more) -> goodput.RunResult:
    fields = dict(wall_s=10.0, steps_per_s=3.2 if ok else None, kills=2 if failures else 0, restarts=4)
    fields.update(more)
    return goodput.RunResult(mode, failures, ok, exit_codes=[0], log_dir="/tmp/logs", **fields)


def test_the_table_has_a_row_per_mode_skipped_and_failed_ones_say_why():
    settings = dict(nodes=2, nproc=2, steps=32, kill_every=60.0, back_after=20.0, cores_per_node=1)
    settings["load_at_start"] = 0.4
    done = goodput.Row("spread-restart", "spread", _run("a", False), _run("a", True), goodput=0.85)
    done.weights_vs_uninterrupted = 2.5e-7
    failed = goodput.Row(
        "torchrun-dcp", "torchrun", _run("b", False), _run("b", True, ok=False, error="boom")
    )
    skipped = goodput.Row("torchft-ddp", "torchft", skipped="torchft does not import")
    table = goodput.markdown([done, failed, skipped], settings)
    assert "| spread | 3.20 | 3.20 | 0.850 | 2 | 4 | 2.50e-07 | - |" in table
    assert "| torchrun | 3.20 | - (failed) | - |" in table
    assert "| torchft | skipped: torchft does not import |" in table
    assert "torchrun, with failures: boom (logs: /tmp/logs)" in table


@pytest.mark.processes
def test_a_mode_whose_library_is_missing_is_skipped_with_the_reason():
    args = goodput.parse_args(["--modes", "torchft-ddp", "--torchft-python", sys.executable])
    mode = goodput.MODES["torchft-ddp"]
    mode_without = goodput.Mode(mode.name, mode.title, mode.node_commands, needs="a_module_that_is_not_there")
    python, reason = goodput._interpreter_for(mode_without, args)
    assert python == sys.executable
    assert "a_module_that_is_not_there does not import" in reason and "ModuleNotFoundError" in reason


@pytest.mark.processes
def test_a_killed_node_leaves_nothing_behind(tmp_path: Path):
    """A launcher whose worker runs in a session of its own (as torchrun's do) and has a child:
    killing the node ends all three, although a process-group kill would miss the worker."""
    pids = tmp_path / "pids"
    worker = f"import os, subprocess, time; c = subprocess.Popen(['sleep', '600']); open({str(pids)!r}, 'a')"
    worker += ".write(f'{os.getpid()} {c.pid}\\n'); time.sleep(600)"
    launcher = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True); time.sleep(600)"
    )
    node = goodput.Node(
        "node1", [[sys.executable, "-c", launcher]], dict(os.environ), tmp_path / "log", set()
    )
    node.start()
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text().count(" ") == 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2 and os.getsid(started[0]) != node.procs[0].pid
    node.kill()
    assert not node.running()
    assert reap_survivors(started, timeout=5) == []  # those left are killed, and fail the test
    assert "=== node1: killed" in (tmp_path / "log").read_text()


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_spread_mode_survives_a_killed_node_and_its_weights_are_compared(tmp_path: Path):
    out = goodput.main(
        [
            "--modes", "spread-restart", "--steps", "64", "--batches", "16", "--save-every", "8",
            "--kill-every", "5", "--back-after", "3", "--kills", "1", "--kill-clock", "first-step",
            "--timeout", "400",
            "--exit-grace", "30", "--workdir", str(tmp_path), "--json", str(tmp_path / "goodput.json"),
        ]
    )  # fmt: skip
    (row,) = out["rows"]
    assert row["mode"] == "spread-restart" and not row["skipped"]
    assert row["clean"]["ok"], row["clean"]
    assert row["faulty"]["ok"], row["faulty"]
    assert row["faulty"]["kills"] == 1 and row["faulty"]["restarts"] >= 1  # the kill was felt
    assert row["goodput"] is not None and row["goodput"] > 0
    # Compared, and equal as spread claims: a resume at another world size regroups the sums only.
    assert row["weights_vs_uninterrupted"] is not None and row["weights_vs_uninterrupted"] < 1e-4
    assert "| spread run --max-restarts + BackupAndRestore |" in out["markdown"]
    assert (tmp_path / "goodput.json").exists()
    assert not [p for p in psutil.Process().children(recursive=True) if p.status() != "zombie"]
