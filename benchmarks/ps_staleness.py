"""Asynchronous parameter servers with a descheduled worker: chief validation accuracy over many runs,
gradients applied as they come (``stale_gradients="apply"``) against scaled by their staleness
(``"scale"``, the default), in one invocation.

    flock /tmp/spread-bench.lock .venv/bin/python benchmarks/ps_staleness.py [--runs 20] [--epochs 6]

Each run is ``spread run --workers 1 --ps 2`` (the chief and one worker train, two servers) of the
digits classifier with SGD + momentum (lr 0.1, momentum 0.9, global batch 64). The worker stops itself
(SIGSTOP, a child sends SIGCONT 2 s later) once, at a random step of its first epochs, as a loaded
machine deschedules a process; the two modes run the same random stops (seeded per run), alternating.
TensorFlow's ParameterServerStrategy is not installed on the development machine; the issue's
comparison with it is left to a machine that has it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import json, os, signal, subprocess, sys
import torch
from sklearn.datasets import load_digits
from torch import nn
import spread

mode, stop_at, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
strategy = spread.ParameterServerStrategy(stale_gradients=mode)
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
y = torch.tensor(digits.target, dtype=torch.long)
order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
x, y = x[order], y[order]


class StopOnce(spread.callbacks.Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if strategy.rank == 1 and self.steps == stop_at:
            subprocess.Popen(["sh", "-c", f"sleep 2; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)


trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
trainer.fit((x[:1400], y[:1400]), epochs=epochs, global_batch_size=64, verbose=0, callbacks=[StopOnce()])
if strategy.is_chief:
    strategy.wait_for_workers()
    with torch.no_grad():
        accuracy = float((model(x[1400:]).argmax(1) == y[1400:]).float().mean())
    stats = strategy.server_stats()
    print(json.dumps({"accuracy": accuracy, "damped": sum(s["damped"] for s in stats),
                      "max_staleness": max(s["max_staleness_seen"] for s in stats)}), flush=True)
strategy.close()
"""


def _run(script: Path, mode: str, stop_at: int, epochs: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    spread_bin = str(Path(sys.executable).parent / "spread")
    out = subprocess.run(
        [spread_bin, "run", "--workers", "1", "--ps", "2", str(script), mode, str(stop_at), str(epochs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    found = re.search(r"\{\"accuracy\".*\}", out.stdout)
    if out.returncode != 0 or not found:
        tail = f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        raise RuntimeError(f"{mode} run failed ({out.returncode}):\n{tail}")
    return json.loads(found.group(0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps_per_epoch = 1400 // 64 // 2 + 1  # each of the 2 training tasks: half of each global batch
    rng = random.Random(args.seed)
    results: dict[str, list[dict]] = {"apply": [], "scale": []}
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "job.py")
        script.write_text(JOB)
        for run in range(args.runs):
            stop_at = rng.randint(2, 2 * steps_per_epoch)
            for mode in ("apply", "scale") if run % 2 == 0 else ("scale", "apply"):
                result = _run(script, mode, stop_at, args.epochs)
                results[mode].append(result)
                print(
                    f"run {run:2d} stop at step {stop_at:2d} {mode:5s}: accuracy {result['accuracy']:.3f} "
                    f"(damped {result['damped']}, max staleness {result['max_staleness']})",
                    flush=True,
                )
    took, load = time.time() - started, os.getloadavg()[0]
    print(f"\n{args.runs} runs per mode, {took:.0f} s, load average {load:.1f}")
    print("mode   median  mean   min    max    runs < 0.9")
    for mode, rows in results.items():
        acc = [r["accuracy"] for r in rows]
        print(
            f"{mode:5s}  {statistics.median(acc):.3f}   {statistics.mean(acc):.3f}  {min(acc):.3f}  "
            f"{max(acc):.3f}  {sum(a < 0.9 for a in acc)}"
        )


if __name__ == "__main__":
    main()
