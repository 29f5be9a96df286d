"""Pipeline bubble: measured idle fraction per stage vs the GPipe bound (S-1)/(M+S-1).

    flock /tmp/spread-bench.lock python benchmarks/pipeline_bubble.py [--schedules gpipe,1f1b]
        [--microbatches 1,2,4,8,16] [--steps 6] [--quick]

A deep MLP (8 x Linear 1024-1024 + ReLU, then Linear 1024-10; equal layers, so the balanced split
gives equal stages), global batch 256, split into S=2 stages (one process and one thread each, the
2 cores of the machine). For each M, every step starts after a barrier and ends with the loss
all-reduce, so all stages share one window (optimizer step excluded); each stage records the part
of it spent in forward and backward (``PipelineStrategy(record_times=True)``); idle =
1 - compute / window, the median over ``steps`` steps after 2 warm-up steps. The bound assumes
equal stage times and free communication; measured idle also contains transfers and imbalance.

A second table, at M=8: the peak bytes saved for backward alive at once on each stage (counted by
``spread.memory.SavedTensorBytes`` per micro-batch forward, parameters excluded: deterministic),
for each schedule without and with per-stage activation checkpointing (zero bubble without only:
``PipelineStrategy`` refuses it with checkpointing), and the step time
(off, on, off, on, so that load drifts hit both alike).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from spread.memory import checkpoint_stage, remove_checkpointing
from spread.pipeline import gpipe_bubble_bound
from spread.testing import run_ranks


def worker(
    schedules: list[str], microbatches: list[int], width: int, depth: int, batch: int, steps: int
) -> dict:
    torch.set_num_threads(1)
    import spread

    strategy = spread.PipelineStrategy(stages=2, microbatches=1, record_times=True, balance_by="params")
    out = {}
    try:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = strategy.prepare_model(nn.Sequential(*layers, nn.Linear(width, 10)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        loss_fn = nn.CrossEntropyLoss()
        for schedule in schedules:
            for m in microbatches:
                strategy.schedule, strategy.microbatches = schedule, m
                idle, step_time = [], []
                for i in range(steps + 2):
                    optimizer.zero_grad(set_to_none=True)
                    strategy.world.barrier()  # every stage starts the step together
                    started = time.perf_counter()
                    strategy.train_step(model, x, y, loss_fn)  # ends in an all-reduce: together again
                    span = time.perf_counter() - started
                    optimizer.step()
                    if i >= 2:
                        idle.append(1.0 - strategy.last_step_times.compute / span)
                        step_time.append(span)
                out[(schedule, m)] = (statistics.median(idle), statistics.median(step_time))
        memory: dict = {}
        for schedule in schedules:  # activation memory at M=8: the schedules, with and without checkpointing
            strategy.schedule, strategy.microbatches = schedule, 8
            # Off, on, off, on: load drifts hit both alike; each median over steps, then over the pair.
            for checkpointed in (False, True, False, True):
                if checkpointed and schedule == "zb":
                    continue  # refused by PipelineStrategy: one recomputation per module's weight pass
                if checkpointed:
                    checkpoint_stage(strategy.stage_module)
                spans = []
                for _ in range(steps + 2):
                    optimizer.zero_grad(set_to_none=True)
                    strategy.world.barrier()
                    started = time.perf_counter()
                    strategy.train_step(model, x, y, loss_fn)
                    spans.append(time.perf_counter() - started)
                    optimizer.step()
                remove_checkpointing(strategy.stage_module)
                peak = strategy.last_step_times.peak_saved_bytes
                _, medians = memory.get((schedule, checkpointed), (0, []))
                memory[(schedule, checkpointed)] = (peak, [*medians, statistics.median(spans[2:])])
        memory = {k: (peak, statistics.median(m)) for k, (peak, m) in memory.items()}
        return {"stage": strategy.stage, "results": out, "memory": memory, "bounds": strategy.stage_bounds}
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedules", default="gpipe,1f1b")
    parser.add_argument("--microbatches", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a tiny model: a smoke test, not a measurement")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    ms = [int(m) for m in args.microbatches.split(",")]
    width, depth, batch = (64, 4, 32) if args.quick else (1024, 8, 256)
    per_rank = run_ranks(
        worker, 2, args=(schedules, ms, width, depth, batch, args.steps), timeout=1800, collective_timeout=300
    )
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; deep MLP {depth}x{width}, batch {batch}, S=2, "
        f"split {per_rank[0]['bounds']}"
    )
    print("| schedule | M | bound (S-1)/(M+S-1) | idle stage 0 | idle stage 1 | step time (ms) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for schedule in schedules:
        for m in ms:
            idle = [r["results"][(schedule, m)][0] for r in per_rank]
            step_ms = 1000 * max(r["results"][(schedule, m)][1] for r in per_rank)
            bound = gpipe_bubble_bound(2, m)
            print(f"| {schedule} | {m} | {bound:.3f} | {idle[0]:.3f} | {idle[1]:.3f} | {step_ms:.0f} |")
    print("\nActivation memory at M=8: peak bytes saved for backward alive at once on each stage")
    print("| schedule | stage checkpointing | stage 0 (MiB) | stage 1 (MiB) | step time (ms) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for schedule in schedules:
        for checkpointed in (False, True) if schedule != "zb" else (False,):
            peaks = [r["memory"][(schedule, checkpointed)][0] / 2**20 for r in per_rank]
            step_ms = 1000 * max(r["memory"][(schedule, checkpointed)][1] for r in per_rank)
            on = "yes" if checkpointed else "no"
            print(f"| {schedule} | {on} | {peaks[0]:.2f} | {peaks[1]:.2f} | {step_ms:.0f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
