"""Goodput under node failures (issue 36): 2 "nodes" x 2 ranks of W1 on this machine, the non-host
node SIGKILLed every ``--kill-every`` seconds and started again ``--back-after`` seconds later, until
a fixed number of steps is done; spread against torchrun and torchft in one invocation.

    flock /tmp/spread-bench.lock python benchmarks/goodput.py [--modes spread-restart,torchft-ddp]
        [--steps 960] [--kill-every 60] [--back-after 20] [--save-every 20] [--json out.json]

Goodput = useful steps per second with failures / steps per second of the same mode without them,
where useful steps per second = ``--steps`` / wall time from launch to the last step's weights; work
trained again after a restart is not useful. Each mode runs twice: uninterrupted (its steps per
second without failures, and its reference weights), then with the failure injector; the table gives
both rates, the goodput, the kills, and the largest difference between the final weights of the two
runs (and between this mode's uninterrupted weights and the first mode's: every mode trains the
same steps on the same data, ``_goodput_workload.py``).

A node is one process tree: its launcher (``spread run``, torchrun) or its torchft replica groups,
pinned to its own share of the CPUs (``--cores-per-node``; on one machine two nodes would otherwise
share every core, and a node's loss would not cost its compute). Node 0 hosts the rendezvous (or
torchft's lighthouse runs beside it) and is never killed. A run's clock stops when the final weights
are on disk (node 0 then has ``--exit-grace`` seconds to exit; how it ended is noted). Kills are
timed from the launch, or with ``--kill-clock first-step`` from the first trained step (short runs,
whose start-up would otherwise absorb the kills). Killing a node freezes its whole tree (SIGSTOP, so
nothing forks meanwhile), then SIGKILLs every process in it, as a machine that loses power:
torchrun's workers run in sessions of their own, so a process-group kill would leave them training.

Every process this harness starts ends with it, also on Ctrl-C, SIGTERM, an exception or a run past
``--timeout``: it is the subreaper of everything it starts (orphans stay its descendants) and kills
what is left of each run's trees, then checks that none remain.

Modes are entries of ``MODES``: a name, a title, the command of each node (and of a service that
lives beside node 0, such as torchft's lighthouse), an optional pattern counting node 0's restarts,
the module it needs and extra environment. Adding spread's recovery without restart is one more entry.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import psutil

HERE = Path(__file__).resolve().parent
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_KILL_WAIT = 10.0  # seconds for a killed tree's processes to be gone


# -- the job every mode runs ---------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One run of one mode: where it writes, and the workload's size."""

    python: str  # the interpreter of the mode's processes
    run_dir: Path
    port: int  # the rendezvous endpoint's (or the lighthouse's) port on 127.0.0.1
    steps: int
    batches: int
    save_every: int
    nproc: int  # processes per node
    nodes: int
    last_call: float  # seconds a rendezvous waits for more nodes once it has enough
    quick: bool

    @property
    def weights(self) -> Path:
        return self.run_dir / "weights.pt"

    @property
    def started(self) -> Path:
        return self.run_dir / "started"

    @property
    def backup_dir(self) -> Path:
        return self.run_dir / "backup"

    def script_args(self) -> list[str]:
        args = ["--steps", str(self.steps), "--batches", str(self.batches)]
        args += ["--save-every", str(self.save_every), "--backup-dir", str(self.backup_dir)]
        args += ["--out", str(self.weights), "--started", str(self.started)]
        return args + (["--quick"] if self.quick else [])


@dataclass(frozen=True)
class Mode:
    """How one framework runs the job: the commands of node ``i`` (0 hosts the rendezvous)."""

    name: str
    title: str
    node_commands: Callable[[Job, int], list[list[str]]]
    service: Callable[[Job], list[str]] | None = None  # lives beside node 0, started first
    restart_pattern: str | None = None  # a line of node 0's output per restart of its processes
    needs: str | None = None  # a module the mode's interpreter must import
    env: tuple[tuple[str, str], ...] = ()  # more environment for the mode's processes


