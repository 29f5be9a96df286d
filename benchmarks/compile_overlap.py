"""When gradients become ready under ``torch.compile``, and what that does to a 2-process MWMS step.

    python benchmarks/compile_overlap.py [--workloads W1,W2] [--bucket-cap-mb 25,4] [--reps 5]
        [--steps 3] [--communication native] [--quick] [--no-step-times]

Part 1 (this process): for each workload (``benchmarks/workloads.py``), the fraction of ``backward()``
elapsed when the first parameter's gradient is ready and when the reducer's first bucket is complete
(every parameter of it ready: the moment its all-reduce can start), median of ``--reps`` after warm-up,
for three ways to run the model: ``eager``; ``compiled`` (``torch.compile``, one graph); ``cut``
(``torch.compile`` with the graph compiled inside ``spread.comm.compiled.bucket_graph_breaks``, what
``MultiWorkerMirroredStrategy.run`` does).

Part 2 (two processes, ``spread.testing.run_ranks``): ``MultiWorkerMirroredStrategy`` step time
(``zero_grad``, ``run`` of forward and backward, ``optimizer.step``) for the same three, one strategy
(so one reducer) per model, ``compiled`` with ``torch._dynamo.config.optimize_ddp = False`` (the
switch spread's cut honours), measured in interleaved rounds (this VM drifts); the ratio to eager is
taken per round, then the median. ``--communication`` (default ``native``: gloo's all-reduce runs
while backward computes) picks the algorithm; the strategy cuts only where the exchange can overlap
(several buckets, not ``shm``), so ``cut`` equals ``compiled`` elsewhere (the "bwd nodes" column says
which happened).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads

import spread
from spread.comm.bucketing import _make_buckets
from spread.comm.compiled import bucket_graph_breaks
from spread.testing import run_ranks

MODES = ("eager", "compiled", "cut")


def compiled_backward_nodes(loss: torch.Tensor) -> int:
    seen, stack, count = set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            count += "CompiledFunctionBackward" in node.name()
            stack.extend(n for n, _ in node.next_functions)
    return count


def readiness(name: str, mode: str, cap_mb: float, reps: int, quick: bool) -> dict:
    """Fractions of backward at which the first gradient and the first bucket are ready."""
    torch._dynamo.reset()
    model, loss_fn, _, make_batch, global_batch = workloads.make(name, quick=quick)
    params = [p for p in model.parameters() if p.requires_grad]
    first_bucket = {id(p) for p in _make_buckets(params, int(cap_mb * 2**20))[0].params}
    ready: dict[int, float] = {}

    def note(p: torch.Tensor) -> None:  # a post-accumulate hook must return None
        ready.setdefault(id(p), time.perf_counter())

    for p in params:
        p.register_post_accumulate_grad_hook(note)
    run = model if mode == "eager" else torch.compile(model)
    x, y = make_batch(global_batch // 2)  # one of two replicas' share
    firsts, buckets, nodes = [], [], 0
    for i in range(reps + 2):
        ready.clear()
        model.zero_grad(set_to_none=True)
        if mode == "cut":
            with bucket_graph_breaks(int(cap_mb * 2**20)):
                loss = loss_fn(run(x), y)
        else:
            loss = loss_fn(run(x), y)
        nodes = compiled_backward_nodes(loss)
        t0 = time.perf_counter()
        loss.backward()
        total = time.perf_counter() - t0
        if i >= 2:  # warm-up: compilation, allocator
            firsts.append((min(ready.values()) - t0) / total)
            buckets.append((max(ready[k] for k in first_bucket) - t0) / total)
    return {
        "first_grad": statistics.median(firsts),
        "first_bucket": statistics.median(buckets),
        "nodes": nodes,
        "buckets": len(_make_buckets(params, int(cap_mb * 2**20))),
    }


def _step_worker(name: str, cap_mb: float, communication: str, reps: int, steps: int, quick: bool) -> dict:
    strategies, runs = {}, {}
    for mode in MODES:  # one strategy (one reducer) per model, so no bucket waits for another model
        strategy = spread.MultiWorkerMirroredStrategy(communication, bucket_cap_mb=cap_mb)
        with strategy.scope():
            model, loss_fn, make_optimizer, make_batch, global_batch = workloads.make(name, quick=quick)
            optimizer = make_optimizer(model.parameters())
        # Dynamo's guards do not tell two instances of one class apart: without a class of its own,
        # the second compiled model would reuse the first one's graph (cut or not).
        model.__class__ = type(f"{type(model).__name__}_{mode}", (type(model),), {})
        run = model if mode == "eager" else torch.compile(model)
        x, y = make_batch(global_batch // strategy.num_replicas_in_sync)

        def step(run=run, loss_fn=loss_fn, x=x, y=y, optimizer=optimizer, strategy=strategy) -> int:
            optimizer.zero_grad(set_to_none=True)

            def replica() -> int:
                loss = loss_fn(run(x), y)
                nodes = compiled_backward_nodes(loss)
                loss.backward()
                return nodes

            nodes = strategy.run(replica)
            optimizer.step()
            return nodes

        torch._dynamo.config.optimize_ddp = mode != "compiled"
        try:
            nodes = [step() for _ in range(2)][-1]  # compiles here
        finally:
            torch._dynamo.config.optimize_ddp = True
        strategies[mode], runs[mode] = strategy, (step, nodes)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(reps):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            step = runs[mode][0]
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            times[mode].append((time.perf_counter() - t0) / steps)
    for mode in reversed(MODES):
        strategies[mode].close()
    return {"times": times, "nodes": {m: runs[m][1] for m in MODES}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--bucket-cap-mb", default="25,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--communication", default="native", help="MultiWorkerMirroredStrategy's algorithm")
    ap.add_argument("--quick", action="store_true", help="tiny models: a smoke test, meaningless numbers")
    ap.add_argument("--no-step-times", action="store_true", help="part 1 only")
    a = ap.parse_args()
    names = a.workloads.split(",")
    caps = [float(c) for c in a.bucket_cap_mb.split(",")]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads")
    print(
        "\n| workload | bucket cap MB | buckets | mode | compiled bwd nodes | first grad ready "
        "| first bucket ready |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        for cap in caps:
            for mode in MODES:
                r = readiness(name, mode, cap, a.reps, a.quick)
                print(
                    f"| {name} | {cap:g} | {r['buckets']} | {mode} | {r['nodes']} | "
                    f"{r['first_grad']:.0%} | {r['first_bucket']:.0%} |",
                    flush=True,
                )
    if a.no_step_times:
        return
    print(f"\nMultiWorkerMirroredStrategy({a.communication!r}), 2 processes")
    print("\n| workload | bucket cap MB | mode | bwd nodes | step ms (median) | vs eager (paired median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        for cap in caps:
            job = (name, cap, a.communication, a.reps, a.steps, a.quick)
            per_rank = run_ranks(_step_worker, 2, args=job, timeout=1800)
            got = per_rank[0]
            times = got["times"]
            for mode in MODES:
                ratio = statistics.median(t / e for t, e in zip(times[mode], times["eager"], strict=True))
                print(
                    f"| {name} | {cap:g} | {mode} | {got['nodes'][mode]} | "
                    f"{statistics.median(times[mode]) * 1e3:.1f} | {ratio:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
