"""``spread run``: start N processes of a training script on this machine, wired for spread.

Parses the command line into a :class:`~spread.cluster.launcher.LaunchConfig` and hands it to
:func:`~spread.cluster.launcher.launch`; all process management lives there (and is usable from
Python). The launcher is imported only when the command runs, so ``spread --help`` stays instant.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any

from spread import env

_DESCRIPTION = """\
Start N local processes ("ranks") of a Python script with torchrun's environment, so that any script
written for torchrun runs unchanged (and spread's strategies find their cluster):

  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (= NODE_RANK), GROUP_WORLD_SIZE (= NNODES),
  ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT
  (= SPREAD_RESTART_COUNT), TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
  TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_ERROR_FILE, SPREAD_JOB_TOKEN, SPREAD_LAUNCHER=1,
  PYTHONUNBUFFERED=1, OMP_NUM_THREADS (cores / N, unless already set).

On node 0 spread run hosts the rendezvous store (a torch.distributed TCPStore, on a port it binds
itself: a free one unless --master-port, on loopback unless --master-addr); every rank's
init_process_group connects to it, as under torchrun. Each rank's output is copied here, prefixed
with "[rank R] ". When a rank fails (or stays stopped by SIGSTOP for 3 s), the others are stopped
(SIGTERM, then SIGKILL after --kill-grace seconds, their child processes included) and spread run
exits with the failing rank's code. Ctrl-C (SIGINT), SIGTERM and SIGHUP are forwarded to every rank,
as a terminal delivers Ctrl-C to torchrun's ranks; what is left after --kill-grace is killed."""

_EPILOG = """\
examples:
  spread run -n 4 train.py --epochs 3
      4 ranks of train.py on this machine; arguments after the script go to the script
  spread run -n 2 -m mypkg.train
      run a module (python -m mypkg.train) instead of a script file
  spread run -n 4 --max-restarts 2 train.py
      relaunch all ranks up to 2 times after a failure (resume from BackupAndRestore checkpoints)
  spread run -n 8 --nnodes 2:4 --rdzv-endpoint node0:29400 --rdzv-id job-17 train.py
      the same command on 2 to 4 machines (numbered by torch's elastic rendezvous at node0, which
      hosts it); the job token is derived from ~/.config/spread/secret (or SPREAD_JOB_TOKEN)
  spread run -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py
      machines numbered by hand instead (node 0 hosts the store)
  spread run --dump 12345
      print where each rank of the running job whose spread run has pid 12345 is
  spread run --workers 2 --ps 2 train_ps.py
      a parameter-server job: chief, 2 workers, 2 servers (TF_CONFIG per process, loopback ports)

  spread run --standalone --nproc_per_node=2 train.py
      torchrun's spellings work too (--nproc_per_node, --rdzv_endpoint, --max_restarts, ...)

exit status: 0 when every rank succeeds; the first failing rank's code (128+S if killed by signal
S; torchrun exits 1 for any failure); 130/143 on SIGINT/SIGTERM; 2 for usage errors."""


def _int_at_least(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def _nproc(text: str) -> int | str:
    """torchrun's ``--nproc-per-node``: a count, or ``cpu``, ``gpu``, ``auto`` (resolved at launch)."""
    if text in ("cpu", "gpu", "auto"):
        return text
    return _int_at_least(1)(text)


def _nnodes(text: str) -> tuple[int, int]:
    """``K``, or torchrun's elastic range ``MIN:MAX`` of machines."""
    low, sep, high = text.partition(":")
    low_count = _int_at_least(1)(low)
    high_count = _int_at_least(1)(high) if sep else low_count
    if high_count < low_count:
        raise argparse.ArgumentTypeError(f"the range {text} is empty: MIN must be <= MAX")
    return low_count, high_count


def _rdzv_conf(text: str) -> tuple[tuple[str, str], ...]:
    """torchrun's ``--rdzv-conf key=value,key=value``."""
    pairs = []
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected key=value pairs separated by commas, got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def _torchrun_env(name: str, default: str | None) -> str | None:
    """torchrun's default for an option: ``PET_<NAME>`` (Kubeflow's training operators set these in
    place of flags), else ``default``. argparse converts a string default with the option's type."""
    return os.environ.get(f"PET_{name}", default)


# Other launchers' spellings of spread run's options (torchrun's own are accepted as they are): a
# usage error names the option meant (spread/cli/_parser.py).
_MISSPELLINGS = dict.fromkeys(
    (
        "--nproc",  # argparse found it ambiguous between -n's two long spellings
        "--nprocs",
        "--np",
        "--nprocs-per-node",
        "--nprocs_per_node",
        "--num-processes",  # accelerate launch
        "--num_processes",
        "--num-proc",
        "--num_proc",
        "--nproc-per-host",
        "--processes",
    ),
    "-n",
)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``spread``'s subparsers.

    torchrun's spellings are accepted too (``--nproc_per_node=2``, ``--standalone``, ``--rdzv-*``),
    so a command copied from a tutorial works after ``s/torchrun/spread run/``.
    """
    parser = subparsers.add_parser(
        "run",
        help="start N processes of a training script on this machine (a drop-in for torchrun)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        misspellings=_MISSPELLINGS,
    )
    add = parser.add_argument
    add(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=_nproc,
        default=_torchrun_env("NPROC_PER_NODE", "1"),
        metavar="N",
        help="processes to start on this machine, or cpu (one per core), gpu (one per GPU), auto "
        "(gpu if there is one, else cpu) (default: 1)",
    )
    add(
        "--nnodes",
        type=_nnodes,
        default=_torchrun_env("NNODES", "1"),
        metavar="K|MIN:MAX",
        help="machines in the job (default: 1), or an elastic range: the job runs on any number of "
        "machines from MIN to MAX, numbered by torch's rendezvous at --rdzv-endpoint, and a machine "
        "that joins later starts a new round (as torchrun)",
    )
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=_int_at_least(0),
        default=_torchrun_env("NODE_RANK", None),
        metavar="I",
        help="this machine's index in [0, K), with a fixed K (default: 0; without it, a job on several "
        "machines is numbered by the rendezvous)",
    )
    add(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=_torchrun_env("MASTER_ADDR", None),
        metavar="ADDR",
        help="address of node 0's rendezvous store (default: 127.0.0.1; needed if --nnodes > 1)",
    )
    add(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=_port,
        default=_torchrun_env("MASTER_PORT", None),
        metavar="PORT",
        help="port of the rendezvous store (default: a free port; required with --nnodes > 1)",
    )
    add(
        "--standalone",
        action="store_true",
        help="torchrun's single-machine mode: the store on loopback at a free port (the default anyway)",
    )
    add(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="rdzv_endpoint",
        default=_torchrun_env("RDZV_ENDPOINT", None),
        metavar="HOST[:PORT]",
        help="the rendezvous of a job on several machines: torch's c10d store at HOST:PORT (PORT defaults "
        "to 29400), hosted by the machine at HOST; the same on every machine",
    )
    add(
        "--rdzv-conf",
        "--rdzv_conf",
        dest="rdzv_conf",
        type=_rdzv_conf,
        default=_torchrun_env("RDZV_CONF", ""),
        metavar="K=V,...",
        help="torch's rendezvous settings, as torchrun's (join_timeout=600, last_call_timeout=30, ...)",
    )
    add(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=_torchrun_env("LOCAL_ADDR", None),
        metavar="ADDR",
        help="the address other machines reach this one at (default: its address on the route to the "
        "rendezvous)",
    )
    add(
        "--rdzv-backend",
        "--rdzv_backend",
        dest="rdzv_backend",
        choices=("static", "c10d"),
        default=_torchrun_env("RDZV_BACKEND", None),
        help="c10d: machines numbered by torch's elastic rendezvous (the default for a job on several "
        "machines without --node-rank); static: by --node-rank, node 0 hosting the store",
    )
    add(
        "--rdzv-id",
        "--rdzv_id",
        "--run-id",
        "--run_id",
        dest="run_id",
        default=_torchrun_env("RDZV_ID", None),
        metavar="ID",
        help="the job's id, given to the ranks as TORCHELASTIC_RUN_ID (default: a fresh UUID)",
    )
    add(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=_int_at_least(0),
        default=_torchrun_env("MAX_RESTARTS", "0"),
        metavar="R",
        help="relaunch all ranks up to R times after a failure (default: 0)",
    )
    add(
        "--recover",
        action="store_true",
        help="recovery without restart: when a rank dies, is preempted or stays stopped, the others "
        "regroup at the next step boundary and train on at the smaller world size, with the same global "
        "batch (MultiWorkerMirroredStrategy and ShardedStrategy under Trainer.fit; a stopped rank is killed "
        "first); with --nnodes MIN:MAX a machine that comes back joins the running job at a step boundary. "
        "The job exits 0 when the survivors finish. With --ps: a lost parameter server is started again at "
        "its address and restored from the chief's last backup while the training tasks wait",
    )
    add(
        "--kill-grace",
        type=_seconds,
        default=10.0,
        metavar="S",
        help="seconds the ranks get to exit after a forwarded signal (Ctrl-C: SIGINT) or after another "
        "rank failed (SIGTERM), before SIGKILL (default: 10; a second Ctrl-C kills at once)",
    )
    add(
        "--workers",
        type=_int_at_least(0),
        default=0,
        metavar="W",
        help="with --ps: worker tasks beside the chief of a parameter-server job (default: 0)",
    )
    add(
        "--ps",
        type=_int_at_least(0),
        default=0,
        metavar="P",
        help="start a parameter-server job: 1 chief, W workers, P servers, each its own process with "
        "TF_CONFIG set (use with ParameterServerStrategy; -n is then ignored)",
    )
    add("--evaluator", action="store_true", help="with --ps: also start an evaluator task")
    add(
        "--role",
        default=_torchrun_env("ROLE", "default"),
        help="the ranks' role name (ROLE_NAME; default: default)",
    )
    add("--no-prefix", action="store_true", help='do not prefix output lines with "[rank R] "')
    add(
        "--trace",
        metavar="DIR",
        default=None,
        help="trace steps 2-4 of every Trainer.fit with torch.profiler: DIR/rank-<r>.json per rank, "
        "merged into DIR/timeline.json when the job ends (draw it: spread trace plot DIR)",
    )
    add("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m SCRIPT")
    add(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        help="SCRIPT is a program to run as it is, not a Python script",
    )
    add(
        "--dump",
        metavar="PID",
        type=_int_at_least(1),
        default=None,
        help="do not start a job: ask the running `spread run` PID where each of its ranks is (its "
        "collective, how long it has waited, its step and phase, who the others wait for) and print it; "
        "the same report appears in that job's output (sending it SIGUSR1 does the same)",
    )
    add("script", metavar="SCRIPT", nargs="?", help="the Python script to run (or module, with -m)")
    add("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments passed to the script")
    parser.set_defaults(handler=lambda args: run_command(args, parser))
    return parser


_FLAGS = {
    "nproc": "-n",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "max_restarts": "--max-restarts",
    "kill_grace": "--kill-grace",
    "recover": "--recover",
    "entrypoint": "SCRIPT",
    "workers": "--workers",
    "ps": "--ps",
}


def _as_flags(message: str) -> str:
    """Speak in flags: LaunchConfig names its fields, a command-line user typed flags."""
    for field, flag in _FLAGS.items():
        message = message.replace(f"`{field}`", flag).replace(f"{field}=", f"{flag} ")
    return message


def _resolve_nproc(value: int | str) -> int:
    """A count for ``cpu``/``gpu``/``auto``: GPUs are counted by torch in a child process, since the
    launcher itself never imports torch."""
    if isinstance(value, int):
        return value
    cpus = os.cpu_count() or 1
    if value == "cpu":
        return cpus
    result = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    gpus = int(result.stdout.strip() or 0) if result.returncode == 0 else 0
    if value == "gpu" and gpus == 0:
        raise ValueError("--nproc-per-node gpu: torch sees no CUDA device on this machine")
    return gpus or cpus


def _rendezvous_address(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """--master-addr/--master-port, or torchrun's --rdzv-endpoint HOST[:PORT] (one of the two)."""
    if args.rdzv_endpoint is None:
        return args.master_addr, args.master_port
    host, sep, port = args.rdzv_endpoint.rpartition(":")
    if not sep or "]" in port:  # no port given (an IPv6 literal's colons are inside brackets)
        host, port = args.rdzv_endpoint, "29400"
    endpoint = host.strip("[]") or None, _port(port)
    given = args.master_addr, args.master_port
    # Kubeflow's operators set PET_MASTER_ADDR/PORT beside PET_RDZV_ENDPOINT, not always alike (the
    # master's service name and port, the rendezvous host's): torchrun then uses the endpoint.
    from_environment = given == (os.environ.get("PET_MASTER_ADDR"), _environment_port("PET_MASTER_PORT"))
    if given != (None, None) and given != endpoint and not from_environment:
        raise ValueError("give either --rdzv-endpoint or --master-addr/--master-port, not both")
    return endpoint


def _environment_port(name: str) -> int | None:
    """The port in the environment variable ``name``, if it holds one."""
    try:
        return _port(os.environ[name])
    except (KeyError, ValueError, argparse.ArgumentTypeError):
        return None


def _rendezvous_backend(args: argparse.Namespace) -> str:
    """c10d (torch's elastic rendezvous numbers the machines) for an elastic range, or for several
    machines without --node-rank; static (--node-rank numbers them) otherwise, or when asked."""
    low, high = args.nnodes
    if high == 1:
        return "static"  # one machine: nothing to number
    if args.rdzv_backend not in (None, "static", "c10d"):  # only PET_RDZV_BACKEND gets past argparse
        raise ValueError(
            f"PET_RDZV_BACKEND={args.rdzv_backend} (from the environment): spread run's rendezvous is "
            "torch's c10d (or static, numbered by --node-rank); set PET_RDZV_BACKEND=c10d"
        )
    if args.rdzv_backend == "static":
        if low != high:
            raise ValueError(f"--nnodes {low}:{high} (an elastic range) needs --rdzv-backend c10d")
        if args.node_rank is None:
            raise ValueError("--rdzv-backend static with --nnodes > 1 needs --node-rank on every machine")
        return "static"
    if args.rdzv_backend == "c10d" or low != high or args.node_rank is None:
        return "c10d"
    return "static"


def _merge_traces(directory: str) -> None:
    """After the job: one timeline of the ranks' traces, if any rank wrote one."""
    from spread.train.timeline import merge_traces, rank_traces  # torch comes with it: after the job

    if os.path.isdir(directory) and rank_traces(directory):
        merged = merge_traces(directory)
        print(f"spread run: one timeline of all ranks in {merged} (spread trace plot {directory} draws it)")
    else:
        print(f"spread run: --trace {directory}: no rank traced a Trainer.fit", file=sys.stderr)


def _dump(pid: int) -> int:
    """``spread run --dump PID``: print where each rank of that job is."""
    from spread.cluster.where import ask_launcher

    try:
        lines = ask_launcher(pid)
    except (ProcessLookupError, TimeoutError, PermissionError) as exc:
        print(f"spread run: error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Build the launch configuration from parsed ``args`` and run it; returns the exit status."""
    from spread.cluster.launcher import LaunchConfig, launch

    if args.dump is not None:
        return _dump(args.dump)
    if args.script is None:
        parser.error("the following arguments are required: SCRIPT")
    try:
        if args.standalone and args.nnodes[1] != 1:
            raise ValueError("--standalone is a single-machine job: it cannot be combined with --nnodes > 1")
        master_addr, master_port = _rendezvous_address(args)
        backend = _rendezvous_backend(args)
        if backend == "c10d" and master_addr is None:
            raise ValueError(
                "a job on several machines numbered by the rendezvous needs --rdzv-endpoint HOST[:PORT], the "
                "same on every machine (the machine at HOST hosts it)"
            )
        min_nodes, nnodes = args.nnodes
        run_id = args.run_id
        if run_id is None and nnodes > 1:  # every machine must name the job alike (and derive its token)
            run_id = os.environ.get("SLURM_JOB_ID", "none")
        config = LaunchConfig(
            entrypoint=args.script,
            args=tuple(args.script_args),
            nproc=_resolve_nproc(args.nproc),
            nnodes=nnodes,
            min_nodes=min_nodes if backend == "c10d" else None,
            rdzv_backend=backend,
            rdzv_conf=args.rdzv_conf,
            local_addr=args.local_addr,
            node_rank=(args.node_rank or 0) if backend == "static" else 0,
            master_addr=master_addr,
            master_port=master_port,
            module=args.module,
            max_restarts=args.max_restarts,
            recover=args.recover,
            kill_grace=args.kill_grace,
            prefix_output=not args.no_prefix,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
            run_id=run_id,
            no_python=args.no_python,
            role=args.role,
            where_command=(sys.executable, "-m", "spread.cli._where"),
        )
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(_as_flags(str(exc)))
    if args.trace is not None:  # the ranks inherit it; Trainer.fit traces into it
        os.environ[env.TRACE_DIR] = os.path.abspath(args.trace)
    try:
        code = launch(config)
        if args.trace is not None:
            _merge_traces(args.trace)
        return code
    except (FileNotFoundError, ValueError) as exc:
        print(f"spread run: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"spread run: error: {exc}", file=sys.stderr)
        return 1