def _spread_node(job: Job, node: int) -> list[list[str]]:
    conf = f"last_call_timeout={job.last_call:g},join_timeout=300,is_host={int(node == 0)}"
    command = [job.python, "-m", "spread.cli.main", "run", "-n", str(job.nproc)]
    command += ["--nnodes", f"1:{job.nodes}", "--rdzv-endpoint", f"127.0.0.1:{job.port}"]
    command += ["--rdzv-id", "goodput", "--rdzv-conf", conf, "--max-restarts", "1000"]
    return [[*command, str(HERE / "_goodput_spread.py"), *job.script_args()]]


def _spread_recover_node(job: Job, node: int) -> list[list[str]]:
    """As ``_spread_node``, and a lost node's peers regroup in memory instead of restarting."""
    (command,) = _spread_node(job, node)
    at = command.index("run") + 1
    return [[*command[:at], "--recover", *command[at:]]]


def _torchrun_node(job: Job, node: int) -> list[list[str]]:
    conf = f"last_call_timeout={job.last_call:g},join_timeout=300,is_host={int(node == 0)}"
    command = [job.python, "-m", "torch.distributed.run", "--nproc-per-node", str(job.nproc)]
    command += ["--nnodes", f"1:{job.nodes}", "--rdzv-backend", "c10d"]
    command += ["--rdzv-endpoint", f"127.0.0.1:{job.port}", "--rdzv-id", "goodput", "--rdzv-conf", conf]
    command += ["--max-restarts", "1000"]
    return [[*command, str(HERE / "_goodput_ddp.py"), *job.script_args()]]


def _torchft_node(job: Job, node: int) -> list[list[str]]:
    """One replica group per process (torchft's DDP), ``nproc`` of them on each node."""
    groups = job.nodes * job.nproc
    commands = []
    for local in range(job.nproc):
        command = [job.python, str(HERE / "_goodput_torchft.py"), "--group", str(node * job.nproc + local)]
        command += ["--groups", str(groups), "--lighthouse", f"http://127.0.0.1:{job.port}"]
        command += ["--steps", str(job.steps), "--batches", str(job.batches), "--out", str(job.weights)]
        command += ["--started", str(job.started), "--ready-dir", str(job.run_dir / "ready")]
        commands.append(command + (["--quick"] if job.quick else []))
    return commands


def _lighthouse(job: Job) -> list[str]:
    # torchft's README settings; min 1 replica group: the job goes on while any group is alive.
    code = (
        "import sys, time; from torchft._torchft import LighthouseServer; "
        f"server = LighthouseServer(bind='[::]:{job.port}', min_replicas=1, join_timeout_ms=10000, "
        "quorum_tick_ms=100); print('lighthouse', server.address(), flush=True); time.sleep(1e9)"
    )
    return [job.python, "-c", code]


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode(
            "spread-restart",
            "spread run --max-restarts + BackupAndRestore",
            _spread_node,
            restart_pattern=r"spread run: (restarting \(attempt|machines wait to join the job)",
        ),
        Mode(
            "spread-recover",
            "spread run --recover (survivors regroup in memory) + BackupAndRestore when a node returns",
            _spread_recover_node,
            restart_pattern=r"spread run: (restarting \(attempt|machines wait to join the job)",
        ),
        Mode(
            "torchrun-dcp",
            "torchrun --max-restarts, plain DDP + DCP",
            _torchrun_node,
            restart_pattern=r"\[default\] (Worker group FAILED|Detected \d+ new nodes)",
            # torch's opt-out of sharing the rendezvous store with the workers: with it (the default),
            # a node that joins a later round waits 60 s for a MASTER_ADDR the host never writes again
            # (dynamic_rendezvous.py keeps the first round's bootstrap info) and the job fails.
            env=(("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"),),
        ),
        Mode("torchft-ddp", "torchft DDP (lighthouse)", _torchft_node, service=_lighthouse, needs="torchft"),
    )
}


