"""W1 (dense MLP 784-2048-2048-10, global batch 512, SGD): spread's synchronous strategies vs
PyTorch DDP and one process, all in the same run.

    python benchmarks/w1_sync.py [--reps 7] [--steps 5]

Each configuration: 3 warm-up steps, then ``reps`` timed repetitions of ``steps`` steps; the table
gives samples/s median, min and max, the ratio to DDP x2 and the scaling efficiency
(throughput / (replicas x one-process-one-thread throughput)). Synthetic data made before timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn

GLOBAL_BATCH = 512


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)


def _time_steps(step, reps: int, steps: int) -> list[float]:
    for _ in range(3):
        step()
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(GLOBAL_BATCH * steps / (time.perf_counter() - start))
    return rates


def _plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """One plain PyTorch training step (forward, backward, SGD update) as a closure."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def single(threads: int, reps: int, steps: int) -> list[float]:
    torch.set_num_threads(threads)
    return _time_steps(_plain_step(_model(), *_data(GLOBAL_BATCH)), reps, steps)


def _ddp_rank(reps: int, steps: int) -> list[float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from spread.cluster import resolve_cluster
    from spread.cluster.rendezvous import rendezvous

    torch.set_num_threads(1)
    rdzv = rendezvous(resolve_cluster())
    model = DistributedDataParallel(_model())
    x, y = _data(GLOBAL_BATCH)
    per = GLOBAL_BATCH // dist.get_world_size()
    x, y = x[rdzv.rank * per : (rdzv.rank + 1) * per], y[rdzv.rank * per : (rdzv.rank + 1) * per]
    try:
        return _time_steps(_plain_step(model, x, y), reps, steps)
    finally:
        rdzv.close()


def _spread_step(strategy, reps: int, steps: int) -> list[float]:
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(_data(GLOBAL_BATCH), GLOBAL_BATCH, shuffle=False)
    batch = next(iter(dataset))

    def replica_step(x, y):
        loss_fn(model(x), y).backward()

    def step():
        opt.zero_grad()
        strategy.run(replica_step, args=batch)
        opt.step()

    return _time_steps(step, reps, steps)


def _mwms_rank(reps: int, steps: int, bucket_cap_mb: float) -> list[float]:
    import spread

    torch.set_num_threads(1)
    strategy = spread.MultiWorkerMirroredStrategy(bucket_cap_mb=bucket_cap_mb)
    try:
        return _spread_step(strategy, reps, steps)
    finally:
        strategy.close()


def mirrored(replicas: int, reps: int, steps: int) -> list[float]:
    import spread

    strategy = spread.MirroredStrategy(num_replicas=replicas, intra_op_threads=1)
    try:
        return _spread_step(strategy, reps, steps)
    finally:
        strategy.close()


def main() -> None:
    from spread.testing import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--bucket-cap-mb", type=float, nargs="+", default=[25.0], help="MWMS bucket sizes to try"
    )
    args = parser.parse_args()
    r, s = args.reps, args.steps
    rows = {
        "one process, 1 thread": (1, single(1, r, s)),
        "one process, 2 threads": (1, single(2, r, s)),
        "PyTorch DDP 2 x 1 thread": (2, run_ranks(_ddp_rank, 2, args=(r, s), timeout=600)[0]),
        **{
            f"spread MultiWorkerMirrored 2 x 1 thread, buckets {cap:g} MB": (
                2,
                run_ranks(_mwms_rank, 2, args=(r, s, cap), timeout=600)[0],
            )
            for cap in args.bucket_cap_mb
        },
        "spread Mirrored 2 replicas (threads), 1 process": (2, mirrored(2, r, s)),
    }
    base = statistics.median(rows["one process, 1 thread"][1])
    ddp = statistics.median(rows["PyTorch DDP 2 x 1 thread"][1])
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpu(s), python {platform.python_version()}, "
        f"torch {torch.__version__}; W1 global batch {GLOBAL_BATCH}; {r} reps x {s} steps after 3 warm-up"
    )
    print("| configuration | samples/s median | min | max | vs DDP | scaling efficiency |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (replicas, rates) in rows.items():
        med = statistics.median(rates)
        print(
            f"| {name} | {med:,.0f} | {min(rates):,.0f} | {max(rates):,.0f} | {med / ddp:.2f}x | "
            f"{med / (replicas * base):.2f} |"
        )


if __name__ == "__main__":
    main()
