"""``spread run``: start N processes of a training script on this machine, wired for spread.

Parses the command line into a :class:`~spread.cluster.launcher.LaunchConfig` and hands it to
:func:`~spread.cluster.launcher.launch`; all process management lives there (and is usable from
Python). The launcher is imported only when the command runs, so ``spread --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

_DESCRIPTION = """\
Start N local processes ("ranks") of a Python script, each with the environment spread's
strategies (and torch.distributed's env:// init) read:

  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK (= GROUP_RANK), NNODES,
  MASTER_ADDR, MASTER_PORT, SPREAD_JOB_TOKEN, SPREAD_RESTART_COUNT (= TORCHELASTIC_RESTART_COUNT),
  SPREAD_LAUNCHER=1, PYTHONUNBUFFERED=1, OMP_NUM_THREADS (cores / N, unless already set).

On node 0 the launcher itself binds the rendezvous port (a free one unless --master-port) on
MASTER_ADDR and hands the open socket to rank 0 (SPREAD_STORE_FD): no port race, and the store
listens on loopback by default. Each rank's output is copied here, prefixed with "[rank R] ".
When a rank fails, the others are stopped (SIGTERM, then SIGKILL after --kill-grace seconds,
their child processes included) and `spread run` exits with the failing rank's code. Ctrl-C or
SIGTERM stops every rank and exits with 130 or 143."""

_EPILOG = """\
examples:
  spread run -n 4 train.py --epochs 3
      4 ranks of train.py on this machine; arguments after the script go to the script
  spread run -n 2 -m mypkg.train
      run a module (python -m mypkg.train) instead of a script file
  spread run -n 4 --max-restarts 2 train.py
      relaunch all ranks up to 2 times after a failure (resume from BackupAndRestore checkpoints)
  export SPREAD_JOB_TOKEN=<same secret on every node>
  spread run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
  spread run -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py
      two machines, 16 ranks; start one command per machine
  spread run --workers 2 --ps 2 train_ps.py
      a parameter-server job: chief, 2 workers, 2 servers (TF_CONFIG per process, loopback ports)

exit status: 0 when every rank succeeds; the first failing rank's code (128+S if killed by signal
S); 130/143 on SIGINT/SIGTERM; 2 for usage errors."""


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


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` subcommand to ``spread``'s subparsers."""
    parser = subparsers.add_parser(
        "run",
        help="start N processes of a training script on this machine",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "-n",
        "--nproc-per-node",
        dest="nproc",
        type=_int_at_least(1),
        default=1,
        metavar="N",
        help="processes to start on this machine (default: 1)",
    )
    add(
        "--nnodes",
        type=_int_at_least(1),
        default=1,
        metavar="K",
        help="machines in the job (default: 1); WORLD_SIZE = N * K",
    )
    add(
        "--node-rank",
        type=_int_at_least(0),
        default=0,
        metavar="I",
        help="this machine's index in [0, K) (default: 0); RANK = I * N + LOCAL_RANK",
    )
    add(
        "--master-addr",
        default=None,
        metavar="ADDR",
        help="address of node 0's rendezvous store (default: 127.0.0.1; needed if --nnodes > 1)",
    )
    add(
        "--master-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="port of the rendezvous store (default: a free port; required with --nnodes > 1)",
    )
    add(
        "--max-restarts",
        type=_int_at_least(0),
        default=0,
        metavar="R",
        help="relaunch all ranks up to R times after a failure (default: 0)",
    )
    add(
        "--kill-grace",
        type=_seconds,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: 3)",
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
    add("--no-prefix", action="store_true", help='do not prefix output lines with "[rank R] "')
    add("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m SCRIPT")
    add("script", metavar="SCRIPT", help="the Python script to run (or module, with -m)")
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
    "entrypoint": "SCRIPT",
    "workers": "--workers",
    "ps": "--ps",
}


def _as_flags(message: str) -> str:
    """Speak in flags: LaunchConfig names its fields, a command-line user typed flags."""
    for field, flag in _FLAGS.items():
        message = message.replace(f"`{field}`", flag).replace(f"{field}=", f"{flag} ")
    return message


def run_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Build the launch configuration from parsed ``args`` and run it; returns the exit status."""
    from spread.cluster.launcher import LaunchConfig, launch

    try:
        config = LaunchConfig(
            entrypoint=args.script,
            args=tuple(args.script_args),
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            module=args.module,
            max_restarts=args.max_restarts,
            kill_grace=args.kill_grace,
            prefix_output=not args.no_prefix,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
        )
    except ValueError as exc:
        parser.error(_as_flags(str(exc)))
    try:
        return launch(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"spread run: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"spread run: error: {exc}", file=sys.stderr)
        return 1
