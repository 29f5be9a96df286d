"""The local launcher behind ``spread run``: start N ranks, relay their output, fail fast, leave nothing.

Why not just torchrun: spread wants four things torchrun does not give together.

* **No free-port race, store on loopback.** On node 0 the launcher binds the rendezvous socket itself
  (to ``MASTER_ADDR``, port 0 unless told) and hands the open listening socket to global rank 0
  (``SPREAD_STORE_FD``, via ``pass_fds``), which hosts its ``TCPStore`` on it. No window exists in
  which another program can take the port, and the store never listens on all interfaces.
* **First failure wins.** When a rank exits non-zero the others are stopped at once and
  ``spread run`` exits with that rank's code (``128 + S`` for a rank killed by signal ``S``).
* **Nothing survives.** Each rank runs in its own session, so stopping a rank stops its process group
  (its helpers and grandchildren too): SIGTERM, then SIGKILL after ``kill_grace`` seconds. Ranks get
  ``PR_SET_PDEATHSIG=SIGKILL`` (Linux), so even a SIGKILLed launcher leaves no rank behind. (A rank's
  own helpers are beyond reach in that one case: the kernel kills the rank, not its group.)
* **Bounded restarts.** ``max_restarts`` relaunches the whole group with ``SPREAD_RESTART_COUNT``
  incremented and a fresh rendezvous socket; SIGINT/SIGTERM/SIGHUP never restart.

This module must not import torch (or any spread module that does): ``spread run`` should be running
the user's script a few tens of milliseconds after it is typed.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from spread.cluster._output import OutputRelay
from spread.cluster._process import bind_listener, die_with_parent_hook, group_alive, signal_group

TOKEN_ENV = "SPREAD_JOB_TOKEN"
STORE_FD_ENV = "SPREAD_STORE_FD"
DEFAULT_MASTER_ADDR = "127.0.0.1"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_REAP_TIMEOUT = 10.0  # seconds to wait for SIGKILLed ranks to be reaped (only the kernel can delay it)
_RELAY_JOIN_TIMEOUT = 2.0  # a setsid'd grandchild may keep a pipe open forever; do not wait on it
_TICK = 0.1  # seconds between checks for a stop signal while waiting on the ranks


def _invalid(name: str, rule: str, value: object) -> ValueError:
    return ValueError(f"Invalid value for `{name}`: {rule}. Received: {name}={value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    """What ``spread run`` starts: ``nproc`` copies of one script (or module) on this node.

    Attributes:
        entrypoint: path of the script, or a module name when ``module`` is true.
        args: arguments passed to every rank after the script.
        nproc: processes on this node (``LOCAL_WORLD_SIZE``).
        nnodes: nodes in the job; ``WORLD_SIZE = nproc * nnodes``.
        node_rank: this node's index; global ``RANK = node_rank * nproc + local_rank``.
        master_addr: address of node 0's rendezvous store; ``127.0.0.1`` when ``None`` (single node
            only: with ``nnodes > 1`` it must be given, the same on every node).
        master_port: port of the store; ``None`` or 0 picks a free one on a single node.
        module: run ``python -m entrypoint`` instead of a script.
        max_restarts: how many times the whole group is relaunched after a failure.
        kill_grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        prefix_output: tag every relayed line with ``[rank R] ``.
        workers: with ``ps``: worker tasks beside the chief (a parameter-server job).
        ps: parameter-server tasks; when > 0 the job is a parameter-server job: one chief, ``workers``
            workers, ``ps`` servers and (``evaluator``) an evaluator, each its own process with a
            ``TF_CONFIG`` naming every task's loopback address (``nproc`` is then that count).
        evaluator: with ``ps``: also start an evaluator task.
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    module: bool = False
    max_restarts: int = 0
    kill_grace: float = 3.0
    prefix_output: bool = True
    workers: int = 0
    ps: int = 0
    evaluator: bool = False

    def __post_init__(self) -> None:
        for name in ("workers", "ps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise _invalid(name, "must be an integer >= 0", getattr(self, name))
        if (self.workers or self.evaluator) and not self.ps:
            raise _invalid("ps", "must be >= 1 with workers or evaluator (a parameter-server job)", self.ps)
        if self.ps:
            if self.nnodes != 1:
                raise _invalid(
                    "nnodes", "must be 1 for a parameter-server job started by spread run", self.nnodes
                )
            object.__setattr__(self, "nproc", len(self.ps_tasks()))
        if not isinstance(self.entrypoint, str) or not self.entrypoint:
            raise _invalid("entrypoint", "must be a non-empty script path or module name", self.entrypoint)
        if isinstance(self.args, str) or not all(isinstance(a, str) for a in self.args):
            raise _invalid("args", "must be a sequence of strings", self.args)
        object.__setattr__(self, "args", tuple(self.args))
        for name in ("nproc", "nnodes"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _invalid(name, "must be an integer >= 1", value)
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise _invalid("node_rank", f"must be an integer in [0, nnodes={self.nnodes})", self.node_rank)
        if self.master_addr is not None and (not isinstance(self.master_addr, str) or not self.master_addr):
            raise _invalid("master_addr", "must be a non-empty host name or address", self.master_addr)
        if self.master_port is not None and (
            not _is_int(self.master_port) or not 0 <= self.master_port <= 65535
        ):
            raise _invalid(
                "master_port", "must be an integer in [0, 65535] (0: any free port)", self.master_port
            )
        if self.nnodes > 1 and self.master_addr is None:
            raise _invalid(
                "master_addr", "is required when nnodes > 1 (the address node 0 is reached at)", None
            )
        if self.nnodes > 1 and not self.master_port:
            raise _invalid(
                "master_port", "must be a fixed port in [1, 65535] when nnodes > 1", self.master_port
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise _invalid("max_restarts", "must be an integer >= 0", self.max_restarts)
        grace = self.kill_grace
        if (
            isinstance(grace, bool)
            or not isinstance(grace, int | float)
            or not (grace > 0 and math.isfinite(grace))
        ):
            raise _invalid("kill_grace", "must be a finite number of seconds > 0", grace)

    def ps_tasks(self) -> list[tuple[str, int]]:
        """(role, index) of each process of a parameter-server job, in launch order."""
        tasks = [("chief", 0)] + [("worker", i) for i in range(self.workers)]
        tasks += [("ps", i) for i in range(self.ps)]
        return tasks + ([("evaluator", 0)] if self.evaluator else [])

    @property
    def world_size(self) -> int:
        """Processes in the whole job: ``nproc * nnodes``."""
        return self.nproc * self.nnodes

    def command(self) -> list[str]:
        """The command line every rank runs (the same for all ranks; no secrets on it)."""
        target = ["-m", self.entrypoint] if self.module else [self.entrypoint]
        return [sys.executable, "-u", *target, *self.args]


def exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal ``S`` (``returncode == -S``) counts as ``128 + S``."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(rank: int, returncode: int) -> str:
    text = f"rank {rank} exited with code {exit_code(returncode)}"
    if returncode < 0:
        try:
            text += f" (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return text


def _job_token(config: LaunchConfig) -> str:
    """A fresh token per single-node launch; across nodes it must be shared, so it comes from the env."""
    if config.nnodes == 1:
        return secrets.token_hex(16)
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(
            f"a job on {config.nnodes} nodes needs {TOKEN_ENV} set in the environment, with the same value "
            f"on every node, so that processes of different jobs can never join each other. For example: "
            f"export {TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))') and copy it "
            f"to every node's environment (never onto a command line)."
        )
    return token


class _SignalTrap:
    """Turns SIGINT/SIGTERM/SIGHUP into queue events, so the main loop stops the ranks in order.

    ``queue.SimpleQueue.put`` is reentrant, hence safe to call from a signal handler that interrupts
    the main thread inside ``get``. Handlers are installed only on the main thread (Python's rule).
    """

    def __init__(self, events: queue.SimpleQueue) -> None:
        self.events = events
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for signum in _STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self.events.put(("signal", signum))


@dataclass
class _Outcome:
    failure: tuple[int, int] | None = None  # (global rank, returncode) of the first failing rank


class _Attempt:
    """One launch of all local ranks: spawn, watch, stop. Never reused."""

    def __init__(self, config: LaunchConfig, number: int, token: str, trap: _SignalTrap, relay: OutputRelay):
        self.config, self.number, self.token, self.trap, self.relay = config, number, token, trap, relay
        self.events = trap.events
        self.procs: list[subprocess.Popen] = []
        self.returncodes: dict[int, int] = {}
        self.threads: list[threading.Thread] = []
        self.tf_config: dict[str, list[str]] | None = None

    def rank(self, local_rank: int) -> int:
        return self.config.node_rank * self.config.nproc + local_rank

    def _env(self, local_rank: int, addr: str, port: int, store_fd: int | None) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.pop(STORE_FD_ENV, None)  # an fd number inherited from an outer launcher means nothing here
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # there is no torchelastic agent store under us
        env.update(
            RANK=str(self.rank(local_rank)),
            WORLD_SIZE=str(c.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(c.nproc),
            GROUP_RANK=str(c.node_rank),
            NODE_RANK=str(c.node_rank),
            NNODES=str(c.nnodes),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            SPREAD_RESTART_COUNT=str(self.number),
            TORCHELASTIC_RESTART_COUNT=str(self.number),
            SPREAD_LAUNCHER="1",
            PYTHONUNBUFFERED="1",
        )
        env[TOKEN_ENV] = self.token
        if not env.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // c.nproc))
        if store_fd is not None:
            env[STORE_FD_ENV] = str(store_fd)
        if self.tf_config is not None:  # a parameter-server job: roles come from TF_CONFIG alone
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
                env.pop(name, None)
            role, index = c.ps_tasks()[local_rank]
            env["TF_CONFIG"] = json.dumps({"cluster": self.tf_config, "task": {"type": role, "index": index}})
        return env

    def run(self) -> _Outcome:
        """Spawn every local rank, wait for all or the first failure, and stop whatever remains."""
        c = self.config
        addr, port = c.master_addr or DEFAULT_MASTER_ADDR, c.master_port or 0
        listener = bind_listener(addr, port) if c.node_rank == 0 and not c.ps else None
        if c.ps:
            self.tf_config = _ps_cluster(c, addr)
        try:
            if listener is not None:  # children connect to the numeric address the store listens on
                addr, port = listener.getsockname()[:2]
            hook = die_with_parent_hook()
            for local_rank in range(c.nproc):
                if self.trap.signum is not None:
                    break
                fd = listener.fileno() if listener is not None and self.rank(local_rank) == 0 else None
                self.procs.append(
                    subprocess.Popen(
                        c.command(),
                        env=self._env(local_rank, addr, port, fd),
                        stdin=None if self.rank(local_rank) == 0 else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                        preexec_fn=hook,
                        pass_fds=() if fd is None else (fd,),
                    )
                )
        except OSError:  # a rank could not start: the ones that did must not outlive this call
            for proc in self.procs:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                proc.stdout.close()  # type: ignore[union-attr]
                proc.stderr.close()  # type: ignore[union-attr]
            raise
        finally:
            if listener is not None:
                listener.close()  # rank 0 holds its own copy; the port dies with rank 0
        # Threads start only after every fork: preexec_fn must not run while other threads hold locks.
        for local_rank, proc in enumerate(self.procs):
            rank = self.rank(local_rank)
            label: int | str = rank if not c.ps else " ".join(map(str, c.ps_tasks()[local_rank]))
            self.threads.append(self.relay.start(label, proc.stdout, "stdout"))  # type: ignore[arg-type]
            self.threads.append(self.relay.start(label, proc.stderr, "stderr"))  # type: ignore[arg-type]
            threading.Thread(target=self._watch, args=(local_rank, proc), daemon=True).start()
        outcome = self._wait()
        running = len(self.procs) - len(self.returncodes)
        self._stop()
        for thread in self.threads:
            thread.join(timeout=_RELAY_JOIN_TIMEOUT)
        if outcome.failure is not None:
            rank, code = outcome.failure
            self.relay.note(f"{_describe(rank, code)}; stopped the other {running} process(es)")
        elif self.trap.signum is not None:
            name = signal.Signals(self.trap.signum).name
            self.relay.note(f"received {name}; stopped {running} process(es)")
        return outcome

    def _watch(self, local_rank: int, proc: subprocess.Popen) -> None:
        self.events.put(("exit", self.number, local_rank, proc.wait()))

    def _take(self, timeout: float | None) -> bool:
        """Handle one event; returns True for a signal (a request to stop now)."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return False
        if event[0] == "signal":
            return True
        _, number, local_rank, returncode = event
        if number == self.number:
            self.returncodes[local_rank] = returncode
        return False

    def _wait(self) -> _Outcome:
        if self.trap.signum is not None:
            return _Outcome()
        while len(self.returncodes) < len(self.procs):
            seen = set(self.returncodes)
            # A timeout, not a blocking get: a signal delivered to a relay thread only runs its Python
            # handler when the main thread next executes bytecode.
            if self._take(_TICK):
                return _Outcome()
            for local_rank in self.returncodes.keys() - seen:
                if self.returncodes[local_rank] != 0:
                    return _Outcome(failure=(self.rank(local_rank), self.returncodes[local_rank]))
        return _Outcome()

    def _stop(self) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after the grace, reap the ranks.

        Groups of ranks that already exited are signalled too: their grandchildren live there.
        A second stop signal during the grace skips the rest of it.
        """
        pgids = [p.pid for p in self.procs]
        live = [g for g in pgids if group_alive(g)]
        if live:
            if self.returncodes.keys() >= set(range(len(self.procs))) and self.trap.signum is None:
                self.relay.note(f"stopping {len(live)} process group(s) left behind by ranks that exited")
            for pgid in live:
                signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.config.kill_grace
            while (remaining := deadline - time.monotonic()) > 0:
                if self._take(min(remaining, 0.05)):
                    break
                if not any(group_alive(g) for g in live):
                    break
            for pgid in live:
                signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_TIMEOUT
        while len(self.returncodes) < len(self.procs) and time.monotonic() < deadline:
            self._take(0.05)


def _ps_cluster(config: LaunchConfig, host: str) -> dict[str, list[str]]:
    """Loopback addresses for every task of a parameter-server job.

    Free ports are found by binding port 0 and closing: a program could take one before the task
    binds it (the task then fails with a clear error), a race the store socket of synchronous jobs
    avoids by being handed over open; servers bind their own port, so that trick does not apply.
    """
    tasks = [t for t in config.ps_tasks() if t[0] != "evaluator"]
    socks = [bind_listener(host, 0) for _ in tasks]
    try:
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    cluster: dict[str, list[str]] = {}
    for (role, _), port in zip(tasks, ports, strict=True):
        cluster.setdefault(role, []).append(f"{host}:{port}")
    return cluster


def _check_entrypoint(config: LaunchConfig) -> None:
    if not config.module and not os.path.isfile(config.entrypoint):
        raise FileNotFoundError(
            f"script not found: {config.entrypoint!r} (relative to {os.getcwd()}); "
            f"to run a module instead, pass -m (module=True)"
        )


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node; return the exit code for ``spread run``.

    Blocks until every rank has exited. Returns 0 when all ranks of an attempt succeed; otherwise,
    once restarts are spent, the first failing rank's exit code (``128 + S`` when killed by signal
    ``S``); ``128 + S`` when the launcher itself receives SIGINT, SIGTERM or SIGHUP (the ranks are
    stopped, never restarted). Either way no rank or rank helper is left running.

    Raises:
        FileNotFoundError: the script does not exist (nothing was started).
        ValueError: a multi-node job without ``SPREAD_JOB_TOKEN`` in the environment.
        OSError: the rendezvous port cannot be bound, or a rank cannot be started (ranks already
            started are stopped first).
    """
    _check_entrypoint(config)
    token = _job_token(config)
    relay = OutputRelay(prefix=config.prefix_output)
    attempts = config.max_restarts + 1
    with _SignalTrap(queue.SimpleQueue()) as trap:
        for number in range(attempts):
            if trap.signum is not None:
                break
            outcome = _Attempt(config, number, token, trap, relay).run()
            if trap.signum is not None:
                break
            if outcome.failure is None:
                return 0
            rank, returncode = outcome.failure
            if number + 1 < attempts:
                relay.note(
                    f"restarting (attempt {number + 2} of {attempts}) after {_describe(rank, returncode)}"
                )
            elif attempts > 1:
                relay.note(
                    f"gave up after {attempts} attempts; the last failure: {_describe(rank, returncode)}"
                )
        if trap.signum is not None:
            return 128 + trap.signum
        return exit_code(outcome.failure[1])  # type: ignore[index]
