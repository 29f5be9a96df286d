"""Pipeline throughput: spread's PipelineStrategy (S=2) vs one process vs torch.distributed.pipelining.

    flock /tmp/spread-bench.lock python benchmarks/pipeline_speed.py [--workloads mlp,w2]
        [--microbatches 4] [--reps 5] [--steps 3] [--bind spread|both|none] [--quick]

Workloads (``benchmarks/block_workloads.py`` for W2, so both pipelines split the same
``nn.Sequential``):

* ``mlp``: a deep MLP, 8 x (Linear 1024-1024 + ReLU) + Linear 1024-10, SGD, global batch 256;
* ``w2``: the GPT decoder of DESIGN.md as [embedding, 4 blocks, LM head], AdamW, 16 sequences of 128
  tokens (throughput in tokens/s).

Configurations, all in this one run, each a fresh set of processes on loopback (gloo), 1 thread per
pipeline stage (2 stages = the 2 cores):

* one process with 1 thread and with 2 threads (the reference);
* spread ``PipelineStrategy(stages=2, microbatches=M)``, GPipe and 1F1B, balanced by measured time;
* ``torch.distributed.pipelining`` ``ScheduleGPipe`` and ``Schedule1F1B`` on the same model, split
  (a) by layer count (half the ``nn.Sequential`` entries per stage, the split a user writes by hand)
  and (b) at spread's balanced split (same work per stage: isolates the runtimes).

CPU binding (``--bind``): spread binds each stage process to its own CPU by default
(``PipelineStrategy(bind_cpus=True)``, see ``spread.pipeline.affinity``); torch does not. ``spread``
(default) measures both as they come; ``both`` also binds torch's stage processes the same way (to
see how much of the difference is the binding); ``none`` turns spread's binding off.

Each configuration: 2 warm-up steps, then ``reps`` timed repetitions of ``steps`` steps (barrier
before and after); the median repetition is reported with the spread (min..max) and the ratio to
torch's ScheduleGPipe with the layer-count split.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import block_workloads

from spread.testing import run_ranks


def make_workload(name: str, quick: bool):
    """``(model, loss_fn, make_optimizer, inputs, targets, units_per_sample, unit)``."""
    torch.manual_seed(0)
    if name == "mlp":
        width, depth, batch = (64, 4, 32) if quick else (1024, 8, 256)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(width, 10))
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)
        return model, nn.CrossEntropyLoss(), lambda p: torch.optim.SGD(p, lr=0.01), x, y, 1, "samples/s"
    if name == "w2":
        if quick:
            model, loss, opt, batch, n = block_workloads.w2(layers=2, dim=32, heads=2, seq=16, vocab=256)
            n = 4
        else:
            model, loss, opt, batch, n = block_workloads.w2()
        x, y = batch(n)
        return model, loss, opt, x, y, x.shape[1], "tokens/s"
    raise ValueError(f"unknown workload {name!r}")


def _timed(step, steps: int, reps: int, barrier=lambda: None) -> list[float]:
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        barrier()
        times.append(time.perf_counter() - t0)
    return times


def one_process(name: str, threads: int, quick: bool, steps: int, reps: int) -> list[float]:
    torch.set_num_threads(threads)
    model, loss_fn, make_opt, x, y, _, _ = make_workload(name, quick)
    optimizer = make_opt(model.parameters())

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    return _timed(step, steps, reps)


def spread_worker(name: str, schedule: str, m: int, quick: bool, steps: int, reps: int, bind: bool) -> dict:
    torch.set_num_threads(1)
    import spread

    strategy = spread.PipelineStrategy(stages=2, microbatches=m, schedule=schedule, bind_cpus=bind)
    try:
        model, loss_fn, make_opt, x, y, _, _ = make_workload(name, quick)
        strategy.prepare_model(model)
        optimizer = make_opt(model.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            strategy.train_step(model, x, y, loss_fn)
            optimizer.step()

        times = _timed(step, steps, reps, strategy.world.barrier)
        binding = strategy.cpu_binding
        return {"times": times, "bounds": strategy.stage_bounds, "cpus": binding.cpus if binding else None}
    finally:
        strategy.close()


def torch_worker(
    name: str, schedule: str, m: int, split: int, quick: bool, steps: int, reps: int, bind: bool
) -> dict:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from spread.cluster import resolve_cluster
    from spread.cluster.rendezvous import rendezvous
    from spread.pipeline.affinity import bind_local_cpus

    cluster = resolve_cluster()
    if bind:  # the same binding spread's stages get, before the transport threads start
        bind_local_cpus(cluster.local_rank, cluster.local_world_size)
    rdv = rendezvous(cluster)
    try:
        rank = dist.get_rank()
        model, loss_fn, make_opt, x, y, _, _ = make_workload(name, quick)
        layers = list(model)
        sub = nn.Sequential(*(layers[:split] if rank == 0 else layers[split:]))
        stage = PipelineStage(sub, stage_index=rank, num_stages=2, device=torch.device("cpu"))
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stage, n_microbatches=m, loss_fn=loss_fn)
        optimizer = make_opt(sub.parameters())

        def step():
            optimizer.zero_grad(set_to_none=True)
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            optimizer.step()

        return {"times": _timed(step, steps, reps, dist.barrier)}
    finally:
        rdv.close()


def _split(first: int, model: nn.Module) -> str:
    return f"split {first}/{len(model) - first}"


def summarise(times: list[float], samples: int) -> tuple[float, float, float]:
    rates = sorted(samples / t for t in times)
    return statistics.median(rates), rates[0], rates[-1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="mlp,w2")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--bind", choices=("spread", "both", "none"), default="spread", help="which stages bind CPUs"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke test, not a measurement")
    args = parser.parse_args()
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, M={args.microbatches}, steps={args.steps}, reps={args.reps}, "
        f"bind={args.bind}"
    )
    spread_bind, bind_t = args.bind != "none", args.bind == "both"
    common = dict(timeout=900, init_timeout=120, collective_timeout=300)
    for name in args.workloads.split(","):
        model, _, _, x, _, per_sample, unit = make_workload(name, args.quick)
        samples = args.steps * x.shape[0] * per_sample
        rows: list[tuple[str, list[float]]] = []
        for threads in (1, 2):
            rows.append(
                (
                    f"one process, {threads} thread(s)",
                    one_process(name, threads, args.quick, args.steps, args.reps),
                )
            )
        torch.set_num_threads(os.cpu_count() or 1)
        balanced = None
        for schedule in ("gpipe", "1f1b"):
            out = run_ranks(
                spread_worker,
                2,
                args=(name, schedule, args.microbatches, args.quick, args.steps, args.reps, spread_bind),
                **common,
            )
            balanced = out[0]["bounds"]
            bound = "bound" if out[0]["cpus"] is not None else "unbound"
            rows.append(
                (
                    f"spread PipelineStrategy {schedule}, {_split(balanced[0][1], model)}, {bound}",
                    out[0]["times"],
                )
            )
        by_count = len(model) // 2
        for schedule, label in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")):
            for split, how in ((by_count, "layer count"), (balanced[0][1], "spread's split")):
                out = run_ranks(
                    torch_worker,
                    2,
                    args=(
                        name,
                        schedule,
                        args.microbatches,
                        split,
                        args.quick,
                        args.steps,
                        args.reps,
                        bind_t,
                    ),
                    **common,
                )
                bound = ", bound" if bind_t else ""
                rows.append(
                    (
                        f"torch.distributed.pipelining {label}, {_split(split, model)} ({how}){bound}",
                        out[0]["times"],
                    )
                )
        reference = dict(rows)[
            f"torch.distributed.pipelining ScheduleGPipe, {_split(by_count, model)} (layer count)"
            + (", bound" if bind_t else "")
        ]
        ref_rate = summarise(reference, samples)[0]
        print(f"\n## {name}: {unit}, median (min..max) of {args.reps} reps")
        print("ratio: against torch's ScheduleGPipe with the layer-count split")
        print(f"| configuration | {unit} | ratio |\n| --- | ---: | ---: |")
        for label, times in rows:
            med, lo, hi = summarise(times, samples)
            print(f"| {label} | {med:,.0f} ({lo:,.0f}..{hi:,.0f}) | {med / ref_rate:.2f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
