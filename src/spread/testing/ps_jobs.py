"""Parameter-server jobs for tests: a TF_CONFIG per process, run through :func:`launch_ranks`, or
a whole script run as one process per task (:func:`run_ps_script`, as a user starts one by hand).

Ranks ``0..W-1`` are the training tasks (chief, then workers), the next ``P`` ranks the servers.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spread import env as spread_env
from spread.cluster import ClusterSpec
from spread.testing.harness import launch_ranks
from spread.testing.time_budget import budget


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def chief_of(server_addresses: list[str]) -> ClusterSpec:
    """The cluster spec of a lone chief task using servers at ``server_addresses`` (for example
    :class:`~spread.ps.server.ParameterServer` objects started in the test's own process).

    The chief's own address is a placeholder: nothing connects to a chief that has no workers.
    """
    return ClusterSpec(
        role="chief",
        task_index=0,
        rank=0,
        world_size=1,
        cluster={"chief": ("127.0.0.1:1",), "ps": tuple(server_addresses)},
        source="tf_config",
    )


def ps_job_env(
    num_workers: int, num_ps: int, *, extra_workers: int = 0, evaluators: int = 0
) -> dict[int, dict[str, str]]:
    """TF_CONFIG for each rank: chief, workers, servers; then ``extra_workers`` ranks re-using worker
    task indices 0, 1, ... (restarted workers), then ``evaluators`` ranks that are all evaluator task
    0 (an evaluator and its restarts)."""
    ports = free_ports(num_workers + num_ps)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    cluster = {"chief": addrs[:1], "ps": addrs[num_workers:]}
    if num_workers > 1:
        cluster["worker"] = addrs[1:num_workers]
    tasks = (
        [("chief", 0)] + [("worker", i) for i in range(num_workers - 1)] + [("ps", i) for i in range(num_ps)]
    )
    tasks += [("worker", i) for i in range(extra_workers)]
    tasks += [("evaluator", 0)] * evaluators  # an evaluator, then its restarts
    return {
        rank: {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})}
        for rank, (role, index) in enumerate(tasks)
    }


def run_ps_job(
    fn: Callable[..., Any],
    num_workers: int,
    num_ps: int,
    *,
    args: tuple = (),
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    rank_env_extra: dict[int, dict[str, str]] | None = None,
    extra_workers: int = 0,
    evaluators: int = 0,
    **options: Any,
) -> list:
    """Run ``fn(*args)`` on the training ranks while the ps ranks serve; returns every RankResult.

    A rank that fails does not cut the others short (a failure test kills ranks on purpose): each
    rank has until ``timeout``.
    """
    envs = ps_job_env(num_workers, num_ps, extra_workers=extra_workers, evaluators=evaluators)
    for rank, values in (rank_env_extra or {}).items():
        envs[rank].update(values)
    return launch_ranks(
        _entry,
        len(envs),
        args=(fn, args),
        rank_env=envs,
        env=env,
        timeout=timeout,
        fail_fast_grace=options.pop("fail_fast_grace", timeout),
        **options,
    )


def _entry(fn: Callable[..., Any], args: tuple) -> Any:
    """A ps task serves until stopped; a coordinated worker serves tasks and ends with SystemExit(0):
    both count as success and return ``"exited 0"``."""
    role = json.loads(os.environ["TF_CONFIG"])["task"]["type"]
    try:
        if role == "ps":
            from spread.strategies import ParameterServerStrategy

            ParameterServerStrategy()
            raise AssertionError("a ps task returned from ParameterServerStrategy()")
        return fn(*args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        return "exited 0"


@dataclass
class TaskRun:
    """How one task's process of :func:`run_ps_script` ended."""

    role: str
    index: int
    pid: int
    returncode: int | None  # None: still running at the deadline (then killed)
    seconds: float  # from the job's start to this process's exit (or the deadline)
    stdout: str
    stderr: str

    @property
    def task(self) -> str:
        return f"{self.role} {self.index}"

    def describe(self) -> str:
        state = "still running at the deadline" if self.returncode is None else f"exit {self.returncode}"
        return f"{self.task} (pid {self.pid}): {state} after {self.seconds:.1f}s\n{self.stderr[-3000:]}"


def run_ps_script(
    script: str | Path,
    num_workers: int,
    num_ps: int,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> list[TaskRun]:
    """Run ``script`` as a whole parameter-server job, one ``python script`` process per task, each
    with its ``TF_CONFIG`` and a shared fresh ``SPREAD_JOB_TOKEN``, and nothing else: no launcher
    stops anyone, so the job must end by itself. Processes still running at ``timeout`` (or when
    this function is interrupted) are killed with their process groups and reported with
    ``returncode=None``. Returns every task's run in
    rank order (chief, workers, servers)."""
    envs = ps_job_env(num_workers, num_ps)
    token = secrets.token_hex(16)
    procs: list[tuple[str, int, subprocess.Popen]] = []
    ended: dict[int, float] = {}
    with tempfile.TemporaryDirectory(prefix="spread-ps-script-") as logs:
        start = time.monotonic()
        try:
            for rank, rank_env in envs.items():
                task = json.loads(rank_env["TF_CONFIG"])["task"]
                with open(Path(logs, f"{rank}.out"), "w") as out, open(Path(logs, f"{rank}.err"), "w") as err:
                    proc = subprocess.Popen(
                        # -X faulthandler: a task still running at the deadline is sent SIGABRT
                        # first and prints every thread's stack, so a hang says where it waited.
                        [sys.executable, "-u", "-X", "faulthandler", str(script), *args],
                        env={**os.environ, **(env or {}), **rank_env, spread_env.JOB_TOKEN: token},
                        stdout=out,
                        stderr=err,
                        # Its own session: killed with its helpers below. No preexec_fn (it would make
                        # this a plain fork: in a process that loaded gRPC, gRPC's fork handlers
                        # restart a poller thread in the child, whose epoll descriptor close_fds then
                        # closes, and the child aborts before it runs).
                        start_new_session=True,
                    )
                procs.append((task["type"], int(task["index"]), proc))
            deadline = start + budget(timeout)
            while len(ended) < len(procs) and time.monotonic() < deadline:
                for i, (_, _, proc) in enumerate(procs):
                    if i not in ended and proc.poll() is not None:
                        ended[i] = time.monotonic() - start
                time.sleep(0.05)
        finally:
            hung = [i for i, (_, _, proc) in enumerate(procs) if proc.poll() is None]
            _dump_stacks([procs[i][2] for i in hung])
            for i, (_, _, proc) in enumerate(procs):
                if i in hung:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(10)
                elif i not in ended:
                    ended[i] = time.monotonic() - start
        return [
            TaskRun(
                role,
                index,
                proc.pid,
                proc.returncode if i in ended else None,
                ended.get(i, timeout),
                Path(logs, f"{i}.out").read_text(errors="replace"),
                Path(logs, f"{i}.err").read_text(errors="replace"),
            )
            for i, (role, index, proc) in enumerate(procs)
        ]


def _dump_stacks(running: list[subprocess.Popen]) -> None:
    """SIGABRT to each process (faulthandler prints its threads' stacks to its stderr), then wait
    up to 5 s for them to be written."""
    for proc in running:
        try:
            os.kill(proc.pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(p.poll() is None for p in running):
        time.sleep(0.05)
