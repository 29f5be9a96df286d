"""The local launcher (``spread.cluster.launcher.launch``): environment, output, failure, restarts, cleanup.

Children are tiny Python scripts written to ``tmp_path`` that never import torch, so each launch costs
tens of milliseconds. Every test ends by checking that no process it started is still alive (zombies
count as dead: PID 1 in some containers never reaps orphans, which no launcher can fix).
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from spread.cluster import launcher
from spread.cluster.launcher import LaunchConfig, launch
from spread.testing import reap_survivors

pytestmark = pytest.mark.timeout(60)

# Every variable torchrun 2.13 gives its workers (read from a torchrun --standalone run).
TORCHRUN_ENV = frozenset(
    [
        "LOCAL_RANK",
        "RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
        "OMP_NUM_THREADS",
    ]
)
# What an outer launcher (or a shell) may have exported; none of it may reach our ranks as it was.
OUTER_LAUNCHER_ENV = {
    "TORCHELASTIC_ERROR_FILE": "/elsewhere/error.json",
    "TF_CONFIG": '{"cluster": {"worker": ["h:1"]}}',
}


def _script(tmp_path: Path, body: str, name: str = "child.py") -> Path:
    path = tmp_path / name
    path.write_text("import json, os, signal, socket, subprocess, sys, time\n" + textwrap.dedent(body))
    return path


def _assert_all_gone(pids: list[int], timeout: float = 5.0) -> None:
    """Every pid is dead (or a zombie), and this test process has no child left."""
    survivors = reap_survivors(pids, timeout)  # killed so they do not leak; this test still fails
    assert not survivors, f"processes still alive after launch returned: {survivors}"
    children = [
        c
        for c in psutil.Process().children(recursive=True)
        if c.status() != psutil.STATUS_ZOMBIE
        and "resource_tracker" not in " ".join(c.cmdline())  # multiprocessing's, lives for the session
    ]
    assert not children, f"the launcher left children behind: {children}"


def _pids(text: str) -> list[int]:
    return [int(line.split("pid=")[1].split()[0]) for line in text.splitlines() if "pid=" in line]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"nproc": 0}, "nproc"),
        ({"nproc": True}, "nproc"),
        ({"nnodes": 0}, "nnodes"),
        ({"nnodes": 2, "node_rank": 2, "master_addr": "h", "master_port": 1}, "node_rank"),
        ({"node_rank": -1}, "node_rank"),
        ({"master_port": 70000}, "master_port"),
        ({"master_addr": ""}, "master_addr"),
        ({"nnodes": 2, "master_port": 29500}, "master_addr"),
        ({"nnodes": 2, "master_addr": "10.0.0.1"}, "master_port"),
        ({"max_restarts": -1}, "max_restarts"),
        ({"kill_grace": 0}, "kill_grace"),
        ({"kill_grace": math.nan}, "kill_grace"),
        ({"args": "--lr 1"}, "args"),
    ],
)
def test_config_refuses_bad_values_naming_field_and_value(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"`{field}`.*Received: {field}="):
        LaunchConfig(entrypoint="train.py", **kwargs)


def test_config_is_frozen_and_normalises_args() -> None:
    config = LaunchConfig(
        entrypoint="train.py",
        args=["--lr", "0.1"],
        nproc=2,
        nnodes=3,
        node_rank=1,
        master_addr="h",
        master_port=29500,
    )
    assert config.args == ("--lr", "0.1")
    assert config.world_size == 6
    assert config.command()[1:] == ["-u", launcher._SCRIPT_RUNNER, "train.py", "--lr", "0.1"]
    with pytest.raises(AttributeError):
        config.nproc = 4  # type: ignore[misc]


def test_missing_script_starts_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.py"):
        launch(LaunchConfig(entrypoint=str(tmp_path / "nope.py")))


@pytest.mark.processes
def test_each_rank_gets_its_environment_and_the_token_stays_secret(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OMP_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "SPREAD_TUNE_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in OUTER_LAUNCHER_ENV.items():  # as if nested in another launcher: must not leak
        monkeypatch.setenv(name, value)
    script = _script(
        tmp_path,
        f"""
        token = os.environ.pop("SPREAD_JOB_TOKEN")
        with open({str(tmp_path)!r} + "/token" + os.environ["RANK"], "w") as f:
            f.write(token)
        print(json.dumps({{"env": dict(os.environ), "argv": sys.argv[1:], "pid": os.getpid()}}))
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), args=("--flag", "x y"), nproc=2)) == 0
    out, err = capfd.readouterr()
    records = {}
    for line in out.splitlines():
        tag, _, payload = line.partition("] ")
        record = json.loads(payload)
        records[int(record["env"]["RANK"])] = record
        assert tag == f"[rank {record['env']['RANK']}"
    assert sorted(records) == [0, 1]
    ports = {r["env"]["MASTER_PORT"] for r in records.values()}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for rank, record in records.items():
        env = record["env"]
        assert record["argv"] == ["--flag", "x y"]
        assert env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2" and env["NNODES"] == "1"
        assert env["LOCAL_RANK"] == str(rank) and env["NODE_RANK"] == env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["SPREAD_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["SPREAD_LAUNCHER"] == "1" and env["PYTHONUNBUFFERED"] == "1"
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
        assert (env["MALLOC_MMAP_THRESHOLD_"], env["MALLOC_TRIM_THRESHOLD_"]) == ("33554432", "67108864")
        # torchrun's whole set, with torchrun's values
        assert set(TORCHRUN_ENV) <= env.keys(), set(TORCHRUN_ENV) - env.keys()
        assert env["GROUP_WORLD_SIZE"] == "1" and env["ROLE_NAME"] == "default"
        assert env["ROLE_RANK"] == str(rank) and env["ROLE_WORLD_SIZE"] == "2"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{rank}/error.json")
        assert not set(OUTER_LAUNCHER_ENV) & (env.keys() - TORCHRUN_ENV)
    run_ids = {r["env"]["TORCHELASTIC_RUN_ID"] for r in records.values()}
    assert len(run_ids) == 1 and len(run_ids.pop()) == 36  # one fresh UUID per launch
    tokens = {(tmp_path / f"token{r}").read_text() for r in (0, 1)}
    assert len(tokens) == 1
    token = tokens.pop()
    assert len(token) == 32 and token not in out and token not in err
    _assert_all_gone([r["pid"] for r in records.values()])


@pytest.mark.processes
def test_user_omp_num_threads_is_kept_and_each_launch_gets_a_fresh_token(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("SPREAD_JOB_TOKEN", "from-the-user")  # single node: ignored, a fresh one is made
    script = _script(
        tmp_path,
        """
        import hashlib
        digest = hashlib.sha256(os.environ["SPREAD_JOB_TOKEN"].encode()).hexdigest()
        print(os.environ["OMP_NUM_THREADS"], digest)
    """,
    )
    config = LaunchConfig(entrypoint=str(script))
    assert launch(config) == 0 and launch(config) == 0
    lines = capfd.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines] == ["7", "7"]
    assert len({line.split()[3] for line in lines}) == 2


@pytest.mark.processes
def test_output_is_prefixed_line_by_line_and_binary_safe(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        sys.stdout.write("one\\ntwo\\npartial without newline")
        sys.stdout.flush()
        sys.stderr.buffer.write(b"bad \\xff\\xfe bytes\\n")
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script))) == 0
    out, err = capfd.readouterr()
    assert out == "[rank 0] one\n[rank 0] two\n[rank 0] partial without newline\n"
    assert err == "[rank 0] bad \ufffd\ufffd bytes\n"
    assert launch(LaunchConfig(entrypoint=str(script), prefix_output=False)) == 0
    out, err = capfd.readouterr()
    assert out == "one\ntwo\npartial without newline"


