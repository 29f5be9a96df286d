"""What seeing inside a job costs: Trainer.fit steps of W1 under MultiWorkerMirrored (2 ranks), with
the flight recorder, its publishing thread and the straggler timing on (the default) and off, in one
invocation, alternating.

    flock /tmp/spread-bench.lock .venv/bin/python benchmarks/observe_overhead.py [--reps 5] [--steps 40]

W1: dense MLP 784-2048-2048-10, SGD lr 0.01, global batch 512, synthetic data; 1 thread per rank.
Each job runs ``reps`` fits of ``steps`` steps and reports its median ms per step after the first fit
(a warm-up). "off" replaces the recorder's calls, the watch and the straggler watch with nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = """
import os, statistics, sys, time
import torch
from torch import nn
import spread

observe, reps, steps = sys.argv[1] == "on", int(sys.argv[2]), int(sys.argv[3])
if not observe:
    from spread.comm import flight
    from spread.strategies import multi_worker_mirrored
    from spread.train import trainer as trainer_module
    flight.RECORDER.begin = lambda *a, **k: None
    flight.RECORDER.end = lambda *a, **k: None
    flight.RECORDER.set_phase = lambda *a, **k: None
    multi_worker_mirrored.start_watch = lambda *a, **k: None
    trainer_module.StragglerWatch = None
strategy = spread.MultiWorkerMirroredStrategy()
if not observe:  # the Trainer asks the strategy whether ranks compare: say no
    type(strategy).exchange_seconds = property(lambda self: None)
with strategy.scope():
    torch.manual_seed(0)
    layers = [nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(0)
data = (torch.randn(512 * steps, 784, generator=g), torch.randint(0, 10, (512 * steps,), generator=g))
trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
times = []
for rep in range(reps + 1):
    started = time.perf_counter()
    trainer.fit(data, epochs=1, global_batch_size=512, shuffle=False, verbose=0)
    if rep:
        times.append(1000 * (time.perf_counter() - started) / steps)
if strategy.is_chief:
    print(f"MS_PER_STEP {statistics.median(times):.3f}", flush=True)
"""


def _job(script: Path, mode: str, reps: int, steps: int) -> float:
    spread = str(Path(sys.executable).parent / "spread")
    out = subprocess.run(
        [spread, "run", "-n", "2", str(script), mode, str(reps), str(steps)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    found = re.search(r"MS_PER_STEP ([\d.]+)", out.stdout)
    if out.returncode or not found:
        raise RuntimeError(f"{mode}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="jobs per mode, alternating")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"on": [], "off": []}
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "job.py")
        script.write_text(JOB)
        for round_ in range(args.rounds):
            for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
                results[mode].append(_job(script, mode, args.reps, args.steps))
                print(f"round {round_} {mode:3s}: {results[mode][-1]:.2f} ms/step", flush=True)
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(f"\nW1, MultiWorkerMirrored x2, load average {os.getloadavg()[0]:.1f}")
    print(f"observability on {on:.2f} ms/step, off {off:.2f} ms/step: on / off = {on / off:.3f}")


if __name__ == "__main__":
    main()
