"""Pipeline throughput: spread's PipelineStrategy (S=2) vs one process vs torch.distributed.pipelining.

    flock /tmp/spread-bench.lock python benchmarks/pipeline_speed.py [--workloads mlp,w2]
        [--rounds 4] [--microbatches 4 | 2,4] [--reps 5] [--steps 3] [--bind spread|both|none] [--quick]
        [--spread-schedules gpipe,1f1b,zb]

Workloads (``benchmarks/block_workloads.py`` for W2, so both pipelines split the same
``nn.Sequential``):

* ``mlp``: a deep MLP, 8 x (Linear 1024-1024 + ReLU) + Linear 1024-10, SGD, global batch 256;
* ``w2``: the GPT decoder of DESIGN.md as [embedding, 4 blocks, LM head], AdamW, 16 sequences of 128
  tokens (throughput in tokens/s).

Configurations, all in this one run, each a fresh set of processes on loopback (gloo), 1 thread per
pipeline stage (2 stages = the 2 cores):

* one process with 1 thread and with 2 threads (the reference);
* spread ``PipelineStrategy(stages=2, microbatches=M)``, GPipe, 1F1B and zero bubble (``zb``),
  balanced by measured time (``--spread-schedules`` picks; ``zb``'s "same schedule" column is
  torch's Schedule1F1B, the schedule it improves on: torch's zero-bubble schedules need several
  stages per process, a different model split);
* ``torch.distributed.pipelining`` ``ScheduleGPipe`` and ``Schedule1F1B`` on the same model, split
  (a) by layer count (half the ``nn.Sequential`` entries per stage, the split a user writes by hand)
  and (b) at spread's balanced split (same work per stage: isolates the runtimes).

Several M (``--microbatches 2,4``): every pipeline configuration once per M (keys ``...@M``), a
table per M, then a table of each runtime and schedule at its own best M (the highest median rate),
with paired ratios against torch's schedules at theirs: a user tunes M for the runtime they use.

CPU binding (``--bind``): spread binds each stage process to its own CPU by default
(``PipelineStrategy(bind_cpus=True)``, see ``spread.pipeline.affinity``); torch does not. ``spread``
(default) measures both as they come; ``both`` also binds torch's stage processes the same way (to
see how much of the difference is the binding); ``none`` turns spread's binding off.

Each configuration: 2 warm-up steps, then ``reps`` timed repetitions of ``steps`` steps (barrier
before and after; process start-up and partitioning stay outside the timed part).

Interleaved rounds (``--rounds R``): this VM's speed drifts by 20-45% within minutes, so measuring
each configuration in one block, one after the other, ranks whichever ran in a fast minute. Instead,
in each of ``R`` rounds every configuration runs once, in an order that rotates (and reverses every
other round) so that each one runs early, late and next to different neighbours. Reported per
configuration: the median rate over all its timed repetitions of all rounds (min..max), and its
ratios to torch's schedules as *paired* ratios: per round, the configuration's median repetition over
the torch configuration's median repetition *of the same round*, then the median (min..max) over the
rounds. Drift between rounds cancels in the pairing; drift within a round only where neighbours differ.

torch's rows "at spread's split" use the split spread's partitioner picks, computed once in this
process before the rounds (``spread.pipeline.partition``, 1 thread, on the first micro-batch, as
rank 0 does); spread's own runs measure their split anew each time, and the table shows every split
they chose.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import block_workloads

from spread.cli._bench_report import round_ratios
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


@dataclass
class Config:
    """One configuration of the comparison and everything measured for it, round by round."""

    key: str  # short name the ratios refer to
    label: str
    measure: Callable[[], dict]  # runs it once: {"times": [...], "note": ... (spread only)}
    rates: list[list[float]] = field(default_factory=list)  # per round, per repetition
    notes: list[str] = field(default_factory=list)  # spread only: the split and binding of each run


def round_order(n: int, r: int, rounds: int) -> list[int]:
    """Configuration indices for round ``r``: rotated by ``r * n / rounds`` so each configuration
    takes evenly spaced positions over the rounds, reversed in odd rounds so neighbours change."""
    offset = (r * n) // max(rounds, 1)
    order = [(i + offset) % n for i in range(n)]
    return order[::-1] if r % 2 else order


def paired_ratio(config: Config, reference: Config) -> tuple[float, float, float]:
    """Median (min, max) over rounds of the two configurations' same-round median rates' ratio."""
    ratios = sorted(round_ratios(config.rates, reference.rates))
    return statistics.median(ratios), ratios[0], ratios[-1]


def spread_split(name: str, microbatches: int, quick: bool) -> int:
    """The split spread's partitioner picks (first layer of stage 1), measured here with 1 thread."""
    from spread.pipeline import partition

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _, _, x, _, _, _ = make_workload(name, quick)
        bounds = partition(list(model), 2, sample=torch.tensor_split(x, microbatches)[0])
    finally:
        torch.set_num_threads(threads)
    return bounds[0][1]