@pytest.mark.processes
def test_a_rank_that_prints_then_fails_shows_its_lines_in_the_order_it_wrote_them(tmp_path: Path) -> None:
    """A flushed "rank 1 did 3 steps" was relayed after rank 1's own traceback now and then: each
    pipe had its own reader thread. Eight ranks, four launches: the race showed in about half of the
    launches. What a terminal shows (stdout and stderr on one stream) must be each rank's order."""
    script = _script(
        tmp_path,
        """
        rank = os.environ["RANK"]
        print(f"rank {rank} did 3 steps", flush=True)
        raise RuntimeError(f"rank {rank} failed")
    """,
    )
    for _ in range(4):
        result = subprocess.run(
            [sys.executable, "-m", "spread.cli.main", "run", "-n", "8", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stdout
        lines = result.stdout.splitlines()
        tracebacks = 0
        for rank in range(8):
            failed = [
                i
                for i, line in enumerate(lines)
                if line == f"[rank {rank}] Traceback (most recent call last):"
            ]
            if failed:
                tracebacks += 1
                printed = lines.index(f"[rank {rank}] rank {rank} did 3 steps")
                assert printed < failed[0], result.stdout
        assert tracebacks >= 1, result.stdout


@pytest.mark.processes
def test_module_mode_runs_python_dash_m(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mymod.py").write_text("import sys; print('module', sys.argv[1:])\n")
    monkeypatch.chdir(tmp_path)
    assert launch(LaunchConfig(entrypoint="mymod", module=True, args=("-x",))) == 0
    assert capfd.readouterr().out == "[rank 0] module ['-x']\n"


@pytest.mark.processes
def test_first_failure_stops_the_others_and_wins(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(
        tmp_path,
        """
        print("pid=%d" % os.getpid(), flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(0.3)
            sys.exit(3)
        time.sleep(60)
    """,
    )
    start = time.monotonic()
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 3
    assert time.monotonic() - start < 20  # far below the 60 s the other rank would sleep
    out, err = capfd.readouterr()
    assert "spread run: rank 1 exited with code 3; stopped the other 1 process(es)" in err
    assert len(_pids(out)) == 2
    _assert_all_gone(_pids(out))


@pytest.mark.processes
def test_with_recover_a_lost_rank_leaves_the_others_running_and_the_job_succeeds(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        assert os.environ["SPREAD_RECOVER"] == "1"
        if os.environ["RANK"] == "1":
            sys.exit(3)
        if os.environ["RANK"] == "2":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(5)
        print("survived", flush=True)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=3, recover=True, kill_grace=1)) == 0
    out, err = capfd.readouterr()
    assert (
        "rank 1 exited with code 3: rank 1 was lost; --recover: the job continues without it at world size 2"
        in err
    )
    assert "rank 2 stayed stopped (SIGSTOP)" in err and "killing it so the others regroup without it" in err
    assert "world size 1" in err
    assert out.count("survived") == 1


@pytest.mark.processes
def test_with_recover_a_job_whose_every_rank_is_lost_fails(tmp_path: Path) -> None:
    script = _script(tmp_path, "sys.exit(4)")
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2, recover=True, kill_grace=1)) == 4


@pytest.mark.processes
def test_grandchildren_die_with_their_rank(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(
        tmp_path,
        """
        if os.environ["RANK"] == "0":
            helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            print("pid=%d" % helper.pid, flush=True)
            time.sleep(60)
        time.sleep(0.5)
        sys.exit(1)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2, kill_grace=1)) == 1
    _assert_all_gone(_pids(capfd.readouterr().out))


@pytest.mark.processes
def test_helpers_left_behind_by_successful_ranks_are_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("pid=%d" % helper.pid, flush=True)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), kill_grace=1)) == 0
    out, err = capfd.readouterr()
    assert "left behind" in err
    _assert_all_gone(_pids(out))


@pytest.mark.processes
def test_rank_killed_by_a_signal_counts_as_128_plus_signal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert launch(LaunchConfig(entrypoint=str(script))) == 137
    assert "rank 0 exited with code 137 (killed by SIGKILL)" in capfd.readouterr().err


@pytest.mark.processes
def test_rank_ignoring_sigterm_is_killed_after_the_grace(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("pid=%d" % os.getpid(), flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(0.3)
            sys.exit(4)
        time.sleep(60)
    """,
    )
    start = time.monotonic()
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2, kill_grace=0.5)) == 4
    assert time.monotonic() - start < 20
    _assert_all_gone(_pids(capfd.readouterr().out))


