"""The local launcher behind ``spread run``: start N ranks, relay their output, fail fast, leave nothing.

It keeps torchrun's contract, so that any script written for torchrun runs unchanged: the same
environment variables (``RANK`` ... ``TORCHELASTIC_RUN_ID``), and on node 0 a rendezvous store
hosted beside the ranks (``TORCHELASTIC_USE_AGENT_STORE=True``), to which a plain
``init_process_group("gloo")`` and spread's own rendezvous both connect as clients, under a prefix per
attempt. On top of it:

* **No free-port race, store on loopback.** The launcher binds the store's socket itself (to
  ``MASTER_ADDR``, port 0 unless told) and hands the open socket to the store's process
  (:mod:`spread.cluster._store_host`): no window exists in which another program can take the port,
  and the store never listens on all interfaces.
* **First failure wins.** When a rank exits non-zero, or stays stopped (SIGSTOP) for
  ``_STOPPED_LIMIT`` seconds, the others are stopped at once and ``spread run`` exits with that rank's
  code (``128 + S`` for a rank killed by signal ``S``; torchrun exits 1 for any failure). The rank
  named is the one whose exception came first (recorded in torchrun's ``TORCHELASTIC_ERROR_FILE``
  by spread's script runner), not a peer that exited sooner only because it lost that rank.
* **Signals reach the ranks as a terminal delivers them.** SIGINT (Ctrl-C), SIGTERM and SIGHUP sent to
  the launcher are forwarded to every rank's process group, so ``except KeyboardInterrupt:`` handlers
  run; what is still alive ``kill_grace`` seconds later is SIGKILLed (a second signal: at once).
* **Nothing survives.** Each rank runs in its own session, so stopping a rank stops its process group
  (its helpers and grandchildren too). Ranks and the store get ``PR_SET_PDEATHSIG=SIGKILL`` (Linux),
  so even a SIGKILLed launcher leaves no rank behind.
* **A parameter-server job ends with its training.** Once the chief and every worker have exited 0,
  servers (and the evaluator) still running after ``kill_grace`` seconds are stopped: the job succeeds.
* **A lost parameter server is started again in place** (``recover`` with ``ps``): a server task
  that exits non-zero (or stays stopped, then killed) is started again at its address, the others
  running on; its chief restores it from the backup (:mod:`spread.ps.in_place`). At most
  ``_SERVER_REPLACEMENTS`` times per server; a lost chief, worker or evaluator fails the job.
* **Bounded restarts.** ``max_restarts`` relaunches the whole group with ``TORCHELASTIC_RESTART_COUNT``
  incremented; the store lives on, and each attempt's keys live under their own prefix. Stop signals
  never restart.
* **Losses told to the other machines.** Under ``--recover`` with several machines each launcher keeps
  a report in the job store (which of its ranks exited, whether it got a stop signal, a beat),
  written by :mod:`spread.cluster._machine_reporter`: survivors elsewhere regroup without waiting
  for ``SPREAD_REGROUP_TIMEOUT`` (:mod:`spread.cluster.machine_reports`).

This module must not import torch (or any spread module that does): ``spread run`` should be running
the user's script a few tens of milliseconds after it is typed; the store's process imports torch.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spread import env as spread_env
from spread.cluster import allocator
from spread.cluster._output import OutputRelay
from spread.cluster._process import (
    bind_listener,
    die_with_parent_hook,
    group_alive,
    process_state,
    signal_group,
)
from spread.cluster.elastic import ElasticRendezvous, RendezvousFailed, Round, facing_address
from spread.cluster.job_secret import shared_job_token
from spread.cluster.where import ReportFile, read_where
from spread.errors import CollectiveTimeout, PeerFailedError, PeerLostError

TOKEN_ENV = spread_env.JOB_TOKEN
DEFAULT_MASTER_ADDR = "127.0.0.1"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_REAP_TIMEOUT = 10.0  # seconds to wait for SIGKILLed ranks to be reaped (only the kernel can delay it)
_RELAY_JOIN_TIMEOUT = 2.0  # a setsid'd grandchild may keep a pipe open forever; do not wait on it
_TICK = 0.1  # seconds between checks for a stop signal or a stopped rank while waiting on the ranks
_STOPPED_LIMIT = 3.0  # seconds a rank may stay stopped (SIGSTOP, state T) before it counts as failed
_SHORT_ROUND = 60.0  # seconds to let a round that admits machines complete before the launcher ends
_WAITING_EVERY = 5.0  # seconds between asking the rendezvous whether machines wait to join (torchrun's)
# The failure note names the exception in at most this many characters: the rank's traceback, just
# above it, has the whole message (a CheckpointMismatchError listing every key ran to 900 characters,
# and the note said it all a second time).
_SUMMARY_CHARACTERS = 160
_SERVICE_ROLES = ("ps", "evaluator")  # tasks of a parameter-server job that serve the training tasks
_SERVER_REPLACEMENTS = 5  # --recover: times one parameter server is started again before the job fails
# Variables an outer launcher may have set that would misdirect our ranks if inherited.
_INHERITED_NOISE = ("TORCHELASTIC_ERROR_FILE", "TF_CONFIG")
# Exceptions that report another rank's failure: never named as the cause when a rank raised another.
_CONSEQUENCES = frozenset(
    f"{e.__module__}.{e.__qualname__}" for e in (PeerLostError, CollectiveTimeout, PeerFailedError)
)


def _invalid(name: str, rule: str, value: object) -> ValueError:
    return ValueError(f"Invalid value for `{name}`: {rule}. Received: {name}={value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SCRIPT_RUNNER = str(Path(__file__).with_name("_run_script.py"))


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
        recover: recovery without restart: a rank that exits non-zero (or stays stopped, then killed)
            is lost, not a failure of the job: the others keep running (told by ``SPREAD_RECOVER=1``,
            they regroup without it) and the job succeeds when every rank left exits 0. In a
            parameter-server job: a lost server is started again at its address (``SPREAD_PS_REPLACEMENT``
            says which time) and restored from the chief's backup while the others wait; a lost
            training task or evaluator fails the job as without it.
        kill_grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        prefix_output: tag every relayed line with ``[rank R] ``.
        workers: with ``ps``: worker tasks beside the chief (a parameter-server job).
        ps: parameter-server tasks; when > 0 the job is a parameter-server job: one chief, ``workers``
            workers, ``ps`` servers and (``evaluator``) an evaluator, each its own process with a
            ``TF_CONFIG`` naming every task's loopback address (``nproc`` is then that count).
        evaluator: with ``ps``: also start an evaluator task.
        run_id: the job's id (``TORCHELASTIC_RUN_ID``, torchrun's ``--rdzv-id``); a fresh UUID if ``None``.
        no_python: run ``entrypoint`` as a program, not as a Python script (torchrun's ``--no-python``).
        role: the workers' role name (``ROLE_NAME``, torchrun's ``--role``).
        rdzv_backend: ``"static"``: ``node_rank`` numbers the machines, node 0 hosts the store;
            ``"c10d"``: torch's elastic rendezvous at ``master_addr:master_port`` numbers them, each
            round (``node_rank`` is ignored), with ``min_nodes`` to ``nnodes`` machines.
        min_nodes: with ``"c10d"``: the fewest machines a round starts with (``None``: ``nnodes``).
        rdzv_conf: with ``"c10d"``: torch's rendezvous settings (``join_timeout``,
            ``last_call_timeout``, ``close_timeout``, ``read_timeout``, ...), as torchrun's ``--rdzv-conf``.
        local_addr: with ``"c10d"``: the address other machines reach this one at (default: this
            machine's address on the route to ``master_addr``).
        where_command: a command printing where each rank is (``spread run`` gives
            ``python -m spread.cli._where``), run with the store's host, port, the attempt and the world
            size as arguments on SIGUSR1 and when a rank stays stopped; empty: no such report.
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
    recover: bool = False
    kill_grace: float = 10.0
    prefix_output: bool = True
    workers: int = 0
    ps: int = 0
    evaluator: bool = False
    run_id: str | None = None
    no_python: bool = False
    role: str = "default"
    where_command: tuple[str, ...] = ()
    rdzv_backend: str = "static"
    min_nodes: int | None = None
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    local_addr: str | None = None

    def __post_init__(self) -> None:
        for name in ("workers", "ps"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise _invalid(name, "must be an integer >= 0", getattr(self, name))
        if not isinstance(self.recover, bool):
            raise _invalid("recover", "must be True or False", self.recover)
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
        if self.module and self.no_python:
            raise _invalid("module", "cannot be combined with no_python", self.module)
        for name in ("run_id", "role"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _invalid(name, "must be a non-empty string", value)
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
        if (self.nnodes > 1 or self.rdzv_backend == "c10d") and self.master_addr is None:
            raise _invalid(
                "master_addr",
                "is required when nnodes > 1 or rdzv_backend='c10d' (the address of node 0 or of the "
                "rendezvous, --rdzv-endpoint)",
                None,
            )
        if (self.nnodes > 1 or self.rdzv_backend == "c10d") and not self.master_port:
            raise _invalid(
                "master_port", "must be a fixed port in [1, 65535] when nnodes > 1", self.master_port
            )
        if self.rdzv_backend not in ("static", "c10d"):
            raise _invalid("rdzv_backend", "must be 'static' or 'c10d'", self.rdzv_backend)
        if self.rdzv_backend == "c10d":
            if self.ps:
                raise _invalid(
                    "rdzv_backend", "must be 'static' for a parameter-server job", self.rdzv_backend
                )
            low = self.nnodes if self.min_nodes is None else self.min_nodes
            if not _is_int(low) or not 1 <= low <= self.nnodes:
                raise _invalid(
                    "min_nodes", f"must be an integer in [1, nnodes={self.nnodes}]", self.min_nodes
                )
            object.__setattr__(self, "min_nodes", low)
        elif self.min_nodes not in (None, self.nnodes):
            raise _invalid(
                "min_nodes", "needs rdzv_backend='c10d' (an elastic range of machines)", self.min_nodes
            )
        object.__setattr__(
            self, "rdzv_conf", tuple((str(k), str(v)) for k, v in dict(self.rdzv_conf).items())
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
        """The command line every rank runs (the same for all ranks; no secrets on it). A script runs
        through :mod:`spread.cluster._run_script`, which ends torch.distributed before finalization."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [sys.executable, "-u", "-m", self.entrypoint, *self.args]
        return [sys.executable, "-u", _SCRIPT_RUNNER, self.entrypoint, *self.args]


def exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal ``S`` (``returncode == -S``) counts as ``128 + S``."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(who: str, returncode: int) -> str:
    """``"rank 1 exited with code 137 (killed by SIGKILL)"``; ``who`` names the process."""
    text = f"{who} exited with code {exit_code(returncode)}"
    if returncode < 0:
        try:
            text += f" (killed by {signal.Signals(-returncode).name})"
        except ValueError:
            pass
    return text


def _shortened(summary: str, rank: int) -> str:
    """``summary`` cut at a word to ``_SUMMARY_CHARACTERS``, saying where the rest is."""
    if len(summary) <= _SUMMARY_CHARACTERS:
        return summary
    return f"{summary[:_SUMMARY_CHARACTERS].rsplit(' ', 1)[0]} ... (in full in rank {rank}'s traceback above)"


def _job_token(config: LaunchConfig, run_id: str) -> str:
    """A fresh token per single-machine launch; across machines every node computes the same one
    (:mod:`spread.cluster.job_secret`), never sent over the network."""
    if config.nnodes == 1 and config.rdzv_backend == "static":
        return secrets.token_hex(16)
    return shared_job_token(run_id)


class _SignalTrap:
    """Turns stop signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT) into queue events, so the main loop
    forwards them to the ranks in order.

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
            self._previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, self._ask_where)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self.events.put(("signal", signum))

    def _ask_where(self, signum: int, frame: object) -> None:
        self.events.put(("where",))


class _StoreHost:
    """Node 0's rendezvous store for one attempt: a process serving a ``TCPStore`` on a socket bound
    here (see :mod:`spread.cluster._store_host`). Ends when :meth:`close` closes its stdin.

    A fresh store per attempt, as torchrun's agent makes one per rendezvous round: torch's ``env://``
    init relies on it (it adds no per-attempt prefix of its own under an agent store).
    """

    def __init__(self, addr: str, port: int) -> None:
        listener = bind_listener(addr, port)
        try:
            self.addr, self.port = listener.getsockname()[:2]  # the numeric address it listens on
            fd = listener.fileno()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "spread.cluster._store_host", str(fd), self.addr, str(self.port)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent_hook(),
                pass_fds=(fd,),
            )
        finally:
            listener.close()  # the store's process holds its own copy; the port dies with it

    def close(self) -> None:
        """Stop serving (the port is free again when this returns). The ranks are gone and the store
        holds nothing worth keeping, so a store process still importing torch (a script that ended
        at once) is killed rather than waited for."""
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=0.1)  # a serving store exits on EOF within milliseconds
        except (OSError, subprocess.TimeoutExpired):
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class _MachineReporter:
    """``--recover`` on several machines: this machine's report in the job store (exited ranks, a stop
    signal, a beat), kept by :mod:`spread.cluster._machine_reporter` for one attempt, so that
    survivors on other machines regroup without waiting for ``SPREAD_REGROUP_TIMEOUT``."""

    _CLOSE_WAIT = 1.0  # seconds for the reporter to write what it was told and end (it writes in ms)

    def __init__(self, address: tuple[str, int], attempt: int, launcher_id: int, token: str) -> None:
        settings = {"addr": address[0], "port": address[1], "attempt": attempt, "launcher": launcher_id}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spread.cluster._machine_reporter", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env={**os.environ, TOKEN_ENV: token},  # never on the command line
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which decides
            preexec_fn=die_with_parent_hook(),
        )

    def tell(self, **event: object) -> None:
        """``exited=PGID`` (a rank exited) or ``leaving=True`` (the launcher got a stop signal)."""
        try:
            self.proc.stdin.write(json.dumps(event).encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):
            pass  # the reporter is gone: the survivors fall back to the regroup timeout

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=self._CLOSE_WAIT)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class _ErrorFiles:
    """torchrun's ``TORCHELASTIC_ERROR_FILE``: a path per rank and attempt where a script decorated with
    ``torch.distributed.elastic.multiprocessing.errors.record`` writes its exception as JSON, read
    back to name the failure. The directory is private to the launch and removed with it."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spread-run-"))

    def path(self, attempt: int, rank: int) -> Path:
        folder = self.root / f"attempt_{attempt}" / str(rank)
        folder.mkdir(parents=True, exist_ok=True)
        return folder / "error.json"

    def _record(self, attempt: int, rank: int) -> dict[str, Any] | None:
        try:
            record = json.loads(self.path(attempt, rank).read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def summary(self, attempt: int, rank: int) -> str | None:
        """The first line of the recorded exception, if the rank recorded one."""
        try:
            message = self._record(attempt, rank)["message"]  # type: ignore[index]
            text = message["message"] if isinstance(message, dict) else message
            return str(text).strip().splitlines()[0] or None
        except (KeyError, TypeError, IndexError):
            return None

    def raised_first(self, attempt: int, ranks: Iterable[int]) -> int | None:
        """Of ``ranks``, the one whose recorded exception came first, leaving out exceptions that
        only report another rank's failure (a lost peer, a collective it never joined). ``None``
        when no rank recorded one (a plain script without spread's runner or ``@record``)."""
        causes = []
        for rank in ranks:
            info = (self._record(attempt, rank) or {}).get("spread")
            if not isinstance(info, dict) or info.get("exception") in _CONSEQUENCES:
                continue
            if isinstance(raised_at := info.get("raised_at"), int | float):
                causes.append((float(raised_at), rank))
        return min(causes)[1] if causes else None

    def lost_a_peer(self, attempt: int, rank: int) -> bool:
        """Whether ``rank`` recorded an exception that only reports another rank's failure."""
        info = (self._record(attempt, rank) or {}).get("spread")
        return isinstance(info, dict) and info.get("exception") in _CONSEQUENCES

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class _Failure:
    """The first failing rank of an attempt: its global rank and how it failed."""

    rank: int
    returncode: int  # Popen's: -S when killed by signal S
    stopped_for: float | None = None  # seconds it stayed stopped, when that is why it failed
    regroup: bool = False  # no failure: machines wait to join (c10d), the ranks stop for a new round
    task: str = ""  # a parameter-server job's name of the process ("worker 1", "ps 0"); else its rank

    @property
    def who(self) -> str:
        return self.task or f"rank {self.rank}"

    @property
    def code(self) -> int:
        return 128 + signal.SIGSTOP if self.stopped_for is not None else exit_code(self.returncode)

    def describe(self) -> str:
        if self.regroup:
            return "machines wait to join the job"
        if self.stopped_for is not None:
            return f"{self.who} stayed stopped (SIGSTOP) for {self.stopped_for:.1f}s"
        return _describe(self.who, self.returncode)


@dataclass(frozen=True)
class _Launch:
    """What lives across attempts: the job token and id, the output relay, the error files."""

    config: LaunchConfig
    token: str
    run_id: str
    trap: _SignalTrap
    relay: OutputRelay
    errors: _ErrorFiles
    report: ReportFile
    elastic: ElasticRendezvous | None
    launcher_id: int = 0  # --recover on several machines: the id of this machine's report (0: none)


class _Attempt:
    """One launch of all local ranks: spawn, watch, stop. Never reused."""

    def __init__(self, launch: _Launch, number: int, round: Round | None = None):
        self.launch, self.config, self.number = launch, launch.config, number
        c = self.config
        self.round = round  # this node's place when the rendezvous numbers the nodes (c10d)
        self.node_rank = round.group_rank if round else c.node_rank
        self.nnodes = round.nnodes if round else c.nnodes
        self.world_size = round.world_size if round else c.world_size
        self.rank_offset = round.rank_offset if round else c.node_rank * c.nproc
        self.restart_count = round.attempt if round else number  # alike on every node of the job
        self.next_waiting_check = time.monotonic() + _WAITING_EVERY
        self.trap, self.relay, self.events = launch.trap, launch.relay, launch.trap.events
        self.procs: list[subprocess.Popen] = []
        self.returncodes: dict[int, int] = {}
        self.threads: list[threading.Thread] = []
        self.tf_config: dict[str, list[str]] | None = None
        self.stopped_since: dict[int, float] = {}
        self.lost: dict[int, int] = {}  # --recover: local rank -> return code of each rank lost
        self.store_address: tuple[str, int] | None = None  # once the ranks are told where it is
        self.reporting: threading.Thread | None = None  # a report of where each rank is, under way
        self.admitting: threading.Thread | None = None  # --recover: a round that lets machines join
        self.addresses: tuple[str, int] | None = None  # MASTER_ADDR and MASTER_PORT given to the ranks
        self.replacements: dict[int, int] = {}  # --recover, --ps: local rank -> times started again
        self.retired: list[int] = []  # process groups of lost servers (their helpers die with them)
        self.reporter: _MachineReporter | None = None  # --recover on several machines

    def rank(self, local_rank: int) -> int:
        return self.rank_offset + local_rank

    def task(self, local_rank: int) -> str:
        """How the launcher's notes name a process: its task in a parameter-server job ("worker 1"),
        whose scripts and logs know it by that name, not by its launch order; else ""."""
        if not self.config.ps:
            return ""
        role, index = self.config.ps_tasks()[local_rank]
        return f"{role} {index}"

    def _failure(self, local_rank: int, returncode: int, **how: Any) -> _Failure:
        return _Failure(self.rank(local_rank), returncode, task=self.task(local_rank), **how)

    def _is_service(self, local_rank: int) -> bool:
        return bool(self.config.ps) and self.config.ps_tasks()[local_rank][0] in _SERVICE_ROLES

    def _env(self, local_rank: int, addr: str, port: int) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        for name in _INHERITED_NOISE:
            env.pop(name, None)
        rank = self.rank(local_rank)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(c.nproc),
            GROUP_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.nnodes),
            ROLE_NAME=c.role,
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(self.world_size),
            NODE_RANK=str(self.node_rank),
            NNODES=str(self.nnodes),
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT=str(self.restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(c.max_restarts),
            TORCHELASTIC_RUN_ID=self.launch.run_id,
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_SIGNALS_TO_HANDLE=",".join(s.name for s in _STOP_SIGNALS),
            TORCHELASTIC_ERROR_FILE=str(self.launch.errors.path(self.number, rank)),
            **{spread_env.RESTART_COUNT: str(self.restart_count), spread_env.LAUNCHER: "1"},
            **({spread_env.RECOVER: "1"} if c.recover else {}),
            **({spread_env.JOIN: "1"} if self.round is not None and self.round.join else {}),
            PYTHONUNBUFFERED="1",
        )
        env.pop(spread_env.LAUNCHER_ID, None)  # an outer launcher's: never read as this one's
        if self.reporter is not None:
            env[spread_env.LAUNCHER_ID] = str(self.launch.launcher_id)
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        env[TOKEN_ENV] = self.launch.token
        if self.relay.live:  # the ranks' stdout is a pipe; tell them a person watches, and how wide
            env[spread_env.STDOUT_TTY] = "1"
            env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
        else:
            env.pop(spread_env.STDOUT_TTY, None)
        if not env.get("OMP_NUM_THREADS"):
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // c.nproc))
        allocator.tune_child_environment(env)
        if self.tf_config is not None:  # a parameter-server job: roles come from TF_CONFIG alone
            for name in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "GROUP_WORLD_SIZE",
                "ROLE_RANK",
                "ROLE_WORLD_SIZE",
                "NODE_RANK",
                "TORCHELASTIC_USE_AGENT_STORE",
            ):
                env.pop(name, None)
            role, index = c.ps_tasks()[local_rank]
            env["TF_CONFIG"] = json.dumps({"cluster": self.tf_config, "task": {"type": role, "index": index}})
        return env

    def run(self) -> _Failure | None:
        """Spawn every local rank, wait for all or the first failure, and stop whatever remains."""
        c = self.config
        store = (
            _StoreHost(c.master_addr or DEFAULT_MASTER_ADDR, c.master_port or 0)
            if self._hosts_store()
            else None
        )
        try:
            return self._run(store)
        finally:
            if self.reporter is not None:
                self.reporter.close()
            if store is not None:
                store.close()

    def _hosts_store(self) -> bool:
        return self.round is None and self.config.node_rank == 0 and not self.config.ps

    def _run(self, store: _StoreHost | None) -> _Failure | None:
        c = self.config
        addr, port = c.master_addr or DEFAULT_MASTER_ADDR, c.master_port or 0
        if self.round is not None:  # the store of the round's node 0 (torch's handler hosts it)
            addr, port = self.round.master_addr, self.round.master_port
        if store is not None:  # children connect to the numeric address it listens on
            addr, port = store.addr, store.port
        if c.ps:
            self.tf_config = _ps_cluster(c, addr)
        else:
            self.store_address = (addr, port)
        self.addresses = (addr, port)
        if self.launch.launcher_id and self.store_address is not None:
            self.reporter = _MachineReporter(
                self.store_address, self.restart_count, self.launch.launcher_id, self.launch.token
            )
        try:
            hook = die_with_parent_hook()
            for local_rank in range(c.nproc):
                if self.trap.signum is not None:
                    break
                self.procs.append(
                    subprocess.Popen(
                        c.command(),
                        env=self._env(local_rank, addr, port),
                        stdin=None if self.rank(local_rank) == 0 else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                        preexec_fn=hook,
                    )
                )
        except OSError:  # a rank could not start: the ones that did must not outlive this call
            for proc in self.procs:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
                proc.stdout.close()  # type: ignore[union-attr]
                proc.stderr.close()  # type: ignore[union-attr]
            raise
        # Threads start only after every fork: preexec_fn must not run while other threads hold locks.
        for local_rank, proc in enumerate(self.procs):
            rank = self.rank(local_rank)
            label: int | str = rank if not c.ps else " ".join(map(str, c.ps_tasks()[local_rank]))
            self.threads.append(self.relay.start(label, proc.stdout, proc.stderr))  # type: ignore[arg-type]
            threading.Thread(target=self._watch, args=(local_rank, proc), daemon=True).start()
        failure = self._wait()
        if self.admitting is not None:  # the round completes as soon as the waiting machines are in it
            self.admitting.join(timeout=_SHORT_ROUND)
        if failure is not None and failure.stopped_for is not None:  # the others wait for it: where?
            self._report_where(f"{failure.describe()}")
        running = len(self.procs) - len(self.returncodes)
        finished = failure is None and self.trap.signum is None
        if finished and running:  # a parameter-server job whose training tasks are all done
            self._stop(signal.SIGTERM, wait_first=True)
        else:
            self._stop(self.trap.signum or signal.SIGTERM)
        for thread in self.threads:
            thread.join(timeout=_RELAY_JOIN_TIMEOUT)
        if self.reporting is not None:  # bounded by the reader's timeout
            self.reporting.join()
        if failure is not None and failure.regroup:
            self.relay.note(f"machines wait to join the job: stopped {running} process(es) for a new round")
            return failure
        if failure is not None and failure.stopped_for is None:
            failure = self._root_cause(failure)
        if failure is not None:
            summary = self.launch.errors.summary(self.number, failure.rank)
            detail = f" ({_shortened(summary, failure.rank)})" if summary else ""
            others = running - (failure.stopped_for is not None)  # a stopped rank is still running
            self.relay.note(f"{failure.describe()}{detail}; stopped the other {others} process(es)")
        elif self.trap.signum is not None:
            name = signal.Signals(self.trap.signum).name
            self.relay.note(f"received {name}; forwarded it to {running} process(es) and stopped them")
        return failure

    def _root_cause(self, first: _Failure) -> _Failure:
        """The failure to report: the first rank to exit non-zero, unless another failed rank recorded
        an exception raised earlier that is not itself a consequence (rank 1 raises; rank 0 sees its
        peer gone and happens to exit first). Such a rank exits 1, as python does on an exception,
        unless it exited by itself with another code before it was stopped."""
        if not self.launch.errors.lost_a_peer(self.number, first.rank):
            return first  # killed by a signal, or its own exception: it is the cause
        failed = {self.rank(r): code for r, code in self.returncodes.items() if code != 0}
        cause = self.launch.errors.raised_first(self.number, failed)
        if cause is None or cause == first.rank:
            return first
        return _Failure(cause, failed[cause] if failed[cause] > 0 else 1)

    def _watch(self, local_rank: int, proc: subprocess.Popen) -> None:
        self.events.put(("exit", self.number, local_rank, proc.wait()))

    def _take(self, timeout: float | None) -> bool:
        """Handle one event; returns True for a signal (a request to stop now)."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return False
        if event[0] == "signal":
            if self.reporter is not None:  # this machine goes away: its ranks will not regroup
                self.reporter.tell(leaving=True)
            return True
        if event[0] == "where":
            self._start_report()
            return False
        _, number, local_rank, returncode = event
        if number == self.number:
            self.returncodes[local_rank] = returncode
            if self.reporter is not None:  # its process group: the rank's own pid under spread run
                self.reporter.tell(exited=self.procs[local_rank].pid)
        return False

    def _start_report(self) -> None:
        """Report where each rank is, in the background (the ranks keep running and being watched)."""
        if self.reporting is not None and self.reporting.is_alive():
            return  # one report at a time: a second SIGUSR1 during one is answered by it
        self.reporting = threading.Thread(target=self._report_where, args=("asked by SIGUSR1",), daemon=True)
        self.reporting.start()

    def _report_where(self, reason: str) -> None:
        """Print where each rank is (read from the store, never through a collective) and keep it in
        the launcher's report file for ``spread run --dump``."""
        if not self.config.where_command:
            return
        if self.store_address is None:
            lines = ["no report: a parameter-server job keeps no flight records"]
        else:
            address, number, world = self.store_address, self.restart_count, self.world_size
            lines = read_where(self.config.where_command, address, number, world, self.launch.token)
        stamp = time.strftime("%H:%M:%S")
        self.relay.note(f"where each rank is at {stamp} ({reason}):")
        for line in lines:
            self.relay.note(f"  {line}")
        try:
            self.launch.report.write([f"where each rank is at {stamp} ({reason}):", *lines])
        except OSError as exc:
            self.relay.note(f"cannot write the report for spread run --dump: {exc}")

    def _nodes_waiting(self) -> bool:
        """Whether machines wait to join (c10d): torchrun's agents then start a new round, and so do we."""
        elastic = self.launch.elastic
        if elastic is None or time.monotonic() < self.next_waiting_check:
            return False
        if self.admitting is not None and self.admitting.is_alive():
            return False  # the agent is busy with that round
        self.next_waiting_check = time.monotonic() + _WAITING_EVERY
        try:
            return elastic.nodes_waiting() > 0
        except RendezvousFailed:
            return False  # the rendezvous' host is gone: the ranks will find out in their collectives

    def _stopped_rank(self) -> _Failure | None:
        """A rank that has been stopped (SIGSTOP, state ``T``) for ``_STOPPED_LIMIT`` seconds. Its peers
        would otherwise wait in their next collective for the whole collective timeout."""
        now = time.monotonic()
        for local_rank, proc in enumerate(self.procs):
            if local_rank in self.returncodes or process_state(proc.pid) != "T":
                self.stopped_since.pop(local_rank, None)
                continue
            since = self.stopped_since.setdefault(local_rank, now)
            if now - since >= _STOPPED_LIMIT:
                return self._failure(local_rank, -signal.SIGSTOP, stopped_for=now - since)
        return None

    def _wait(self) -> _Failure | None:
        """Until every rank exits, a rank fails, a stop signal arrives, or (parameter-server job) every
        training task has exited 0."""
        if self.trap.signum is not None:
            return None
        training = [r for r in range(len(self.procs)) if not self._is_service(r)]
        while len(self.returncodes) < len(self.procs):
            seen = set(self.returncodes)
            # A timeout, not a blocking get: a signal delivered to a relay thread only runs its Python
            # handler when the main thread next executes bytecode.
            if self._take(_TICK):
                return None
            for local_rank in sorted(self.returncodes.keys() - seen):
                if self.returncodes[local_rank] != 0:
                    if self._lost_server(local_rank):
                        if not self._replace_server(local_rank):
                            return self._failure(local_rank, self.returncodes[local_rank])
                        continue
                    if not self.config.recover or self.config.ps:
                        return self._failure(local_rank, self.returncodes[local_rank])
                    self._lose(local_rank)
            if (stopped := self._stopped_rank()) is not None:
                if not self.config.recover or (
                    self.config.ps and not self._lost_server(stopped.rank - self.rank_offset)
                ):
                    return stopped
                self._kill_stopped(stopped)
            if self.config.recover and not self.config.ps and len(self.returncodes) == len(self.procs):
                break
            if self._nodes_waiting():
                if not self.config.recover:
                    return _Failure(-1, 0, regroup=True)
                self._admit()
            if self.config.ps and all(self.returncodes.get(r) == 0 for r in training):
                return None
        if self.lost and not any(code == 0 for code in self.returncodes.values()):
            first = min(self.lost)  # every rank here was lost: nothing of the job survived on this node
            return self._failure(first, self.lost[first])
        return None

    def _lost_server(self, local_rank: int) -> bool:
        """Whether ``local_rank`` is a parameter server that ``--recover`` starts again when lost."""
        return self.config.recover and bool(self.config.ps) and self.config.ps_tasks()[local_rank][0] == "ps"

    def _replace_server(self, local_rank: int) -> bool:
        """``--recover``: start lost parameter server ``local_rank`` again at its address, the other
        tasks running on (its chief restores it; the training tasks wait for it). False when it was
        replaced ``_SERVER_REPLACEMENTS`` times already, or a stop signal came: the job fails."""
        assert self.addresses is not None and self.tf_config is not None
        code, index = self.returncodes[local_rank], self.config.ps_tasks()[local_rank][1]
        times = self.replacements.get(local_rank, 0)
        lost = f"{_describe(self.task(local_rank), code)}: parameter server {index} was lost"
        if times >= _SERVER_REPLACEMENTS or self.trap.signum is not None:
            self.relay.note(f"{lost}; it was started again {times} time(s) already: giving up")
            return False
        old = self.procs[local_rank]
        signal_group(old.pid, signal.SIGKILL)  # anything it started goes with it
        self.retired.append(old.pid)
        env = self._env(local_rank, *self.addresses)
        env[spread_env.PS_REPLACEMENT] = str(times + 1)
        proc = subprocess.Popen(  # threads run here: the preexec hook only calls prctl and getppid
            self.config.command(),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent_hook(),
        )
        self.replacements[local_rank] = times + 1
        self.procs[local_rank] = proc
        del self.returncodes[local_rank]
        self.stopped_since.pop(local_rank, None)
        self.threads.append(self.relay.start(f"ps {index}", proc.stdout, proc.stderr))  # type: ignore[arg-type]
        threading.Thread(target=self._watch, args=(local_rank, proc), daemon=True).start()
        address = self.tf_config["ps"][index]
        self.relay.note(
            f"{lost}; --recover: started it again at {address} (time {times + 1}); the chief restores it "
            "from its last backup while the training tasks wait"
        )
        return True

    def _admit(self) -> None:
        """``--recover``: machines wait to join. Join their round with this node's ranks training on
        (in the background: the ranks are still watched); the new machines' ranks then join these at
        a step boundary, with the state streamed from them (``SPREAD_JOIN``)."""
        elastic, round = self.launch.elastic, self.round
        assert elastic is not None and round is not None and self.store_address is not None
        addr, port = self.store_address
        live = {"attempt": self.restart_count, "addr": addr, "port": port}

        def join_round() -> None:
            try:
                joined = elastic.next_round(lambda: self.trap.signum is not None, live=live)
            except (RendezvousFailed, InterruptedError) as exc:
                self.relay.note(f"machines waited to join, but their round failed: {exc}")
                return
            self.relay.note(
                f"round {joined.attempt}: {joined.nnodes} machine(s); the ranks here train on and admit "
                f"the machines that join at their next step boundary (--recover)"
            )

        self.relay.note("machines wait to join the job; --recover: the ranks here train on while they join")
        self.admitting = threading.Thread(target=join_round, daemon=True)
        self.admitting.start()

    def _lose(self, local_rank: int) -> None:
        """``--recover``: a rank exited non-zero; the others train on without it (they regroup)."""
        code = self.returncodes[local_rank]
        self.lost[local_rank] = code
        self.stopped_since.pop(local_rank, None)
        left = self.world_size - len(self.lost)
        running = len(self.procs) - len(self.returncodes)
        lost = f"{_describe(f'rank {self.rank(local_rank)}', code)}: rank {self.rank(local_rank)} was lost"
        if running:
            lost += f"; --recover: the job continues without it at world size {left}"
        self.relay.note(lost)

    def _kill_stopped(self, stopped: _Failure) -> None:
        """``--recover``: a rank left stopped holds its peers up until their collective timeout; kill
        it, so that they regroup without it at once (its exit is then a loss like any other)."""
        local_rank = stopped.rank - self.rank_offset
        then = "it is started again" if self._lost_server(local_rank) else "the others regroup without it"
        self.relay.note(f"{stopped.describe()}; --recover: killing it so {then}")
        self.stopped_since.pop(local_rank, None)
        signal_group(self.procs[local_rank].pid, signal.SIGKILL)
        signal_group(self.procs[local_rank].pid, signal.SIGCONT)

    def _stop(self, signum: int, *, wait_first: bool = False) -> None:
        """Send ``signum`` to every rank's process group (SIGCONT too, so a stopped rank receives it),
        SIGKILL what is left after the grace, and reap the ranks.

        With ``wait_first`` the ranks get the grace to exit on their own before the signal (servers of
        a finished parameter-server job, which the chief normally stops itself). Groups of ranks that
        already exited are signalled too: their grandchildren live there. A stop signal during the
        grace skips the rest of it.
        """
        pgids = [p.pid for p in self.procs] + self.retired
        grace = self.config.kill_grace
        if wait_first:
            if self._wait_for_groups(pgids, grace):
                return self._reap()
            left = [self.config.ps_tasks()[r][0] for r in range(len(self.procs)) if r not in self.returncodes]
            self.relay.note(
                f"every training task finished; stopping {len(left)} task(s) still running "
                f"({', '.join(left)}) after {grace:g}s"
            )
        live = [g for g in pgids if group_alive(g)]
        if live:
            if self.returncodes.keys() >= set(range(len(self.procs))) and self.trap.signum is None:
                self.relay.note(f"stopping {len(live)} process group(s) left behind by ranks that exited")
            for pgid in live:
                signal_group(pgid, signum)
                signal_group(pgid, signal.SIGCONT)
            self._wait_for_groups(live, grace)
            for pgid in live:
                signal_group(pgid, signal.SIGKILL)
        self._reap()

    def _wait_for_groups(self, pgids: list[int], seconds: float) -> bool:
        """Wait up to ``seconds`` for every group to be gone; False when a stop signal cut it short or
        some group is still alive."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if self._take(min(remaining, 0.05)):
                return False
            if not any(group_alive(g) for g in pgids):
                return True
        return not any(group_alive(g) for g in pgids)

    def _reap(self) -> None:
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
    if config.no_python:
        if shutil.which(config.entrypoint) is None:
            raise FileNotFoundError(f"program not found: {config.entrypoint!r} (with --no-python)")
    elif not config.module and not os.path.isfile(config.entrypoint):
        raise FileNotFoundError(
            f"script not found: {config.entrypoint!r} (relative to {os.getcwd()}); "
            "to run a module instead, use `spread run -m NAME` (LaunchConfig(module=True) in Python)"
        )


def launch(config: LaunchConfig) -> int:
    """Run the job described by ``config`` on this node; return the exit code for ``spread run``.

    Blocks until every rank has exited. Returns 0 when all ranks of an attempt succeed (for a
    parameter-server job: the chief and every worker); otherwise, once restarts are spent, the first
    failing rank's exit code (``128 + S`` when killed by signal ``S``, 147 for a rank left stopped);
    ``128 + S`` when the launcher itself receives SIGINT, SIGTERM, SIGHUP or SIGQUIT (forwarded to the
    ranks, never restarted). Either way no rank, rank helper or store is left running.

    Raises:
        FileNotFoundError: the script does not exist (nothing was started).
        ValueError: a multi-node job without ``SPREAD_JOB_TOKEN`` in the environment.
        OSError: the rendezvous port cannot be bound, or a rank cannot be started (ranks already
            started are stopped first).
    """
    _check_entrypoint(config)
    run_id = config.run_id or str(uuid.uuid4())
    token = _job_token(config, run_id)
    relay = OutputRelay(prefix=config.prefix_output)
    if os.environ.get("TF_CONFIG", "").strip() and not config.ps:
        relay.note(
            "TF_CONFIG is set in this shell and is not passed to the ranks: spread run gives them their "
            "own cluster (RANK, WORLD_SIZE, MASTER_ADDR, ...); unset it to silence this note"
        )
    elastic = _start_rendezvous(config, run_id) if config.rdzv_backend == "c10d" else None
    failure: _Failure | None = None
    job_over = True  # whether to close the rendezvous when this machine's part ends
    try:
        with _SignalTrap(queue.SimpleQueue()) as trap:
            # Several machines under --recover: each reports its ranks' exits in the job store.
            launcher_id = secrets.randbelow(2**62) + 1 if config.recover and config.nnodes > 1 else 0
            job = _Launch(
                config, token, run_id, trap, relay, _ErrorFiles(), ReportFile(), elastic, launcher_id
            )
            try:
                failure = _attempts(job)
            finally:
                job.errors.close()
                job.report.remove()
            # A machine preempted (a stop signal), or under --recover lost, leaves the job to the
            # others: closing the rendezvous would stop every machine that comes later from joining
            # (as torchrun's agent, which leaves it open when it ends by a signal).
            job_over = trap.signum is None and (failure is None or not config.recover)
            if trap.signum is not None:
                return 128 + trap.signum
            return failure.code if failure is not None else 0
    finally:
        if elastic is not None:
            if job_over:
                elastic.shutdown()  # the job is over here: machines that come later are told so
            elastic.close()


def _start_rendezvous(config: LaunchConfig, run_id: str) -> ElasticRendezvous:
    assert config.master_addr is not None and config.master_port is not None and config.min_nodes is not None
    return ElasticRendezvous(
        endpoint=f"{config.master_addr}:{config.master_port}",
        run_id=run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.nnodes,
        nproc=config.nproc,
        local_addr=config.local_addr or facing_address(config.master_addr),
        conf=dict(config.rdzv_conf),
    )


def _attempts(job: _Launch) -> _Failure | None:
    """Run attempts until one succeeds, restarts are spent, or a stop signal: the last failure. A new
    round because machines wait to join (c10d) spends no restart, as under torchrun."""
    config, relay, trap = job.config, job.relay, job.trap
    restarts, number = 0, 0
    failure: _Failure | None = None
    while trap.signum is None:
        round = None
        if job.elastic is not None:
            try:
                round = job.elastic.next_round(lambda: trap.signum is not None)
            except InterruptedError:
                break
            except RendezvousFailed as exc:
                where = f"{config.master_addr}:{config.master_port}"
                closed = "RendezvousClosedError" in str(exc)  # the job ended on the other machines
                if restarts < config.max_restarts and not closed:  # a machine left mid-round: go on
                    restarts += 1
                    relay.note(f"the round at {where} failed ({exc}); joining the next one")
                    continue
                relay.note(f"the rendezvous at {where} failed: {exc}")
                return failure if failure is not None and not failure.regroup else _Failure(-1, 1)
            if round.join and not config.recover:
                relay.note(
                    "the job's ranks train on under spread run --recover (recovery without restart): start "
                    "this machine with --recover too, to join them"
                )
                return _Failure(-1, 1)
            last = round.rank_offset + config.nproc - 1
            place = (
                f"its {config.nproc} process(es) join the running job at its next step boundary"
                if round.join
                else f"ranks {round.rank_offset}-{last} of {round.world_size}"
            )
            node = f"this machine is node {round.group_rank} of {round.nnodes}"
            relay.note(f"round {round.attempt}: {node}, {place}")
        failure = _Attempt(job, number, round).run()
        number += 1
        if trap.signum is not None or failure is None:
            break
        if failure.regroup:
            continue
        if restarts < config.max_restarts:
            restarts += 1
            attempts = config.max_restarts + 1
            relay.note(f"restarting (attempt {restarts + 1} of {attempts}) after {failure.describe()}")
            continue
        if config.max_restarts:
            relay.note(
                f"gave up after {config.max_restarts + 1} attempts; the last failure: {failure.describe()}"
            )
        break
    return failure
