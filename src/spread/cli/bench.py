"""``spread bench``: every synchronous configuration side by side in one run, and the all-reduces.

Runs the scripts of the checkout's ``benchmarks/`` folder: one job per workload builds every
configuration once and measures them in interleaved rounds (the machine's drift then hits all
alike; see ``benchmarks/throughput.py``). Collects their JSON, prints the tables, and writes a
generated section of a dated ``docs/results/`` file and a PNG plot under ``docs/img/``. ``--calibrate``
measures this machine for ``spread plan`` instead. Torch is imported only by the jobs (and by
``--calibrate``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_DESCRIPTION = """\
Measure W1 (dense MLP) and W2 (small GPT) training throughput under: one process with 1 and 2
threads, MirroredStrategy with 2 replicas (every cross_device_ops), PyTorch DDP 2 x 1 thread and
MultiWorkerMirroredStrategy 2 x 1 thread with every communication algorithm, spread's
ShardedStrategy(shard="parameters") and PyTorch FSDP2 2 x 1 thread, and (W1, when
tensorflow is installed, not with --quick) TensorFlow's MultiWorkerMirroredStrategy 2 x 1 thread;
then the all-reduce microbenchmark (4 KB to 64 MB, every algorithm vs gloo's own). The
configurations of a workload take turns in interleaved rounds and the ratios are paired by round,
because this machine's speed drifts within minutes. Prints the tables and writes them, with the
command, machine line and a plot, into docs/results/<today>-spread-bench.md and docs/img/.
Timings are only comparable within one run on a quiet machine."""

_EPILOG = """\
examples:
  spread bench                               the full run (about 10 minutes on 2 cores)
  spread bench --quick --doc /tmp/b.md       tiny models, seconds: a smoke test of the tooling
  spread bench --workloads W1 --rounds 2     W1 only, fewer rounds
  spread bench --calibrate --output cal.json measure latency/bandwidth/compute for `spread plan`"""

DEFAULT_CALIBRATION = "spread-calibration.json"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``spread``'s subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="benchmark every strategy and all-reduce algorithm side by side",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="tiny models and sizes (smoke test)")
    parser.add_argument("--workloads", default=None, help="comma-separated: W1,W2 (default; --quick: W1)")
    parser.add_argument("--no-allreduce", action="store_true", help="skip the all-reduce microbenchmark")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds over all configurations (default 6)"
    )
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per round (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="steps per repetition (default 5, W2 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3, W2 2)")
    parser.add_argument(
        "--doc",
        default=None,
        help="markdown file for the generated section (default: docs/results/<today>-spread-bench.md; "
        "--quick writes none unless given)",
    )
    parser.add_argument(
        "--img-dir",
        default=None,
        help="folder for the plot (default: docs/img, or img/ beside a --doc given)",
    )
    parser.add_argument("--json", default=None, help="also write every raw result here")
    parser.add_argument("--benchmarks", default=None, help="the benchmarks/ folder (default: the checkout's)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per job before it is killed")
    parser.add_argument(
        "--calibrate", action="store_true", help="measure this machine for `spread plan` and write a profile"
    )
    parser.add_argument("--output", default=DEFAULT_CALIBRATION, help="where --calibrate writes the profile")
    parser.set_defaults(handler=run)
    return parser


def _benchmarks_dir(given: str | None) -> Path:
    candidates = (
        [Path(given)]
        if given
        else [
            Path(__file__).resolve().parents[3] / "benchmarks",  # src/spread/cli/bench.py -> checkout
            Path.cwd() / "benchmarks",
        ]
    )
    for folder in candidates:
        if (folder / "throughput.py").is_file() and (folder / "allreduce_bus.py").is_file():
            return folder
    raise SystemExit(
        "spread bench: cannot find the benchmarks/ folder (throughput.py, allreduce_bus.py) of a spread "
        "checkout; run from the checkout or pass --benchmarks DIR"
    )


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        import psutil

        memory = psutil.virtual_memory().total
    except ImportError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def _machine_line(machine: dict[str, Any], torch_version: str) -> str:
    memory = f", {machine['memory_bytes'] / 2**30:.0f} GiB" if machine.get("memory_bytes") else ""
    return (
        f"{machine['cpu']}, {machine['cores']} cores{memory}, {machine['system']}; "
        f"Python {machine['python']}, torch {torch_version}"
    )


def _job(script: Path, args: list[str], timeout: float) -> dict[str, Any]:
    """Run one benchmark script with ``--json`` and return its result."""
    with tempfile.TemporaryDirectory(prefix="spread-bench-") as folder:
        out = os.path.join(folder, "result.json")
        cmd = [sys.executable, str(script), *args, "--json", out]
        print(f"spread bench: {shlex.join([Path(cmd[1]).name, *cmd[2:-2]])}", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"spread bench: {script.name} {' '.join(args)} ran past {timeout:.0f} s"
            ) from None
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
            raise SystemExit(
                f"spread bench: {script.name} {' '.join(args)} failed ({proc.returncode}):\n{tail}"
            )
        return json.loads(Path(out).read_text())


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    from spread.cli import _bench_report as report

    folder = _benchmarks_dir(args.benchmarks)
    workloads = [w.strip().upper() for w in (args.workloads or ("W1" if args.quick else "W1,W2")).split(",")]
    unknown = [w for w in workloads if w not in ("W1", "W2")]
    if unknown:
        raise SystemExit(f"spread bench: unknown workload(s) {unknown}; choose from W1, W2")
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_start": _load(),
        "throughput": {},
    }
    for name in workloads:
        w2 = name == "W2"
        rounds = args.rounds or (1 if args.quick else 6)
        reps = args.reps or 1  # one repetition per turn: the finest interleaving, the fairest pairs
        steps = args.steps or (1 if args.quick else 3 if w2 else 5)
        warmup = args.warmup or (1 if args.quick else 2 if w2 else 3)
        common = ["--workload", name, "--rounds", str(rounds), "--reps", str(reps)]
        common += ["--steps", str(steps), "--warmup", str(warmup)] + (["--quick"] if args.quick else [])
        merged = _job(folder / "throughput.py", [*common, "--job", "all"], args.timeout)
        merged["description"] = (
            f"{merged.get('description', name)}; {rounds} interleaved rounds x {reps} reps x {steps} "
            f"steps, after {warmup} warm-up"
        )
        results["throughput"][name] = merged
        print(f"\n{merged['description']}\n{report.throughput_table(merged)}", flush=True)
        versus = report.sharded_vs_fsdp2(merged)
        if versus:
            print(versus, flush=True)
    if not args.no_allreduce:
        ar_args = ["--quick"] if args.quick else ["--reps", str(args.reps or 7)]
        results["allreduce"] = _job(folder / "allreduce_bus.py", ar_args, args.timeout)
        print(f"\nall-reduce bus bandwidth\n{report.allreduce_table(results['allreduce'])}", flush=True)
    results["load_end"] = _load()
    first_throughput: dict[str, Any] = next(iter(results["throughput"].values()), {})
    results["torch"] = first_throughput.get("torch", "?")
    machine = _machine()
    results["machine"] = machine
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    docs = folder.parent / "docs"
    dated = docs / "results" / f"{datetime.date.today().isoformat()}-spread-bench.md"
    doc = Path(args.doc) if args.doc else None if args.quick else dated
    if doc is not None:
        img_dir = Path(args.img_dir) if args.img_dir else docs / "img" if doc == dated else doc.parent / "img"
        image = img_dir / "bench.png"
        drawn = report.plot(results, image)
        if not drawn:
            print(
                "spread bench: matplotlib is not installed (pip install spread[bench]); no plot",
                file=sys.stderr,
            )
        command = "spread bench" + (" " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "")
        section = report.report(
            results,
            command=command,
            machine=_machine_line(machine, results["torch"]),
            image=os.path.relpath(image, doc.parent) if drawn else None,
        )
        report.write_section(doc, section)
        print(f"\nspread bench: wrote {doc}" + (f" and {image}" if drawn else ""), flush=True)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Measure this machine for ``spread plan`` (:func:`spread.plan.calibration.calibrate`)."""
    from spread.plan.calibration import CalibrationError, calibrate

    try:
        calibrate(args.output, quick=args.quick)
    except CalibrationError as exc:
        print(f"spread bench: {exc}", file=sys.stderr)
        return 2
    print(f"spread bench: wrote calibration profile {args.output}")
    return 0