def build_configs(name: str, args: argparse.Namespace) -> list[Config]:
    """Every configuration of one workload, as closures that run it once in fresh processes.

    With several ``--microbatches`` values every pipeline configuration exists once per M, its key
    suffixed ``@M`` (the reference one-process rows once)."""
    model = make_workload(name, args.quick)[0]
    spread_bind, bind_t = args.bind != "none", args.bind == "both"
    common = dict(timeout=900, init_timeout=120, collective_timeout=300)
    timing = (args.quick, args.steps, args.reps)
    configs = [
        Config(f"one{t}", f"one process, {t} thread(s)", lambda t=t: {"times": one_process(name, t, *timing)})
        for t in (1, 2)
    ]
    several = len(args.microbatches) > 1
    for m in args.microbatches:
        at, with_m = (f"@{m}", f", M={m}") if several else ("", "")
        for schedule in args.spread_schedules.split(","):

            def run_spread(schedule: str = schedule, m: int = m) -> dict:
                wargs = (name, schedule, m, *timing, spread_bind)
                out = run_ranks(spread_worker, 2, args=wargs, **common)[0]
                bound = "bound" if out["cpus"] is not None else "unbound"
                return {"times": out["times"], "note": f"{_split(out['bounds'][0][1], model)}, {bound}"}

            configs.append(
                Config(f"spread-{schedule}{at}", f"spread PipelineStrategy {schedule}{with_m}", run_spread)
            )
        balanced, by_count = spread_split(name, m, args.quick), len(model) // 2
        for schedule, cls in (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")):
            for split, how, tag in (
                (by_count, "layer count", "count"),
                (balanced, "spread's split", "spread"),
            ):

                def run_torch(schedule: str = schedule, split: int = split, m: int = m) -> dict:
                    wargs = (name, schedule, m, split, *timing, bind_t)
                    return run_ranks(torch_worker, 2, args=wargs, **common)[0]

                label = f"torch.distributed.pipelining {cls}{with_m}, {_split(split, model)} ({how})"
                configs.append(
                    Config(f"torch-{schedule}-{tag}{at}", label + (", bound" if bind_t else ""), run_torch)
                )
    return configs


def run_rounds(configs: list[Config], rounds: int, samples: int) -> None:
    """Run every configuration once per round, in :func:`round_order`, recording rates per round."""
    for r in range(rounds):
        order = round_order(len(configs), r, rounds)
        print(f"# round {r + 1}/{rounds}: {' '.join(configs[i].key for i in order)}", flush=True)
        for i in order:
            config = configs[i]
            torch.set_num_threads(os.cpu_count() or 1)
            out = config.measure()
            config.rates.append([samples / t for t in out["times"]])
            if "note" in out:
                config.notes.append(out["note"])


def _count_notes(notes: list[str]) -> list[str]:
    """``["split 8/9, bound"]`` when every run agreed, else each note with its count of runs."""
    counts = Counter(notes)
    if len(counts) == 1:
        return list(counts)
    return [f"{note} ({n} of {len(notes)} runs)" for note, n in sorted(counts.items())]


def _ratio_cell(config: Config, reference: Config | None) -> str:
    if reference is None:
        return ""
    med, lo, hi = paired_ratio(config, reference)
    return f"{med:.2f}x ({lo:.2f}..{hi:.2f})"


def report(name: str, unit: str, configs: list[Config], args: argparse.Namespace) -> None:
    """The table: rates over all rounds, and paired ratios to torch's schedules (layer-count split)
    and, for spread's rows, to torch's same schedule at the same split (zb: torch's 1F1B). With
    several M: one table per M, then each runtime and schedule at its own best M."""
    rounds = len(configs[0].rates)
    print(
        f"\n## {name}: {unit}, median (min..max) of {rounds} rounds x {args.reps} reps; ratios: median "
        f"(min..max) over rounds of same-round ratios"
    )
    several = len(args.microbatches) > 1
    for m in args.microbatches:
        at = f"@{m}" if several else ""
        here = [c for c in configs if c.key.startswith("one") or c.key.endswith(at)] if at else configs
        if several:
            print(f"\n### M={m}")
        _table(unit, here, at)
    if several:
        _best_m_table(unit, configs, args.microbatches)
    sys.stdout.flush()


def _table(unit: str, configs: list[Config], at: str) -> None:
    """One M's rows; ``at`` is that M's key suffix (``"@4"``, or ``""`` with a single M)."""
    by_key = {c.key.removesuffix(at): c for c in configs}
    print(
        f"| configuration | {unit} | vs torch GPipe (layer count) | vs torch 1F1B (layer count) | "
        "vs torch same schedule at spread's split |\n| --- | ---: | ---: | ---: | ---: |"
    )
    for config in configs:
        rates = sorted(x for per_round in config.rates for x in per_round)
        label = ", ".join([config.label, *_count_notes(config.notes)])
        key = config.key.removesuffix(at)
        same = None
        if key.startswith("spread-"):
            schedule = key.removeprefix("spread-")
            same = by_key[f"torch-{'1f1b' if schedule == 'zb' else schedule}-spread"]
        print(
            f"| {label} | {statistics.median(rates):,.0f} ({rates[0]:,.0f}..{rates[-1]:,.0f}) | "
            f"{_ratio_cell(config, by_key['torch-gpipe-count'])} | "
            f"{_ratio_cell(config, by_key['torch-1f1b-count'])} | {_ratio_cell(config, same)} |"
        )


def best_m(configs: list[Config], base: str, ms: list[int]) -> Config:
    """Of ``base@M`` for every M, the configuration with the highest median rate over all rounds."""
    runs = [next(c for c in configs if c.key == f"{base}@{m}") for m in ms]
    return max(runs, key=lambda c: statistics.median(x for per_round in c.rates for x in per_round))


def _best_m_table(unit: str, configs: list[Config], ms: list[int]) -> None:
    """A user tunes M for the runtime they use: compare each at its own best M (paired ratios)."""
    torch_gpipe, torch_1f1b = (
        best_m(configs, "torch-gpipe-count", ms),
        best_m(configs, "torch-1f1b-count", ms),
    )
    m_gpipe, m_1f1b = torch_gpipe.key.split("@")[1], torch_1f1b.key.split("@")[1]
    print(
        f"\n### Each at its best M (of {', '.join(map(str, ms))}); torch with the layer-count split: "
        f"ScheduleGPipe at M={m_gpipe}, Schedule1F1B at M={m_1f1b}"
    )
    print(f"| configuration | best M | {unit} | vs torch GPipe at its best M | vs torch 1F1B at its best M |")
    print("| --- | ---: | ---: | ---: | ---: |")
    bases = dict.fromkeys(c.key.split("@")[0] for c in configs if "@" in c.key)
    for base in bases:
        if not (base.startswith("spread-") or base.endswith("-count")):
            continue
        best = best_m(configs, base, ms)
        rate = statistics.median(x for per_round in best.rates for x in per_round)
        print(
            f"| {base} | {best.key.split('@')[1]} | {rate:,.0f} | {_ratio_cell(best, torch_gpipe)} | "
            f"{_ratio_cell(best, torch_1f1b)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="mlp,w2")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds of every configuration")
    parser.add_argument(
        "--microbatches",
        type=lambda text: [int(m) for m in text.split(",")],
        default=[4],
        help="M, or several (2,4): every pipeline configuration at each, plus each at its best M",
    )
    parser.add_argument("--spread-schedules", default="gpipe,1f1b,zb", help="spread's schedules to run")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per configuration and round")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repetition")
    parser.add_argument(
        "--bind", choices=("spread", "both", "none"), default="spread", help="which stages bind CPUs"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke test, not a measurement")
    args = parser.parse_args()
    if args.rounds < 1 or args.reps < 1 or args.steps < 1:
        parser.error("--rounds, --reps and --steps must be at least 1")
    print(
        f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, M={args.microbatches}, rounds={args.rounds}, steps={args.steps}, "
        f"reps={args.reps}, bind={args.bind}"
    )
    for name in args.workloads.split(","):
        _, _, _, x, _, per_sample, unit = make_workload(name, args.quick)
        configs = build_configs(name, args)
        run_rounds(configs, args.rounds, args.steps * x.shape[0] * per_sample)
        report(name, unit, configs, args)


if __name__ == "__main__":
    main()