# -- processes: nodes as trees that die whole ------------------------------------------------------
@contextlib.contextmanager
def subreaper() -> Iterator[None]:
    """While inside, orphans of the trees this process starts stay its descendants (Linux), so none
    escapes cleanup; the previous setting is restored on the way out."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(previous), 0, 0, 0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: cleanup still kills every tree it knows
        yield
        return
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, previous.value, 0, 0, 0)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _in_session(session: int) -> list[psutil.Process]:
    """This process's descendants in ``session`` (a node's root starts one; torchrun's workers start
    their own, so they are found as descendants of the root's tree below)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(proc.pid) == session:
                found.append(proc)
    return found


def _reap_orphans() -> None:
    """Collect the exit status of orphans that came to this process (they would stay zombies)."""
    with contextlib.suppress(ChildProcessError):
        for proc in psutil.Process().children():
            with contextlib.suppress(ChildProcessError, psutil.Error):
                if proc.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(proc.pid, os.WNOHANG)


def kill_tree(root_pid: int) -> None:
    """Freeze the tree of ``root_pid`` and its session (nothing forks while stopped), then SIGKILL
    all of it; wait until it is gone. What the root left in its session is found even once the root
    has exited (its orphans are this process's descendants)."""
    seen: dict[int, psutil.Process] = {}
    while True:
        members = []
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(root_pid)
            members += [root, *root.children(recursive=True)]
        members += _in_session(root_pid)
        fresh = [p for p in members if p.pid not in seen and _alive(p)]
        if not fresh:
            break
        for proc in fresh:
            seen[proc.pid] = proc
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGSTOP)
            with contextlib.suppress(psutil.Error):  # descendants of this one, found before it stopped
                for child in proc.children(recursive=True):
                    seen.setdefault(child.pid, child)
                    with contextlib.suppress(psutil.Error):
                        child.send_signal(signal.SIGSTOP)
    for proc in seen.values():
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    _, left = psutil.wait_procs(list(seen.values()), timeout=_KILL_WAIT)
    _reap_orphans()
    if [p for p in left if _alive(p)]:
        raise RuntimeError(f"processes {[p.pid for p in left]} survived SIGKILL for {_KILL_WAIT:g}s")


class Node:
    """A "machine": its processes (each the root of a session), logged to one file, killed whole."""

    def __init__(self, name: str, commands: list[list[str]], env: dict[str, str], log: Path, cpus: set[int]):
        self.name, self.commands, self.env, self.log_path, self.cpus = name, commands, env, log, cpus
        self.procs: list[subprocess.Popen] = []
        self.starts = 0
        self._log: IO[str] | None = None

    def start(self) -> None:
        self.starts += 1
        self._log = self.log_path.open("a")
        self._log.write(f"\n=== {self.name}: start {self.starts} at {time.time():.3f}\n")
        self._log.flush()
        cpus = self.cpus
        preexec = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.procs = [
            subprocess.Popen(
                command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec,
                start_new_session=True,  # a session per root: what it starts can be found by it
            )
            for command in self.commands
        ]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        """As a machine that loses power: every process of the node, at once."""
        for proc in self.procs:
            kill_tree(proc.pid)
            proc.wait(timeout=_KILL_WAIT)
        if self._log is not None:
            self._log.write(f"=== {self.name}: killed at {time.time():.3f}\n")
            self._log.close()
            self._log = None

    def stop(self, grace: float) -> None:
        """The job is over: give the node ``grace`` seconds to exit by itself, then kill what is left."""
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.kill()


# -- one run ---------------------------------------------------------------------------------------
@dataclass
class RunResult:
    mode: str
    failures: bool
    ok: bool
    wall_s: float
    steps_per_s: float | None
    kills: int
    restarts: int | None
    exit_codes: list[int | None]
    log_dir: str
    error: str = ""
    exit_note: str = ""  # how node 0 ended after the final weights, when not with 0


