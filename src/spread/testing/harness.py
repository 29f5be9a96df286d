"""Run a function as N ranks of one job on loopback, with a hard deadline and full cleanup.

Each rank is a fresh spawned process (no state inherited from the test process) with the same
environment ``spread run`` gives: RANK, WORLD_SIZE, MASTER_ADDR/PORT, a job token, and a rendezvous
store hosted by the caller on a socket it bound itself (so there is no free-port race between
concurrent tests), as ``spread run`` and torchrun host it; or, with ``store_host="rank0"``, rank 0
hosts it, as in a job started without a launcher. Results travel back over a local pipe. Whatever
happens (a failure, a hang, the deadline) every rank's process group is killed before this returns,
and each rank's outcome or traceback is reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from spread import env as spread_env
from spread.testing.time_budget import budget


@dataclass
class RankResult:
    """What one rank did: its return value, or the error it raised, or how it died."""

    rank: int
    ok: bool = False
    value: Any = None
    error: str | None = None  # "ExceptionType: message"
    traceback: str | None = None
    exitcode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank}: ok"
        if self.timed_out:
            return f"rank {self.rank}: still running at the deadline (killed)"
        if self.error:
            return f"rank {self.rank}: raised {self.error}\n{self.traceback or ''}"
        return f"rank {self.rank}: died with exit code {self.exitcode}"


class RanksFailed(AssertionError):
    """At least one rank failed; ``results`` holds every rank's outcome."""

    def __init__(self, results: list[RankResult]) -> None:
        self.results = results
        super().__init__("\n".join(r.describe() for r in results if not r.ok))


def _child_main(
    fn: Callable[..., Any],
    rank: int,
    env: dict[str, str],
    conn: Connection,
    args: tuple,
    kwargs: dict,
) -> None:
    os.setpgrp()  # one process group per rank: the parent kills the rank and its helpers together
    _die_with_parent()
    os.environ.update(env)
    try:
        value = fn(*args, **kwargs)
        # Plain pickle (not multiprocessing's): tensors travel by value, not as shared memory that
        # vanishes when this process exits. The pipe is local and both ends are ours.
        conn.send(("ok", pickle.dumps(value)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.close()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    init_timeout: float = 30.0,
    collective_timeout: float = 30.0,
    fail_fast_grace: float | None = None,
    store_host: str = "launcher",
) -> list[RankResult]:
    """Start ``nprocs`` ranks running ``fn(*args, **kwargs)`` and return every rank's outcome.

    ``fn`` must be importable by name (a module-level function). ``rank_env`` overrides variables
    for single ranks (for example a wrong job token). After the first rank fails, the others get
    ``fail_fast_grace`` seconds (default: the collective timeout plus 10) to fail or finish on their
    own, which is how tests measure that peers notice a failure; then everything is killed.
    ``store_host``: ``"launcher"`` (this process hosts the rendezvous store for the ranks' lifetime,
    ``TORCHELASTIC_USE_AGENT_STORE=True``) or ``"rank0"`` (rank 0 hosts it on a free port).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs!r}")
    timeout, init_timeout = budget(timeout), budget(init_timeout)  # a busy machine is not a hang
    if store_host not in ("launcher", "rank0"):
        raise ValueError(f"store_host must be 'launcher' or 'rank0', got {store_host!r}")
    ctx = mp.get_context("spawn")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = None
    try:
        if store_host == "launcher":
            import torch.distributed as dist

            store = dist.TCPStore(
                "127.0.0.1",
                port,
                None,
                True,
                timedelta(seconds=timeout),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
    finally:  # the store owns the descriptor now and closes it; for rank 0, the port is free again
        listener.detach() if store is not None else listener.close()
    base_env = {
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        spread_env.JOB_TOKEN: secrets.token_hex(16),
        spread_env.INIT_TIMEOUT: str(init_timeout),
        spread_env.COLLECTIVE_TIMEOUT: str(collective_timeout),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        **({"TORCHELASTIC_USE_AGENT_STORE": "True"} if store is not None else {}),
        **(env or {}),
    }
    grace = collective_timeout + 10.0 if fail_fast_grace is None else fail_fast_grace
    procs, conns, results = [], [], [RankResult(rank=r) for r in range(nprocs)]
    start = time.monotonic()
    try:
        for rank in range(nprocs):
            child_env = {
                **base_env,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                **((rank_env or {}).get(rank, {})),
            }
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(
                    fn,
                    rank,
                    child_env,
                    child_conn,
                    args,
                    dict(kwargs or {}),
                ),
                name=f"spread-rank-{rank}",
            )
            proc.start()
            child_conn.close()
            procs.append(proc)
            conns.append(parent_conn)
        _collect(procs, conns, results, start, timeout, grace)
    finally:
        _kill_all(procs)
        del store
        for c in conns:
            c.close()
    return results


def _collect(procs, conns, results, start, timeout, grace) -> None:
    deadline = start + timeout
    pending = set(range(len(procs)))
    open_conns = dict(enumerate(conns))

    def receive(i: int) -> None:
        conn = open_conns.pop(i)
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        results[i].seconds = time.monotonic() - start
        if message[0] == "ok":
            results[i].ok, results[i].value = True, pickle.loads(message[1])
        else:
            results[i].error, results[i].traceback = message[1], message[2]

    while pending and time.monotonic() < deadline:
        waitables = [open_conns[i] for i in pending if i in open_conns] + [procs[i].sentinel for i in pending]
        wait(waitables, timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        for i in list(pending):
            if i in open_conns and open_conns[i].poll():
                receive(i)
            if procs[i].exitcode is not None:
                if i in open_conns and open_conns[i].poll():
                    receive(i)
                open_conns.pop(i, None)
                results[i].exitcode = procs[i].exitcode
                results[i].seconds = results[i].seconds or time.monotonic() - start
                results[i].ok = results[i].ok and procs[i].exitcode == 0
                pending.discard(i)
        if pending and any(r.error or (r.exitcode not in (None, 0)) for r in results):
            deadline = min(deadline, time.monotonic() + grace)
            grace = float("inf")  # the grace starts once, at the first failure
    for i in pending:
        results[i].timed_out = True


def _kill_all(procs: list) -> None:
    for proc in procs:
        if proc.pid is None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.join(timeout=10)


def run_ranks(fn: Callable[..., Any], nprocs: int, **options: Any) -> list[Any]:
    """Like :func:`launch_ranks` but returns the values in rank order, raising RanksFailed otherwise."""
    results = launch_ranks(fn, nprocs, **options)
    if not all(r.ok for r in results):
        raise RanksFailed(results)
    return [r.value for r in results]
