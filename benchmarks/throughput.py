"""Training throughput of one workload under every synchronous configuration, for ``spread bench``.

One job per workload (``--job all``) prints one JSON object (``--json PATH`` writes it to a file).
It starts 2 processes x 1 thread on loopback (one process group) and measures, in interleaved
rounds, every configuration:

* one process with 1 thread and with 2 threads, then ``MirroredStrategy`` with 2 replicas (threads,
  1 intra-op thread each) for every ``cross_device_ops``: run by rank 0 alone while rank 1 waits,
  idle, at a barrier;
* PyTorch DDP and ``MultiWorkerMirroredStrategy`` with every ``communication`` (``auto`` first: the
  default), 2 x 1 thread, both ranks;
* ``ShardedStrategy(shard="parameters")`` and PyTorch FSDP2 (``fully_shard``), each with one unit per
  block (W1: every ``nn.Linear``; W2: every decoder layer), 2 x 1 thread, both ranks;
* (W1) TensorFlow's ``MultiWorkerMirroredStrategy``, 2 processes x 1 thread, through
  ``tf_baselines.py`` started by rank 0 while both torch ranks wait, when ``tensorflow`` is
  importable; otherwise (and with ``--quick``) a row that says why it was skipped.

Why rounds: this VM's speed drifts by tens of percent within minutes, so configurations measured
one block after another are compared under different machines. In every round each configuration
runs ``reps`` timed repetitions (the order rotates from round to round), so drift hits all of them
alike; the report's ratios are paired: per round, then the median over rounds. Every configuration
is built once (models, strategies, buffers) and stays alive, idle, between its turns.

Every configuration: the workload's model (same seed), optimizer and synthetic global batch;
``warmup`` steps at its first turn and one at each later turn, then ``reps`` timed repetitions of
``steps`` steps (ranks meet at a barrier around each repetition). A repetition's rate is units
(samples or tokens) per second.

    python benchmarks/throughput.py --workload W1 --job all [--quick] [--rounds 6 --reps 1 --steps 5]

``--job tensorflow`` runs the TensorFlow row alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

# The blocks each sharded configuration gathers one at a time (FSDP2's units, spread's ``units=``).
SHARD_UNITS: dict[str, tuple[type[torch.nn.Module], ...]] = {
    "W1": (torch.nn.Linear,),
    "W2": (torch.nn.TransformerEncoderLayer,),
}

DESCRIPTIONS = {
    "W1": "W1: MLP 784-2048-2048-10, SGD, global batch 512",
    "W2": "W2: GPT decoder (4 layers, d=256, seq 128, vocab 8192), AdamW, global batch 16 x 128 tokens",
}
MWMS_ALGORITHMS = ("auto", "native", "ring", "shm", "hierarchical", "reduce_to_one")
MIRRORED_OPS = ("accumulate", "reduce_to_one", "hierarchical_copy")
TF_CONFIG_NAME = "TensorFlow MultiWorkerMirrored 2 x 1 thread (RING, custom step)"


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


@dataclass
class _Config:
    """One row: how to run a turn of it on this rank (``None``: this rank only waits)."""

    row: dict
    turn: Callable[[int], list[float]] | None
    rounds: list[list[float]] = field(default_factory=list)


def _result(name: str, quick: bool, unit: str, rows: list[dict]) -> dict:
    description = DESCRIPTIONS[name] + (" (quick: tiny model)" if quick else "")
    return {
        "workload": name,
        "unit": unit,
        "description": description,
        "torch": torch.__version__,
        "rows": rows,
    }


def _single_configs(name: str, quick: bool, timed: Callable, lead: bool, closers: list) -> list[_Config]:
    """One process (1 and 2 threads) and MirroredStrategy x 2 per cross_device_ops: rank 0 runs them."""
    import spread

    configs = []
    for threads in (1, 2):
        row = {
            "config": f"one process, {threads} thread{'s' * (threads > 1)}",
            "kind": "single",
            "processes": 1,
            "threads": threads,
        }
        step = _plain_step(name, quick) if lead else None
        configs.append(_Config(row, timed(step, threads) if lead else None))
    for op in MIRRORED_OPS:
        row = {
            "config": f"spread Mirrored 2 replicas (threads), cross_device_ops={op}",
            "kind": "mirrored",
            "option": op,
            "processes": 1,
            "threads": 2,
        }
        turn = None
        if lead:
            strategy = spread.MirroredStrategy(num_replicas=2, cross_device_ops=op, intra_op_threads=1)
            closers.append(strategy.close)
            turn = timed(_strategy_step(strategy, name, quick), 1)
        configs.append(_Config(row, turn))
    return configs


def _rank_configs(name: str, quick: bool, rank: int, timed: Callable, closers: list) -> list[_Config]:
    """PyTorch DDP and MultiWorkerMirroredStrategy per communication: both ranks run them."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import spread

    torch.set_num_threads(1)
    ddp = _plain_step(name, quick, rank, dist.get_world_size(), wrap=DistributedDataParallel)
    row = {"config": "PyTorch DDP 2 x 1 thread", "kind": "ddp", "processes": 2, "threads": 1}
    configs = [_Config(row, timed(ddp, 1, dist.barrier))]
    for algorithm in MWMS_ALGORITHMS:
        strategy = spread.MultiWorkerMirroredStrategy(algorithm)
        closers.append(strategy.close)
        resolved = type(strategy.algorithm).name
        shown = f"auto = {resolved}, the default" if algorithm == "auto" else algorithm
        row = {
            "config": f"spread MultiWorkerMirrored 2 x 1 thread, communication={shown}",
            "kind": "mwms",
            "option": algorithm,
            "resolved": resolved,
            "processes": 2,
            "threads": 1,
        }
        configs.append(_Config(row, timed(_strategy_step(strategy, name, quick), 1, dist.barrier)))
    # Sharded data parallelism at equal sharding: spread's ZeRO-3 and FSDP2, one unit per block.
    units = SHARD_UNITS[name]
    sharded = spread.ShardedStrategy(shard="parameters", units=units)
    closers.append(sharded.close)
    row = {"config": 'spread Sharded 2 x 1 thread, shard="parameters"', "kind": "sharded", "processes": 2}
    configs.append(
        _Config({**row, "threads": 1}, timed(_strategy_step(sharded, name, quick), 1, dist.barrier))
    )
    fsdp2 = _plain_step(
        name, quick, rank, dist.get_world_size(), wrap=lambda model: _fully_shard(model, units)
    )
    row = {
        "config": "PyTorch FSDP2 (fully_shard) 2 x 1 thread",
        "kind": "fsdp2",
        "processes": 2,
        "threads": 1,
    }
    configs.append(_Config(row, timed(fsdp2, 1, dist.barrier)))
    return configs