@pytest.mark.processes
def test_restart_after_a_failure_then_success(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "attempts.log"
    script = _script(
        tmp_path,
        f"""
        attempt = os.environ["SPREAD_RESTART_COUNT"]
        with open({str(log)!r}, "a") as f:
            f.write(f"{{os.environ['RANK']}}:{{attempt}}\\n")
        if attempt == "0" and os.environ["RANK"] == "1":
            sys.exit(1)
        if attempt == "0":
            time.sleep(60)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2, max_restarts=1)) == 0
    assert sorted(log.read_text().split()) == ["0:0", "0:1", "1:0", "1:1"]
    err = capfd.readouterr().err
    assert "spread run: restarting (attempt 2 of 2) after rank 1 exited with code 1" in err
    _assert_all_gone([])


@pytest.mark.processes
def test_gives_up_after_max_restarts_plus_one_attempts(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "attempts.log"
    script = _script(
        tmp_path,
        f"""
        with open({str(log)!r}, "a") as f:
            f.write(os.environ["SPREAD_RESTART_COUNT"] + "\\n")
        sys.exit(5)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), max_restarts=2)) == 5
    assert log.read_text().split() == ["0", "1", "2"]
    err = capfd.readouterr().err
    assert err.count("restarting") == 2
    assert "gave up after 3 attempts" in err