@dataclass(frozen=True)
class Faults:
    kill_every: float
    back_after: float
    kills: int = 0  # stop injecting after this many (0: until the job is done)
    from_first_step: bool = False  # the kill clock starts at the first trained step, not at launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    """The user's environment without a job's rank variables, one thread per rank, a fresh job token
    (``spread run`` derives none from a file: nothing is written to the user's home)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "SPREAD_JOB_TOKEN")
    env = {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith(("PET_", "TORCHELASTIC_"))
    }
    env.update(OMP_NUM_THREADS="1", SPREAD_COLLECTIVE_TIMEOUT="60", SPREAD_JOB_TOKEN=secrets.token_hex(32))
    env.setdefault("LOGLEVEL", "INFO")  # torchrun's agent says when it restarts its workers
    return env


def node_cpus(nodes: int, cores_per_node: int) -> list[set[int]]:
    """Each node's own CPUs (empty sets: unpinned), from the CPUs this process may use."""
    if cores_per_node <= 0:
        return [set() for _ in range(nodes)]
    available = sorted(os.sched_getaffinity(0))
    if cores_per_node * nodes > len(available):
        raise SystemExit(
            f"--cores-per-node {cores_per_node} x {nodes} nodes needs {cores_per_node * nodes} CPUs; "
            f"this process may use {len(available)} (give --cores-per-node 0 to share them)"
        )
    return [set(available[i * cores_per_node : (i + 1) * cores_per_node]) for i in range(nodes)]


def run_once(
    mode: Mode, job: Job, faults: Faults | None, cpus: list[set[int]], timeout: float, exit_grace: float
) -> RunResult:
    """Launch the mode's nodes and inject faults into the last one until the final weights appear:
    the run's wall time ends there (the last step is done). Node 0 then has ``exit_grace`` seconds to
    exit; how it ended is noted, not timed (torchrun's agents wait for each other at exit)."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    env = {**_child_env(), **dict(mode.env)}
    nodes = [
        Node(f"node{i}", mode.node_commands(job, i), env, job.run_dir / f"node{i}.log", cpus[i])
        for i in range(job.nodes)
    ]
    service = None
    if mode.service is not None:
        service = Node("service", [mode.service(job)], env, job.run_dir / "service.log", set())
    host, victim = nodes[0], nodes[-1]
    kills, start = 0, time.monotonic()
    wall: float | None = None
    error = exit_note = ""
    try:
        if service is not None:
            service.start()
            time.sleep(1.0)  # listening before the nodes look for it
        for node in nodes:  # the host first: its agent, the older process, is node 0 of every round
            node.start()
            time.sleep(0.3)
        timed_from_launch = faults is not None and not faults.from_first_step
        next_kill = start + faults.kill_every if faults and timed_from_launch else float("inf")
        back_at: float | None = None
        while wall is None:
            now = time.monotonic()
            if faults and next_kill == float("inf") and job.started.exists():  # --kill-clock first-step
                next_kill = now + faults.kill_every
            if job.weights.exists():
                wall = now - start
            elif not host.running():
                error = f"node 0 exited with {host.returncodes()} before the final weights"
                break
            elif now - start > timeout:
                error = f"timed out after {timeout:g}s"
                break
            elif faults and back_at is None and now >= next_kill and kills < (faults.kills or kills + 1):
                victim.kill()
                kills += 1
                back_at, next_kill = now + faults.back_after, next_kill + faults.kill_every
            elif back_at is not None and now >= back_at:
                victim.start()
                back_at = None
            time.sleep(0.05)
        if wall is not None:
            deadline = time.monotonic() + exit_grace
            while host.running() and time.monotonic() < deadline:
                time.sleep(0.1)
            if host.running():
                exit_note = f"node 0 still ran {exit_grace:g}s after the final weights (killed)"
            elif any(code != 0 for code in host.returncodes()):
                exit_note = f"node 0 exited with {host.returncodes()} after the final weights"
        codes = host.returncodes()
    finally:
        for node in (*nodes[1:], host):
            node.stop(grace=5.0 if wall is not None else 0.0)
        if service is not None:
            service.kill()
    restarts = None
    if mode.restart_pattern is not None:
        restarts = len(re.findall(mode.restart_pattern, host.log_path.read_text(errors="replace")))
    elapsed = wall if wall is not None else time.monotonic() - start
    return RunResult(
        mode.name, faults is not None, wall is not None, elapsed, job.steps / wall if wall else None,
        kills, restarts, codes, str(job.run_dir), error, exit_note,
    )  # fmt: skip


def max_abs_diff(a: Path, b: Path) -> float | None:
    """Largest difference between two weights files (``None`` when either is missing)."""
    if not (a.exists() and b.exists()):
        return None
    import torch

    left, right = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if left.keys() != right.keys():
        raise ValueError(f"{a} and {b} hold different tensors: {sorted(left)} vs {sorted(right)}")
    return max(float((left[k].double() - right[k].double()).abs().max()) for k in left)


# -- the table -------------------------------------------------------------------------------------
@dataclass
class Row:
    mode: str
    title: str
    clean: RunResult | None = None
    faulty: RunResult | None = None
    goodput: float | None = None
    weights_vs_uninterrupted: float | None = None  # this mode's faulty run vs its uninterrupted run
    uninterrupted_vs_reference: float | None = None  # this mode's uninterrupted run vs the first mode's
    skipped: str = ""


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rate(run: RunResult | None) -> str:
    if run is None:
        return "-"
    return _num(run.steps_per_s, ".2f") + ("" if run.ok else " (failed)")


def markdown(rows: list[Row], settings: dict[str, Any]) -> str:
    lines = [
        f"W1, {settings['nodes']} nodes x {settings['nproc']} processes, {settings['steps']} steps; "
        f"node {settings['nodes'] - 1} killed every {settings['kill_every']:g} s, back "
        f"{settings['back_after']:g} s later; {settings['cores_per_node']} core(s) per node; "
        f"load average at start {settings['load_at_start']:.1f}",
        "",
        "| mode | uninterrupted steps/s | with failures steps/s | goodput | kills | node-0 restarts "
        "| max abs diff of weights vs uninterrupted | uninterrupted vs first mode |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.skipped:
            lines.append(f"| {row.title} | skipped: {row.skipped} | | | | | | |")
            continue
        clean, faulty = row.clean, row.faulty
        cells = [
            row.title,
            _rate(clean),
            _rate(faulty),
            _num(row.goodput, ".3f"),
            str(faulty.kills if faulty else "-"),
            _num(faulty.restarts if faulty else None, "d"),
            _num(row.weights_vs_uninterrupted, ".2e"),
            _num(row.uninterrupted_vs_reference, ".2e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    for row in rows:
        for run in (row.clean, row.faulty):
            if run is not None and (run.error or run.exit_note):
                kind = "with failures" if run.failures else "uninterrupted"
                lines.append(f"\n{row.title}, {kind}: {run.error or run.exit_note} (logs: {run.log_dir})")
    return "\n".join(lines)


def _interpreter_for(mode: Mode, args: argparse.Namespace) -> tuple[str, str]:
    """(interpreter, reason the mode cannot run with it or '')."""
    python = args.torchft_python if mode.needs == "torchft" and args.torchft_python else sys.executable
    if mode.needs:
        probe = subprocess.run(
            [python, "-c", f"import {mode.needs}"], capture_output=True, text=True, timeout=120
        )
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["?"])[-1]
            return python, f"{mode.needs} does not import in {python}: {last}"
    return python, ""


def benchmark(args: argparse.Namespace, workdir: Path) -> list[Row]:
    cpus = node_cpus(2, args.cores_per_node)
    faults = Faults(args.kill_every, args.back_after, args.kills, args.kill_clock == "first-step")
    rows: list[Row] = []
    reference: Path | None = None
    for name in args.modes:
        mode = MODES[name]
        row = Row(mode.name, mode.title)
        rows.append(row)
        python, reason = _interpreter_for(mode, args)
        if reason:
            row.skipped = reason
            print(f"{mode.name}: skipped ({reason})", flush=True)
            continue
        runs: dict[bool, tuple[RunResult, Path]] = {}
        for with_faults in (False, True):
            job = Job(
                python=python,
                run_dir=workdir / f"{mode.name}-{'failures' if with_faults else 'uninterrupted'}",
                port=_free_port(),
                steps=args.steps,
                batches=args.batches,
                save_every=args.save_every,
                nproc=2,
                nodes=2,
                last_call=args.last_call,
                quick=args.quick,
            )
            print(f"{mode.name}: {'with failures' if with_faults else 'uninterrupted'} ...", flush=True)
            result = run_once(mode, job, faults if with_faults else None, cpus, args.timeout, args.exit_grace)
            print(f"  {'ok' if result.ok else 'FAILED: ' + result.error}, {result.wall_s:.1f} s", flush=True)
            runs[with_faults] = (result, job.weights)
        (row.clean, clean_weights), (row.faulty, faulty_weights) = runs[False], runs[True]
        if row.clean.steps_per_s and row.faulty.steps_per_s:
            row.goodput = row.faulty.steps_per_s / row.clean.steps_per_s
        row.weights_vs_uninterrupted = max_abs_diff(faulty_weights, clean_weights)
        if reference is None and row.clean.ok:
            reference = clean_weights
        elif reference is not None:
            row.uninterrupted_vs_reference = max_abs_diff(clean_weights, reference)
    return rows


def _check_no_descendants() -> None:
    left = [p for p in psutil.Process().children(recursive=True) if _alive(p)]
    if left:
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        raise RuntimeError(f"processes left behind (now killed): {[p.pid for p in left]}")


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` kills what it started."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=960, help="the fixed number of steps of every run")
    parser.add_argument("--batches", type=int, default=16, help="distinct global batches (steps cycle them)")
    parser.add_argument("--save-every", type=int, default=20, help="steps between backups/checkpoints")
    parser.add_argument(
        "--kill-every", type=float, default=60.0, help="seconds between kills of the last node"
    )
    parser.add_argument("--back-after", type=float, default=20.0, help="seconds until a killed node restarts")
    parser.add_argument(
        "--kill-clock",
        choices=("launch", "first-step"),
        default="launch",
        help="kills are timed from the launch, or from the first trained step (short runs, tests)",
    )
    parser.add_argument("--kills", type=int, default=0, help="at most this many kills (0: no limit)")
    parser.add_argument("--last-call", type=float, default=2.0, help="rendezvous last_call_timeout, seconds")
    parser.add_argument("--cores-per-node", type=int, default=max(1, len(os.sched_getaffinity(0)) // 2))
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    parser.add_argument("--exit-grace", type=float, default=60.0, help="seconds node 0 may take to exit")
    parser.add_argument(
        "--torchft-python", default="", help="an interpreter with torchft (default: this one)"
    )
    parser.add_argument("--quick", action="store_true", help="W1 shrunk to a few thousand parameters (tests)")
    parser.add_argument(
        "--workdir", default="", help="keep logs, backups and weights here (default: temporary)"
    )
    parser.add_argument("--json", default="", help="write the rows and settings here")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        parser.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    if args.steps < 1 or args.batches < 1 or args.steps % args.batches:
        parser.error(f"--steps {args.steps} must be a positive multiple of --batches {args.batches}")
    if args.save_every < 1:
        parser.error("--save-every must be >= 1")
    if not (args.kill_every > 0 and 0 < args.back_after < args.kill_every):
        parser.error("need --kill-every > --back-after > 0")
    if args.kills < 0:
        parser.error("--kills must be >= 0")
    if args.timeout <= 0 or args.exit_grace < 0:
        parser.error("--timeout must be > 0 and --exit-grace >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = {
        "steps": args.steps, "batches": args.batches, "save_every": args.save_every, "nodes": 2, "nproc": 2,
        "kill_every": args.kill_every, "back_after": args.back_after, "kills": args.kills,
        "kill_clock": args.kill_clock,
        "last_call": args.last_call,
        "cores_per_node": args.cores_per_node, "quick": args.quick, "load_at_start": os.getloadavg()[0],
        "cpus": len(os.sched_getaffinity(0)), "python": sys.executable,
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_exit())
        stack.enter_context(subreaper())
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="goodput-")))
        try:
            rows = benchmark(args, workdir)
        finally:
            _check_no_descendants()
    table = markdown(rows, settings)
    print(table)
    out = {"settings": settings, "rows": [asdict(r) for r in rows], "markdown": table}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
