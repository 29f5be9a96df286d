"""Asynchronous parameter servers with a descheduled worker: chief validation accuracy over many runs,
synchronous (``mode="sync"``, the reference), gradients applied as they come
(``stale_gradients="apply"``), scaled by their staleness (``"scale"``, the default), and TensorFlow's
asynchronous ParameterServerStrategy, in one invocation.

    flock /tmp/spread-bench.lock .venv/bin/python benchmarks/ps_staleness.py [--runs 20] [--epochs 6]

Each spread run is ``spread run --workers 1 --ps 2`` (the chief and one worker train, two servers) of
the digits classifier with SGD + momentum (lr 0.1, momentum 0.9, global batch 64). The worker stops
itself (SIGSTOP, a child sends SIGCONT 2 s later) once, at a random step of its first epochs, as a
loaded machine deschedules a process; every mode runs the same random stops (seeded per run), in an
order that rotates from run to run. The TensorFlow row (when ``tensorflow`` is importable; ``pip
install tensorflow-cpu==2.21.0``, the ``bench`` extra) runs ``benchmarks/tf_ps_staleness.py``: the
same data, split, initial weights and optimizer from a ``.npz`` this launcher writes with torch, two
servers, two workers of 32 samples a step and a chief that only coordinates, the same samples in all,
worker 1 stopped for 2 s near the same step (that module's docstring says how, and where it differs).
"""

from __future__ import annotations

import argparse
import importlib.util
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
if mode == "sync":
    strategy = spread.ParameterServerStrategy(mode="sync")
else:
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


MODES = ("sync", "apply", "scale", "tensorflow")
HERE = Path(__file__).resolve().parent


def _write_digits(path: Path) -> None:
    """The job's data (same permutation and split) and initial weights, for the TensorFlow processes:
    computed here with torch, so that no process imports both frameworks."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from torch import nn

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    arrays = {"x": x[order].numpy(), "y": y[order].numpy().astype(np.int32)}
    for k, layer in enumerate((model[0], model[2])):  # Keras-style kernels: (in, out)
        arrays[f"kernel{k}"] = layer.weight.detach().numpy().T.copy()
        arrays[f"bias{k}"] = layer.bias.detach().numpy()
    np.savez(path, **arrays)


def _run_tf(data: Path, stop_at: int, epochs: int) -> dict:
    argv = [sys.executable, str(HERE / "tf_ps_staleness.py"), "--data", str(data), "--stop-at", str(stop_at)]
    out = subprocess.run(
        [*argv, "--epochs", str(epochs), "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    found = re.search(r"\{.*\}", out.stdout)
    record = json.loads(found.group(0)) if found else {}
    if out.returncode != 0 or "accuracy" not in record:
        raise RuntimeError(
            f"tensorflow run failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        )
    return record


def _describe(mode: str, result: dict) -> str:
    if mode == "tensorflow":
        return f"stopped after {result['stopped_after']} steps done, training {result['train_s']} s"
    return f"damped {result['damped']}, max staleness {result['max_staleness']}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES}")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}")
    if "tensorflow" in modes and importlib.util.find_spec("tensorflow") is None:
        print("tensorflow row skipped: tensorflow is not importable (pip install tensorflow-cpu==2.21.0)")
        modes.remove("tensorflow")
    steps_per_epoch = 1400 // 64 // 2 + 1  # each of the 2 training tasks: half of each global batch
    rng = random.Random(args.seed)
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        script, data = Path(folder, "job.py"), Path(folder, "digits.npz")
        script.write_text(JOB)
        if "tensorflow" in modes:
            _write_digits(data)
        for run in range(args.runs):
            stop_at = rng.randint(2, 2 * steps_per_epoch)
            for k in range(len(modes)):
                mode = modes[(run + k) % len(modes)]
                if mode == "tensorflow":
                    result = _run_tf(data, stop_at, args.epochs)
                else:
                    result = _run(script, mode, stop_at, args.epochs)
                results[mode].append(result)
                print(
                    f"run {run:2d} stop at step {stop_at:2d} {mode:10s}: accuracy {result['accuracy']:.3f} "
                    f"({_describe(mode, result)})",
                    flush=True,
                )
    took, load = time.time() - started, os.getloadavg()[0]
    print(f"\n{args.runs} runs per mode, {took:.0f} s, load average {load:.1f}")
    print("mode        median  mean   min    max    runs < 0.9")
    for mode, rows in results.items():
        acc = [r["accuracy"] for r in rows]
        print(
            f"{mode:10s}  {statistics.median(acc):.3f}   {statistics.mean(acc):.3f}  {min(acc):.3f}  "
            f"{max(acc):.3f}  {sum(a < 0.9 for a in acc)}"
        )


if __name__ == "__main__":
    main()