@pytest.mark.processes
def test_the_launcher_hosts_a_fresh_store_for_each_attempt(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """As torchrun's agent store: ranks are clients of a TCPStore the launcher hosts on MASTER_PORT, a
    new one for each attempt (torch's env:// init adds no attempt prefix under an agent store), so a
    plain init_process_group works again after a restart."""
    script = _script(
        tmp_path,
        """
        from datetime import timedelta
        import torch.distributed as dist
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                              timedelta(seconds=20))
        store.add("visits", 1)  # outside any prefix: would count the failed attempt's ranks too
        dist.init_process_group("gloo")  # env://: the agent store, prefix /worker/attempt_<n>
        dist.barrier()
        if os.environ["RANK"] == "1" and attempt == "0":
            sys.exit(7)
        print("attempt", attempt, "visits", store.add("visits", 0), flush=True)
        dist.destroy_process_group()
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2, max_restarts=1)) == 0
    out = capfd.readouterr().out
    assert out.count("attempt 1 visits 2") == 2, out  # only this attempt's 2 ranks: a fresh store


@pytest.mark.processes
def test_the_rendezvous_port_is_released(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, 'print("port", os.environ["MASTER_PORT"])\n')
    assert launch(LaunchConfig(entrypoint=str(script))) == 0
    port = int(capfd.readouterr().out.split()[-1])
    with socket.socket() as s:  # nothing listens there any more: binding it again must work
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_multi_node_needs_a_shared_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script(tmp_path, "pass\n")
    monkeypatch.delenv("SPREAD_JOB_TOKEN", raising=False)
    monkeypatch.setenv("SPREAD_SECRET_FILE", "/proc/self/no-such-dir/secret")  # cannot be made
    config = LaunchConfig(
        entrypoint=str(script), nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=29500
    )
    with pytest.raises(ValueError, match=r"set SPREAD_JOB_TOKEN where the job is submitted"):
        launch(config)


@pytest.mark.processes
def test_non_zero_node_gets_global_ranks_and_hosts_no_store(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPREAD_JOB_TOKEN", "shared-secret-abc")
    script = _script(
        tmp_path,
        """
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_WORLD_SIZE")
        print(json.dumps({k: os.environ.get(k) for k in keys}
                         | {"token_ok": os.environ["SPREAD_JOB_TOKEN"] == "shared-secret-abc"}))
    """,
    )
    config = LaunchConfig(
        entrypoint=str(script), nproc=2, nnodes=2, node_rank=1, master_addr="10.1.2.3", master_port=29511
    )
    assert launch(config) == 0
    out = capfd.readouterr().out
    records = sorted(
        (json.loads(line.partition("] ")[2]) for line in out.splitlines()), key=lambda r: r["RANK"]
    )
    assert [(r["RANK"], r["LOCAL_RANK"]) for r in records] == [("2", "0"), ("3", "1")]
    for r in records:
        assert r["WORLD_SIZE"] == "4" and r["NODE_RANK"] == "1" and r["token_ok"]
        assert (r["MASTER_ADDR"], r["MASTER_PORT"], r["GROUP_WORLD_SIZE"]) == ("10.1.2.3", "29511", "2")
    assert "shared-secret-abc" not in out


@pytest.mark.processes
def test_all_ranks_failing_at_once_is_one_clean_failure(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, 'print("pid=%d" % os.getpid(), flush=True)\nsys.exit(9)\n')
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 9
    out, err = capfd.readouterr()
    assert err.count("exited with code 9") == 1 and "restarting" not in err
    _assert_all_gone(_pids(out))


@pytest.mark.processes
def test_servers_still_running_when_training_ends_are_stopped_and_the_job_succeeds(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A parameter-server job ends with its training: the chief and workers exited 0, servers that
    nobody told to stop (no ``close()``) are stopped after the grace, and the exit code is 0."""
    script = _script(
        tmp_path,
        """
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        print("pid=%d" % os.getpid(), task["type"], flush=True)
        if task["type"] == "ps":
            time.sleep(60)  # a server serves until told otherwise
    """,
    )
    start = time.monotonic()
    assert launch(LaunchConfig(entrypoint=str(script), workers=1, ps=2, kill_grace=1)) == 0
    assert time.monotonic() - start < 20
    out, err = capfd.readouterr()
    assert "every training task finished; stopping 2 task(s) still running (ps, ps)" in err
    _assert_all_gone(_pids(out))


@pytest.mark.processes
def test_a_failing_worker_still_fails_a_parameter_server_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The note names the task ("worker 0", as its logs and TF_CONFIG do), not its launch order."""
    script = _script(
        tmp_path,
        """
        task = json.loads(os.environ["TF_CONFIG"])["task"]
        if task["type"] == "worker":
            sys.exit(4)
        time.sleep(0.5 if task["type"] == "chief" else 60)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), workers=1, ps=1, kill_grace=1)) == 4
    assert "spread run: worker 0 exited with code 4; stopped the other" in capfd.readouterr().err


