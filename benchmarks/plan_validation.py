"""Validate ``spread plan`` on this machine: predicted vs measured step time, and the recommendation.

For each workload (W1, W2, W3 of benchmarks/block_workloads.py) and process count N, every configuration
that runs on one machine is predicted (from the calibration profile and a profile of the model taken
here) and then measured for real (benchmarks/_validation_worker.py under ``spread run``). Reports the
error of each prediction, the median absolute error, and whether the recommended configuration was
the measured best in each (workload, N) cell.

    python benchmarks/plan_validation.py [--workloads W1,W2,W3] [--procs 2,3,4] [--profile PATH]
        [--steps 5] [--json results.json]

Timing runs one at a time; nothing else should load the machine meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import block_workloads as workloads  # noqa: E402

from spread.plan.advisor import make_plan  # noqa: E402
from spread.plan.calibration import calibrate, load_profile  # noqa: E402
from spread.plan.cluster import ClusterModel  # noqa: E402
from spread.plan.predict import Options  # noqa: E402
from spread.plan.workload import measure_model  # noqa: E402

MEASURABLE = {
    "one_device",
    "mirrored",
    "central_storage",
    "multi_worker_mirrored",
    "parameter_server",
    "pipeline",
}


def _measure(workload: str, candidate, steps: int, timeout: float) -> float | None:
    """Median step seconds of ``candidate`` measured for real, or None if it failed."""
    with tempfile.TemporaryDirectory(prefix="spread-validate-") as folder:
        out = os.path.join(folder, "result.json")
        worker = [
            str(HERE / "_validation_worker.py"),
            "--workload",
            workload,
            "--output",
            out,
            "--steps",
            str(steps),
            "--strategy",
            candidate.strategy,
        ]
        n = candidate.devices
        run = [sys.executable, "-m", "spread.cli.main", "run"]
        if candidate.strategy == "multi_worker_mirrored":
            cmd = [*run, "-n", str(n), *worker, "--communication", candidate.get("communication")]
        elif candidate.strategy == "parameter_server":
            servers = candidate.get("servers")
            cmd = [*run, "--workers", str(n - servers - 1), "--ps", str(servers), *worker]
        elif candidate.strategy == "pipeline":
            stages, micro = str(candidate.get("stages")), str(candidate.get("microbatches"))
            cmd = [*run, "-n", str(n), *worker, "--stages", stages, "--microbatches", micro]
        elif candidate.strategy == "one_device":
            cmd = [sys.executable, *worker, "--threads", str(os.cpu_count() or 1)]
        else:
            cmd = [sys.executable, *worker, "--replicas", str(n)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            print(f"  timed out: {candidate.label}", file=sys.stderr)
            return None
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"  failed: {candidate.label}: {proc.stderr[-500:]}", file=sys.stderr)
            return None
        return json.loads(Path(out).read_text())["step_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W1,W2,W3")
    parser.add_argument("--procs", default="2,3,4")
    parser.add_argument("--profile", default="spread-calibration.json")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--json", default=None, help="also write every row as JSON here")
    parser.add_argument("--strategies", default=",".join(sorted(MEASURABLE)), help="subset to measure")
    args = parser.parse_args()
    if not os.path.exists(args.profile):
        print(f"calibrating into {args.profile} ...", file=sys.stderr)
        calibrate(args.profile)
    calibration = load_profile(args.profile)
    cores = os.cpu_count() or 1
    rows, cells = [], []
    for name in args.workloads.split(","):
        model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(name)
        x, y = make_batch(global_batch)
        counts = sorted({int(n) for n in args.procs.split(",")})
        threads = sorted({1, cores, *(max(1, cores // n) for n in counts)})
        profile = measure_model(
            model,
            loss_fn,
            x,
            y,
            optimizer=make_optimizer(model.parameters()),
            threads=threads,
            concurrency=[n for n in counts if n > 1],
            name=name,
        )
        for n in counts:
            cluster = ClusterModel.from_profile(calibration, devices_per_node=n)
            plan = make_plan(
                profile, cluster, Options(global_batch=global_batch), tuple(args.strategies.split(","))
            )
            measured_here = []
            for prediction in plan.predictions:
                c = prediction.candidate
                if c.strategy == "pipeline" and c.get("microbatches") not in (
                    2 * c.get("stages"),
                    4 * c.get("stages"),
                ):
                    continue  # two micro-batch counts per stage count keep the grid affordable
                if c.strategy == "parameter_server" and c.get("servers") != 1:
                    continue
                started = time.perf_counter()
                seconds = _measure(name, prediction.candidate, args.steps, args.timeout)
                row = {
                    "workload": name,
                    "procs": n,
                    "config": prediction.candidate.label,
                    "predicted_ms": prediction.step_seconds * 1e3,
                    "measured_ms": None if seconds is None else seconds * 1e3,
                    "error": None if seconds is None else prediction.step_seconds / seconds - 1,
                    "wall_s": time.perf_counter() - started,
                }
                rows.append(row)
                if seconds is not None:
                    measured_here.append((global_batch / seconds, prediction))
                print(json.dumps(row), file=sys.stderr)
            if measured_here:
                best = max(measured_here, key=lambda t: t[0])[1]
                # The recommendation among the configurations measured (the grid skips some).
                recommended = max((p for _, p in measured_here), key=lambda p: p.samples_per_second)
                cells.append(
                    {
                        "workload": name,
                        "procs": n,
                        "recommended": recommended.candidate.label,
                        "measured_best": best.candidate.label,
                        "hit": best.candidate == recommended.candidate,
                    }
                )
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    print(f"machine: {calibration.machine}; calibration {args.profile} measured {calibration.measured_at}")
    print("\n| workload | procs | configuration | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        measured = "failed" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        error = "" if r["error"] is None else f"{r['error']:+.0%}"
        print(
            f"| {r['workload']} | {r['procs']} | {r['config']} | {r['predicted_ms']:.1f} | {measured} "
            f"| {error} |"
        )
    print("\n| workload | procs | recommended | measured best | same |")
    print("|---|---|---|---|---|")
    for c in cells:
        print(
            f"| {c['workload']} | {c['procs']} | {c['recommended']} | {c['measured_best']} | "
            f"{'yes' if c['hit'] else 'no'} |"
        )
    if errors:
        hits = sum(c["hit"] for c in cells)
        print(
            f"\nmedian absolute error {statistics.median(errors):.0%} over {len(errors)} configurations; "
            f"recommendation = measured best in {hits} of {len(cells)} cells ({hits / len(cells):.0%})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cells": cells}, indent=2))


if __name__ == "__main__":
    main()
