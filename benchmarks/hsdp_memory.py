"""Hybrid sharding (HSDP) against full sharding, plain data parallelism and FSDP2's HSDP, in one run:
model-state bytes and peak resident memory per rank, and step time, each configuration in processes
of its own.

    python benchmarks/hsdp_memory.py 4 [--groups 2] [--steps 6] [--configs ...] [--json out.json]

Workload: Hugging Face ``GPT2LMHeadModel`` from a ``GPT2Config`` (6 layers, d 384, 6 heads, sequence
128, vocabulary 8192, 13.8 M parameters, 52.8 MiB; ``benchmarks/model_families.py``), AdamW, global
batch 16 sequences. Configurations, at ``nprocs`` processes:

* MultiWorkerMirrored (every rank holds everything);
* ``ShardedStrategy(shard="parameters", units=(GPT2Block,))`` over every process (full sharding);
* the same with ``shard_group_size=nprocs // groups`` (HSDP: ``groups`` groups, each one copy);
* FSDP2 ``fully_shard`` on each ``GPT2Block`` and the root over a 1-D mesh of every process, and over
  the 2-D ``(groups, nprocs // groups)`` mesh named ``("replicate", "shard")`` (FSDP2's HSDP).

Each trains ``--steps`` steps on the same global batches from the same weights. Model state and
peak are counted as in ``benchmarks/sharded_memory.py`` (``memory_report`` for spread, the same
storage count over local shards for FSDP2; the resident-set high-water mark over construction and
the steps, glibc returning freed blocks of 64 KiB or more at once). Step time: the median of the
steps after the first two (warm-up), rank 0's clock, from ``zero_grad`` to the end of ``step()``;
with ``--rounds R`` the configurations run round-robin R times and the median over rounds is shown
(a shared machine's load drifts over a run: round-robin spreads the drift over every configuration).
``max |w - first|``: weights after the steps against the first configuration's (MultiWorkerMirrored's
by default; ``--configs`` picks some).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from sharded_memory import (  # the shared measurement helpers of the ZeRO-stage study
    MIB,
    _full,
    _layer_class,
    _map_large_allocations,
    _peer_state,
    _start_peak,
    _status_bytes,
    _workload,
)
from torch import nn

import spread
from spread.testing import run_ranks

WORKLOAD = "gpt2"
CONFIGS = ("MultiWorkerMirrored", "full shard", "HSDP", "FSDP2 full shard", "FSDP2 HSDP")


def _spread_strategy(config: str, group_size: int) -> spread.Strategy:
    if config == "MultiWorkerMirrored":
        return spread.MultiWorkerMirroredStrategy()
    hybrid = {"shard_group_size": group_size} if config == "HSDP" else {}
    return spread.ShardedStrategy(shard="parameters", units=(_layer_class(WORKLOAD),), **hybrid)


def _fsdp2(model: nn.Module, world: int, groups: int, hybrid: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hybrid:
        mesh = init_device_mesh("cpu", (groups, world // groups), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for module in model.modules():
        if isinstance(module, _layer_class(WORKLOAD)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _job(config: str, groups: int, steps: int) -> dict:
    torch.set_num_threads(1)
    _map_large_allocations()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    peer = config.startswith("FSDP2")
    # For FSDP2 MultiWorkerMirrored only owns the process group.
    strategy = spread.MultiWorkerMirroredStrategy() if peer else _spread_strategy(config, world // groups)
    try:
        baseline = _start_peak()
        if not peer:
            with strategy.scope():
                model, loss_fn, make_optimizer, batch, global_batch = _workload(WORKLOAD)
                optimizer = make_optimizer(model.parameters())
            strategy.prepare_optimizer(optimizer)

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                strategy.run(lambda: loss_fn(model(x), y).backward())

            def state() -> list[int]:
                report = strategy.memory_report(optimizer)
                return [report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes]

            def weights() -> dict[str, torch.Tensor]:
                return strategy.full_state_dict(model)
        else:
            model, loss_fn, make_optimizer, batch, global_batch = _workload(WORKLOAD)
            trained = _fsdp2(model, world, groups, hybrid=config == "FSDP2 HSDP")
            optimizer = make_optimizer(model.parameters())

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                loss_fn(trained(x), y).backward()

            def state() -> list[int]:
                return _peer_state(model, optimizer)

            def weights() -> dict[str, torch.Tensor]:
                return {k: _full(v) for k, v in model.state_dict().items()}

        local = global_batch // world
        times = []
        for s in range(steps):
            x, y = batch(s)
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            started = time.perf_counter()
            optimizer.zero_grad()
            step(x, y)
            optimizer.step()
            times.append(time.perf_counter() - started)
        sizes = state()
        peak = _status_bytes("VmHWM") - baseline
        full = weights()
        return {
            "state": sizes,
            "peak": peak,
            "step_seconds": statistics.median(times[2:]) if len(times) > 2 else times[-1],
            "weights": full if rank == 0 else None,
        }
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nprocs", type=int, nargs="?", default=4)
    parser.add_argument("--groups", type=int, default=2, help="HSDP: number of groups (replicas)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the configurations round-robin this many times"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.nprocs % args.groups:
        parser.error(f"--groups {args.groups} does not divide {args.nprocs} processes")
    results: dict[str, list[dict]] = {}
    rounds: dict[str, list[float]] = {config: [] for config in args.configs}  # rank 0's step time
    first: dict[str, torch.Tensor] | None = None
    for round_index in range(args.rounds):
        for config in args.configs:
            per_rank = run_ranks(_job, args.nprocs, args=(config, args.groups, args.steps), timeout=590)
            weights = per_rank[0].pop("weights")
            for r in per_rank[1:]:
                r.pop("weights")
            first = first if first is not None else weights
            common = [k for k in first if k in weights]
            diff = max(float((weights[k].float() - first[k].float()).abs().max()) for k in common)
            rounds[config].append(per_rank[0]["step_seconds"])
            if round_index == 0:
                results[config] = [{**r, "max_weight_difference": diff} for r in per_rank]
            print(f"  done: {config} (round {round_index + 1})", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            document = {"nprocs": args.nprocs, "groups": args.groups, "results": results, "rounds": rounds}
            json.dump(document, f, indent=1)
    size = args.nprocs // args.groups
    print(
        f"{WORKLOAD}, AdamW, {args.nprocs} processes, HSDP {args.groups} x {size}, {args.steps} steps; "
        f"MiB per rank (min-max over ranks); model state after the last step, before zero_grad; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        "parameters",
        "gradients",
        "optim state",
        "model state",
        "peak RSS",
        "step s",
    )  # median of rounds
    print(f"{'configuration':22} " + " ".join(f"{h:>13}" for h in header) + "  max |w - first|")
    for config, per_rank in results.items():
        columns = [[*r["state"], sum(r["state"]), r["peak"]] for r in per_rank]
        cells = []
        for i in range(5):
            lo, hi = min(c[i] for c in columns) / MIB, max(c[i] for c in columns) / MIB
            cells.append(f"{lo:.1f}" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f}")
        cells.append(f"{statistics.median(rounds[config]):.3f}")
        diff = per_rank[0]["max_weight_difference"]
        print(f"{config:22} " + " ".join(f"{c:>13}" for c in cells) + f"  {diff:.1e}")
    if args.rounds > 1:
        print(
            "step seconds by round (rank 0): "
            + "; ".join(
                f"{config} " + " ".join(f"{t:.2f}" for t in times) for config, times in rounds.items()
            )
        )


if __name__ == "__main__":
    main()