@pytest.mark.processes
def test_a_rank_left_stopped_fails_the_attempt_in_seconds(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """SIGSTOP of one rank is seen by the launcher at once, not by the peers' collective timeout."""
    script = _script(
        tmp_path,
        """
        print("pid=%d" % os.getpid(), flush=True)
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)
    """,
    )
    start = time.monotonic()
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2, kill_grace=1)) == 128 + signal.SIGSTOP
    assert time.monotonic() - start < 15  # 3 s to decide, then the stop; far below any timeout
    out, err = capfd.readouterr()
    assert "rank 1 stayed stopped (SIGSTOP) for 3." in err and "stopped the other 1 process(es)" in err
    _assert_all_gone(_pids(out))


@pytest.mark.processes
def test_a_recorded_exception_is_named_in_the_failure_note(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """torchrun's error file: a script decorated with ``@record`` writes its exception there, and the
    launcher's note names it."""
    script = _script(
        tmp_path,
        """
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main():
            if os.environ["RANK"] == "1":
                raise ValueError("bad learning rate 1e9")

        main()
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 1
    err = capfd.readouterr().err
    assert "rank 1 exited with code 1 (ValueError: bad learning rate 1e9)" in err


@pytest.mark.processes
def test_a_long_error_message_is_printed_once(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A CheckpointMismatchError lists every key that differs (900 characters on one line): the
    rank's traceback showed it, and the launcher's note said it all again."""
    script = _script(
        tmp_path,
        """
        from spread.errors import CheckpointMismatchError

        saved = "saved (16, 8) float32, expected (32, 8) float32"
        problems = [f"model: 'layer{i}.weight': {saved}" for i in range(12)]
        raise CheckpointMismatchError("backup/ckpt-8", "model", problems)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script))) == 1
    err = capfd.readouterr().err
    message = err.split("[rank 0] spread.errors.CheckpointMismatchError: ", 1)[1].splitlines()[0]
    assert len(message) > 900 and err.count(message) == 1
    note = err.splitlines()[-1]
    assert note.startswith(
        "spread run: rank 0 exited with code 1 (CheckpointMismatchError: checkpoint backup/"
    )
    assert "(in full in rank 0's traceback above)" in note and len(note) < 300


@pytest.mark.processes
@pytest.mark.parametrize(
    "consequence",
    [
        'PeerLostError(0, "all_reduce", 7, "a peer process went away")',
        'PeerFailedError(0, 1, "it could not write the checkpoint of step 4")',
    ],
    ids=["peer-lost", "peer-failed"],
)
def test_the_rank_that_raised_first_is_named_not_a_peer_that_lost_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], consequence: str
) -> None:
    """Rank 1 raises but is slow to exit; rank 0 then fails with an error of spread's that only
    reports it (a peer lost; a peer's failed checkpoint write, as under ``ulimit -f``) and exits
    first. The note and the exit code are rank 1's: its exception came first."""
    flag = tmp_path / "raised"
    script = _script(
        tmp_path,
        f"""
        import atexit
        from spread.errors import PeerFailedError, PeerLostError

        if os.environ["RANK"] == "1":
            atexit.register(time.sleep, 2)  # a slow teardown after the exception
            open({str(flag)!r}, "w").close()
            raise ValueError("bad learning rate 1e9")
        while not os.path.exists({str(flag)!r}):
            time.sleep(0.01)
        time.sleep(0.2)
        raise {consequence}
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 1
    err = capfd.readouterr().err
    assert "rank 1 exited with code 1 (ValueError: bad learning rate 1e9)" in err
    assert "rank 0 exited" not in err


@pytest.mark.processes
def test_a_chief_whose_backup_write_fails_under_a_file_size_limit_is_the_one_named(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 40 item 5: under ``ulimit -f`` the chief's checkpoint write failed and the launcher named
    rank 1, whose error only said that the chief had failed."""
    script = _script(
        tmp_path,
        f"""
        import resource
        import torch
        from torch import nn
        import spread

        if os.environ["RANK"] == "0":
            import atexit
            atexit.register(time.sleep, 2)  # rank 1 exits first, as it did in the report
            _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, hard))
        strategy = spread.MultiWorkerMirroredStrategy()  # all-reduce "auto": "native" under the limit
        with strategy.scope():
            model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
            optimizer = torch.optim.Adam(model.parameters())
        x, y = torch.randn(64, 128), torch.randint(0, 4, (64,))
        backup = spread.callbacks.BackupAndRestore({str(tmp_path / "backup")!r})
        spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy).fit(
            (x, y), epochs=2, global_batch_size=32, verbose=0, callbacks=[backup]
        )
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 1
    err = capfd.readouterr().err
    assert "rank 0 exited with code 1 (OSError: [Errno 27] File too large: " in err, err
    assert "rank 1 exited" not in err


@pytest.mark.processes
def test_without_records_the_first_rank_to_fail_is_named(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        """
        if os.environ["RANK"] == "1":
            time.sleep(1)
            os._exit(5)
        os._exit(4)
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 4
    assert "rank 0 exited with code 4" in capfd.readouterr().err


@pytest.mark.processes
def test_torch_rank_tags_are_not_doubled(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = _script(
        tmp_path,
        """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 1:
            raise RuntimeError("after the group exists")
        dist.destroy_process_group()
    """,
    )
    assert launch(LaunchConfig(entrypoint=str(script), nproc=2)) == 1
    err = capfd.readouterr().err
    assert "[rank 1] RuntimeError: after the group exists" in err
    assert "[rank1]:" not in err


def test_a_traceback_written_between_the_relays_two_reads_comes_after_the_printed_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``print`` writes a line and its newline in two writes. A rank that failed right after the relay
    had read the line without its newline had its traceback relayed first (CI saw it once, at 8 ranks).
    Here the "rank" writes the newline and its traceback just after the relay's first read of stdout."""
    from spread.cluster._output import OutputRelay

    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    os.write(out_write, b"rank 1 did 3 steps")  # print's first write
    real_read = os.read
    failed = threading.Event()

    def read(fd: int, size: int) -> bytes:
        data = real_read(fd, size)
        if fd == out_read and not failed.is_set():  # the rank goes on between the relay's reads
            failed.set()
            os.write(out_write, b"\n")  # print's second write
            os.write(err_write, b"Traceback (most recent call last):\nRuntimeError: rank 1 failed\n")
            os.close(out_write)
            os.close(err_write)
        return data

    terminal = io.StringIO()  # stdout and stderr on one stream, as on a terminal
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(os, "read", read)
    thread = OutputRelay(prefix=True, live=False).start(
        1, os.fdopen(out_read, "rb"), os.fdopen(err_read, "rb")
    )
    thread.join(5)
    assert failed.is_set() and not thread.is_alive()
    assert terminal.getvalue() == (
        "[rank 1] rank 1 did 3 steps\n"
        "[rank 1] Traceback (most recent call last):\n"
        "[rank 1] RuntimeError: rank 1 failed\n"
    )


def test_live_bar_frames_redraw_one_line_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """On a terminal a rank's carriage-return frames are shown in place, and another rank's line first
    ends the bar's line; without a terminal the frames collapse into one plain line."""
    from spread.cluster._output import OutputRelay

    def relay(live: bool) -> str:
        read_end, write_end = os.pipe()
        r = OutputRelay(prefix=True, live=live)
        err_read, err_write = os.pipe()
        os.close(err_write)
        thread = r.start(0, os.fdopen(read_end, "rb"), os.fdopen(err_read, "rb"))
        os.write(write_end, b"\r 1/3 [=  ]")
        time.sleep(0.2)
        r.write("stdout", "[rank 1] a line\n", owner=(1, "stdout"))
        os.write(write_end, b"\r 2/3 [== ]\r 3/3 [===]\ndone\n")
        os.close(write_end)
        thread.join(5)
        return capsys.readouterr().out

    assert relay(True) == ("\r[rank 0]  1/3 [=  ]\n[rank 1] a line\n[rank 0]  3/3 [===]\n[rank 0] done\n")
    assert relay(False) == "[rank 1] a line\n[rank 0] \r 1/3 [=  ]\r 2/3 [== ]\r 3/3 [===]\n[rank 0] done\n"


def test_a_bar_frame_wider_than_the_terminal_is_cut_to_its_width(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame that wraps cannot be redrawn in place: "\r" goes back to the start of its last row,
    and the rows above stay on screen. Frames are cut to the terminal's width; the line that ends
    them (with its newline) is shown whole and wraps, as a terminal wraps any line."""
    from spread.cluster._output import OutputRelay

    monkeypatch.setenv("COLUMNS", "40")
    read_end, write_end = os.pipe()
    err_read, err_write = os.pipe()
    os.close(err_write)
    thread = OutputRelay(prefix=True, live=True).start(
        0, os.fdopen(read_end, "rb"), os.fdopen(err_read, "rb")
    )
    long = "epoch 1/2  4/4 " + "x" * 60
    os.write(write_end, f"\r 1/3 [=  ]\r{long}".encode())
    time.sleep(0.2)
    os.write(write_end, b"\n")
    os.close(write_end)
    thread.join(5)
    out = capsys.readouterr().out
    overwritten = out.split("\n")[0].split("\r")[:-1]
    assert all(len(frame) < 40 for frame in overwritten), overwritten
    assert out.endswith(f"\r[rank 0] {long}\n")
