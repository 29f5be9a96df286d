"""Training throughput of one workload under every synchronous configuration, for ``spread bench``.

Two jobs per workload, each printing one JSON object (``--json PATH`` writes it to a file):

* ``--job single``: one process: 1 thread, 2 threads, then ``MirroredStrategy`` with 2 replicas
  (threads, 1 intra-op thread each) for every ``cross_device_ops``;
* ``--job ranks``: 2 processes x 1 thread on loopback, one process group for all: PyTorch DDP, then
  ``MultiWorkerMirroredStrategy`` with every ``communication`` (``auto`` first: the default);
* ``--job tensorflow`` (W1): TensorFlow's ``MultiWorkerMirroredStrategy``, 2 processes x 1 thread,
  through ``tf_baselines.py``, when ``tensorflow`` is importable; otherwise (and with ``--quick``) a
  row that says why it was skipped.

Every configuration: the workload's model (same seed), optimizer and synthetic global batch;
``warmup`` steps, then ``reps`` timed repetitions of ``steps`` steps (ranks meet at a barrier
around each repetition). A repetition's rate is units (samples or tokens) per second.

    python benchmarks/throughput.py --workload W1 --job ranks [--quick] [--reps 7 --steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

DESCRIPTIONS = {
    "W1": "W1: MLP 784-2048-2048-10, SGD, global batch 512",
    "W2": "W2: GPT decoder (4 layers, d=256, seq 128, vocab 8192), AdamW, global batch 16 x 128 tokens",
}
MWMS_ALGORITHMS = ("auto", "native", "ring", "shm", "hierarchical", "reduce_to_one")
MIRRORED_OPS = ("accumulate", "reduce_to_one", "hierarchical_copy")


def _time(step: Callable[[], None], warmup: int, reps: int, steps: int, units: int, sync=None) -> list[float]:
    """Rates (units/s) of ``reps`` repetitions of ``steps`` steps after ``warmup`` steps."""
    for _ in range(warmup):
        step()
    rates = []
    for _ in range(reps):
        if sync:
            sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if sync:
            sync()
        rates.append(units * steps / (time.perf_counter() - start))
    return rates


def _plain_step(name: str, quick: bool, rank: int = 0, world: int = 1, wrap=None):
    model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(name, quick=quick)
    if wrap is not None:
        model = wrap(model)
    optimizer = make_optimizer(model.parameters())
    x, y = make_batch(global_batch)
    per = global_batch // world
    x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def _strategy_step(strategy, name: str, quick: bool):
    with strategy.scope():
        model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(name, quick=quick)
        optimizer = make_optimizer(model.parameters())
    data = strategy.distribute_dataset(make_batch(global_batch), global_batch, shuffle=False)
    batch = next(iter(data))

    def replica_step(x, y) -> None:
        loss_fn(model(x), y).backward()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        strategy.run(replica_step, args=batch)
        optimizer.step()

    return step


def run_single(name: str, quick: bool, warmup: int, reps: int, steps: int) -> dict:
    import spread

    label, per_sample = workloads.unit(name, quick=quick)
    units = workloads.make(name, quick=quick)[4] * per_sample
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rates = _time(_plain_step(name, quick), warmup, reps, steps, units)
        rows.append(
            {
                "config": f"one process, {threads} thread{'s' * (threads > 1)}",
                "kind": "single",
                "processes": 1,
                "threads": threads,
                "rates": rates,
            }
        )
    for op in MIRRORED_OPS:
        strategy = spread.MirroredStrategy(num_replicas=2, cross_device_ops=op, intra_op_threads=1)
        try:
            rates = _time(_strategy_step(strategy, name, quick), warmup, reps, steps, units)
        finally:
            strategy.close()
        rows.append(
            {
                "config": f"spread Mirrored 2 replicas (threads), cross_device_ops={op}",
                "kind": "mirrored",
                "option": op,
                "processes": 1,
                "threads": 2,
                "rates": rates,
            }
        )
    return _result(name, quick, label, rows)


def _result(name: str, quick: bool, unit: str, rows: list[dict]) -> dict:
    description = DESCRIPTIONS[name] + (" (quick: tiny model)" if quick else "")
    return {
        "workload": name,
        "unit": unit,
        "description": description,
        "torch": torch.__version__,
        "rows": rows,
    }


def _rank_job(name: str, quick: bool, warmup: int, reps: int, steps: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import spread
    from spread.cluster import resolve_cluster
    from spread.cluster.rendezvous import rendezvous

    torch.set_num_threads(1)
    rdzv = rendezvous(resolve_cluster())
    label, per_sample = workloads.unit(name, quick=quick)
    units = workloads.make(name, quick=quick)[4] * per_sample
    try:
        rows = []
        step = _plain_step(name, quick, rdzv.rank, dist.get_world_size(), wrap=DistributedDataParallel)
        rates = _time(step, warmup, reps, steps, units, sync=dist.barrier)
        rows.append(
            {
                "config": "PyTorch DDP 2 x 1 thread",
                "kind": "ddp",
                "processes": 2,
                "threads": 1,
                "rates": rates,
            }
        )
        for algorithm in MWMS_ALGORITHMS:
            strategy = spread.MultiWorkerMirroredStrategy(algorithm)
            try:
                resolved = type(strategy.algorithm).name
                rates = _time(
                    _strategy_step(strategy, name, quick), warmup, reps, steps, units, sync=dist.barrier
                )
            finally:
                strategy.close()
            shown = f"auto = {resolved}, the default" if algorithm == "auto" else algorithm
            rows.append(
                {
                    "config": f"spread MultiWorkerMirrored 2 x 1 thread, communication={shown}",
                    "kind": "mwms",
                    "option": algorithm,
                    "resolved": resolved,
                    "processes": 2,
                    "threads": 1,
                    "rates": rates,
                }
            )
        return _result(name, quick, label, rows)
    finally:
        rdzv.close()


def run_ranks_job(name: str, quick: bool, warmup: int, reps: int, steps: int, timeout: float) -> dict:
    from spread.testing import run_ranks

    return run_ranks(_rank_job, 2, args=(name, quick, warmup, reps, steps), timeout=timeout)[0]


TF_CONFIG_NAME = "TensorFlow MultiWorkerMirrored 2 x 1 thread (RING, custom step)"


def run_tensorflow(name: str, quick: bool, warmup: int, reps: int, steps: int, timeout: float) -> dict:
    """TensorFlow's MWMS on W1 as one row (``rates`` empty and ``skipped`` set when not run)."""
    import subprocess

    import tf_baselines

    label, _per_sample = workloads.unit(name, quick=quick)
    row = {"config": TF_CONFIG_NAME, "kind": "tensorflow", "processes": 2, "threads": 1, "rates": []}
    if name != "W1":
        row["skipped"] = "skipped: TensorFlow runs W1 only"
    elif quick:
        row["skipped"] = "skipped: not run with --quick"
    elif not tf_baselines.tensorflow_available():
        row["skipped"] = "skipped: tensorflow not installed"
    else:
        timeout = min(timeout, 600.0)  # the launcher's own limit, under this job's
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_baselines.py")
        cmd = [sys.executable, script, "--mode", "mwms", "--workload", name, "--workers", "2"]
        cmd += ["--warmup", str(warmup), "--reps", str(reps), "--steps", str(steps)]
        cmd += ["--timeout", str(timeout)]
        rc, err = None, ""
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout + 60, stdin=subprocess.DEVNULL
            )
            rc, err = proc.returncode, proc.stderr
            records = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
            record = records[-1] if records else {"error": f"no output (exit {rc})"}
        except subprocess.TimeoutExpired:
            record = {"error": f"ran past {timeout + 60:.0f} s"}
        if "error" in record or rc != 0:
            sys.stderr.write(f"tf_baselines.py: {record.get('error')}\n{err[-2000:]}\n")
            row["skipped"] = f"failed: {record.get('error', f'exit {rc}')} (role {record.get('role')})"
        elif not record.get("replicas_in_sync", False):
            row["skipped"] = "failed: the TensorFlow replicas ended with different weights"
        else:
            row["rates"] = record["rates"]
    return _result(name, quick, label, [row])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=["W1", "W2", "w1", "w2"])
    parser.add_argument("--job", required=True, choices=["single", "ranks", "tensorflow"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--json", default=None, help="write the result here instead of stdout")
    args = parser.parse_args()
    name = args.workload.upper()
    if args.job == "single":
        result = run_single(name, args.quick, args.warmup, args.reps, args.steps)
    elif args.job == "tensorflow":
        result = run_tensorflow(name, args.quick, args.warmup, args.reps, args.steps, args.timeout)
    else:
        result = run_ranks_job(name, args.quick, args.warmup, args.reps, args.steps, args.timeout)
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
