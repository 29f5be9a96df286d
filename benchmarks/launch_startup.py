"""End-to-end wall time of a tiny 2-rank gloo job under torchrun and under ``spread run``.

What a user waits for between pressing Enter and getting the prompt back: launcher start-up,
rendezvous, one 4 MiB all-reduce, teardown. Both launchers run the same worker
(``_allreduce_worker.py``); runs alternate between the two so that machine noise hits both alike.
A second, optional pair runs an empty script, to show the launchers' own overhead without torch.

    python benchmarks/launch_startup.py              # 5 repetitions after 1 warm-up
    python benchmarks/launch_startup.py --reps 10 --empty
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def _time_once(command: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        output = f"{result.stdout}\n{result.stderr}"
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{output}")
    return elapsed


def _compare(worker: Path, nproc: int, reps: int) -> dict[str, list[float]]:
    commands = {
        "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), str(worker)],
        "spread run": [str(BIN / "spread"), "run", "-n", str(nproc), str(worker)],
    }
    for command in commands.values():  # warm-up: page cache, .pyc files
        _time_once(command)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(reps):
        for name, command in commands.items():
            times[name].append(_time_once(command))
    return times


def _report(title: str, times: dict[str, list[float]]) -> None:
    print(f"\n{title}")
    print(f"  {'launcher':<11} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, values in times.items():
        print(f"  {name:<11} {statistics.median(values):9.3f} {min(values):7.3f} {max(values):7.3f}")
    ratio = statistics.median(times["spread run"]) / statistics.median(times["torchrun"])
    print(f"  spread run / torchrun (median): {ratio:.2f}x")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per launcher (default 5)")
    parser.add_argument("-n", "--nproc", type=int, default=2, help="ranks per job (default 2)")
    parser.add_argument("--empty", action="store_true", help="also time an empty script (launcher overhead)")
    args = parser.parse_args()
    import torch  # only for the machine line

    print(
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpu(s), "
        f"python {platform.python_version()}, torch {torch.__version__}; reps={args.reps}, nproc={args.nproc}"
    )
    times = _compare(HERE / "_allreduce_worker.py", args.nproc, args.reps)
    _report("gloo init + all_reduce(torch.ones(2**20)) + destroy, end to end", times)
    if args.empty:
        with tempfile.TemporaryDirectory() as tmp:
            empty = Path(tmp) / "empty.py"
            empty.write_text("")
            _report("empty script (the launcher alone)", _compare(empty, args.nproc, args.reps))


if __name__ == "__main__":
    main()
