"""ShardedStrategy(shard="parameters") versus PyTorch FSDP2 (``fully_shard``) in the same job:
throughput, model-state bytes per rank, and the weights both reach.

    python benchmarks/sharded_vs_fsdp2.py --workload W1 [--nprocs 2 --rounds 6 --steps 5]

Equal sharding: both shard parameters, gradients and optimizer state over all ranks, with the same
units (W1: each ``nn.Linear``; W2: each ``nn.TransformerEncoderLayer``, the rest as the root unit),
from the same weights, optimizer and global batches, on one process group (gloo on CPU). FSDP2 runs
with its defaults (reshard after forward, no CPU offload, float32).

Timing is paired in rounds (this machine's speed drifts by tens of percent within minutes): each round
times ``steps`` steps of each configuration, the order alternating; the ratio is per round, the
report gives the median over rounds. Memory is read after one step, before ``zero_grad``: spread's
``Strategy.memory_report`` and, for FSDP2, the local shards (``DTensor.to_local``) of parameters,
gradients and optimizer state. The last line checks that both reached the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import spread
from spread.testing import run_ranks

UNITS: dict[str, tuple[type[nn.Module], ...]] = {"W1": (nn.Linear,), "W2": (nn.TransformerEncoderLayer,)}


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t  # DTensor shards
        total += local.numel() * local.element_size()
    return total


def _fsdp2_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    params = list(model.parameters())
    state = [
        v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
    sizes = [_local_bytes(params), _local_bytes(p.grad for p in params), _local_bytes(state)]
    return [*sizes, sum(sizes)]


class _Config:
    """One configuration: a model, an optimizer and a ``step(x, y)`` on this rank's batch."""

    def __init__(self, name: str, step: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        self.name = name
        self.step = step


def _spread_config(workload: str, strategy: spread.ShardedStrategy) -> tuple[_Config, Callable, Callable]:
    with strategy.scope():
        model, loss_fn, make_optimizer, _, _ = workloads.make(workload)
        optimizer = make_optimizer(model.parameters())
    strategy.prepare_optimizer(optimizer)

    def step(x, y):
        optimizer.zero_grad()
        strategy.run(lambda: loss_fn(model(x), y).backward())
        optimizer.step()

    def memory() -> list[int]:
        report = strategy.memory_report(optimizer)
        return [
            report.parameter_bytes,
            report.gradient_bytes,
            report.optimizer_state_bytes,
            report.model_state_bytes,
        ]

    return _Config("spread Sharded", step), memory, lambda: strategy.full_state_dict(model)


def _fsdp2_config(workload: str) -> tuple[_Config, Callable, Callable]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, loss_fn, make_optimizer, _, _ = workloads.make(workload)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, UNITS[workload]):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = make_optimizer(model.parameters())

    def step(x, y):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}

    return _Config("FSDP2", step), lambda: _fsdp2_state_bytes(model, optimizer), weights


def _job(workload: str, rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    strategy = spread.ShardedStrategy(shard="parameters", units=UNITS[workload])
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        _, _, _, make_batch, global_batch = workloads.make(workload)
        local = global_batch // world
        torch.manual_seed(100 + rank)  # each rank its own part of every global batch
        batches = [make_batch(global_batch) for _ in range(4)]
        parts = [
            (x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]) for x, y in batches
        ]
        spread_cfg, spread_memory, spread_weights = _spread_config(workload, strategy)
        fsdp_cfg, fsdp_memory, fsdp_weights = _fsdp2_config(workload)
        configs = [spread_cfg, fsdp_cfg]
        memory = {}
        for cfg, read in ((spread_cfg, spread_memory), (fsdp_cfg, fsdp_memory)):
            cfg.step(*parts[0])  # warm-up step; memory after it, before zero_grad
            memory[cfg.name] = read()
        first_diff = max(
            float((a - b).abs().max())
            for a, b in zip(spread_weights().values(), fsdp_weights().values(), strict=True)
        )
        _, per_sample = workloads.unit(workload)
        rates: dict[str, list[float]] = {cfg.name: [] for cfg in configs}
        for r in range(rounds):
            for cfg in configs if r % 2 == 0 else configs[::-1]:
                cfg.step(*parts[1])  # one untimed step at each turn
                dist.barrier()
                start = time.perf_counter()
                for i in range(steps):
                    cfg.step(*parts[i % len(parts)])
                dist.barrier()
                rates[cfg.name].append(global_batch * per_sample * steps / (time.perf_counter() - start))
        return {"rates": rates, "memory": memory, "weights_diff_after_one_step": first_diff}
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="W1", choices=sorted(UNITS))
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    env = {"OMP_NUM_THREADS": "1"}
    (result, *_) = run_ranks(
        _job, args.nprocs, args=(args.workload, args.rounds, args.steps), timeout=590, env=env
    )
    label, _ = workloads.unit(args.workload)
    spread_rates, fsdp_rates = result["rates"]["spread Sharded"], result["rates"]["FSDP2"]
    ratios = [a / b for a, b in zip(spread_rates, fsdp_rates, strict=True)]
    unit_name = UNITS[args.workload][0].__name__
    print(f"{args.workload}, {args.nprocs} processes x 1 thread, shard=parameters, units {unit_name}")
    for name, rates in result["rates"].items():
        rounded = [round(r) for r in rates]
        print(f"  {name:15} median {statistics.median(rates):>10,.0f} {label}  rounds {rounded}")
    rounded_ratios = [round(r, 2) for r in ratios]
    print(
        f"  throughput ratio spread/FSDP2: median {statistics.median(ratios):.2f} (rounds {rounded_ratios})"
    )
    print("  model state per rank (bytes): parameters, gradients, optimizer state, total")
    for name, sizes in result["memory"].items():
        print(f"    {name:15} " + "  ".join(f"{v:>12,}" for v in sizes))
    spread_total, fsdp_total = result["memory"]["spread Sharded"][3], result["memory"]["FSDP2"][3]
    print(f"  model state ratio spread/FSDP2: {spread_total / fsdp_total:.3f}")
    print(f"  max |w_spread - w_FSDP2| after the first step: {result['weights_diff_after_one_step']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"workload": args.workload, "nprocs": args.nprocs, "ratios": ratios, **result}, f, indent=1
            )


if __name__ == "__main__":
    main()