def _fully_shard(model: torch.nn.Module, units: tuple[type[torch.nn.Module], ...]) -> torch.nn.Module:
    """FSDP2 as its tutorial applies it: each block of ``units``, then the root."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, units):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _all_job(
    name: str, quick: bool, warmup: int, rounds: int, reps: int, steps: int, tf_timeout: float
) -> dict:
    """Every configuration in ``rounds`` interleaved rounds (see the module docstring)."""
    import torch.distributed as dist

    from spread.cluster import resolve_cluster
    from spread.cluster.rendezvous import rendezvous

    torch.set_num_threads(1)
    # A turn of rank 0 alone (or of TensorFlow) keeps the other rank waiting at a barrier.
    rdzv = rendezvous(resolve_cluster(), collective_timeout=max(600.0, tf_timeout + 120.0))
    lead = rdzv.rank == 0
    label, per_sample = workloads.unit(name, quick=quick)
    units = workloads.make(name, quick=quick)[4] * per_sample

    def timed(step, threads: int, sync=None) -> Callable[[int], list[float]]:
        """A turn of ``step``: ``warmup`` steps at the first turn, one at each later turn."""
        warm = [warmup]

        def turn(n: int) -> list[float]:
            torch.set_num_threads(threads)
            rates = _time(step, warm[0], n, steps, units, sync)
            warm[0] = 1
            return rates

        return turn

    closers: list[Callable[[], None]] = []
    try:
        configs = _single_configs(name, quick, timed, lead, closers)
        configs += _rank_configs(name, quick, rdzv.rank, timed, closers)
        tf_row = _tensorflow_row(name, quick)  # rank 0 marks it skipped if a TensorFlow run fails
        tf_turn = (lambda n: _run_tensorflow(name, warmup, n, steps, tf_timeout, tf_row)) if lead else None
        configs.append(_Config(tf_row, None if "skipped" in tf_row else tf_turn))
        for r in range(rounds):
            shift = r % len(configs)
            for config in configs[shift:] + configs[:shift]:
                dist.barrier()
                config.rounds.append(config.turn(reps) if config.turn is not None else [])
                dist.barrier()
        rows = []
        for c in configs:
            ran = "skipped" not in c.row
            rows.append(
                {
                    **c.row,
                    "rounds": c.rounds if ran else [],
                    "rates": [x for rr in c.rounds for x in rr] if ran else [],
                }
            )
        return _result(name, quick, label, rows)
    finally:
        for close in reversed(closers):
            close()
        rdzv.close()


def run_all(name: str, quick: bool, warmup: int, rounds: int, reps: int, steps: int, timeout: float) -> dict:
    from spread.testing import run_ranks

    tf_timeout = min(timeout, 600.0)
    args = (name, quick, warmup, rounds, reps, steps, tf_timeout)
    return run_ranks(_all_job, 2, args=args, timeout=timeout)[0]


def _tensorflow_row(name: str, quick: bool) -> dict:
    """The TensorFlow row, with ``skipped`` set when it will not run."""
    import tf_baselines

    row = {"config": TF_CONFIG_NAME, "kind": "tensorflow", "processes": 2, "threads": 1}
    if name != "W1":
        row["skipped"] = "skipped: TensorFlow runs W1 only"
    elif quick:
        row["skipped"] = "skipped: not run with --quick"
    elif not tf_baselines.tensorflow_available():
        row["skipped"] = "skipped: tensorflow not installed"
    return row


def _run_tensorflow(name: str, warmup: int, reps: int, steps: int, timeout: float, row: dict) -> list[float]:
    """One TensorFlow job of ``reps`` repetitions (its own processes); on failure, ``row`` says why
    and no rates are returned."""
    import subprocess

    if "skipped" in row:
        return []
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_baselines.py")
    cmd = [sys.executable, script, "--mode", "mwms", "--workload", name, "--workers", "2"]
    cmd += ["--warmup", str(warmup), "--reps", str(reps), "--steps", str(steps), "--timeout", str(timeout)]
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
        return []
    if not record.get("replicas_in_sync", False):
        row["skipped"] = "failed: the TensorFlow replicas ended with different weights"
        return []
    return record["rates"]


def run_tensorflow(name: str, quick: bool, warmup: int, reps: int, steps: int, timeout: float) -> dict:
    """TensorFlow's MWMS on W1 as one row (``rates`` empty and ``skipped`` set when not run)."""
    label, _per_sample = workloads.unit(name, quick=quick)
    row = _tensorflow_row(name, quick)
    row["rates"] = _run_tensorflow(name, warmup, reps, steps, min(timeout, 600.0), row)
    return _result(name, quick, label, [row])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=["W1", "W2", "w1", "w2"])
    parser.add_argument("--job", default="all", choices=["all", "tensorflow"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=1, help="timed repetitions per round")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="write the result here instead of stdout")
    args = parser.parse_args()
    name = args.workload.upper()
    if args.job == "tensorflow":
        result = run_tensorflow(name, args.quick, args.warmup, args.reps, args.steps, args.timeout)
    else:
        result = run_all(name, args.quick, args.warmup, args.rounds, args.reps, args.steps, args.timeout)
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
