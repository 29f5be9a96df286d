"""What keeping BatchNorm in sync costs: a small ResNet-like CNN under MultiWorkerMirroredStrategy.

Per training step (2 local processes, one intra-op thread each, CIFAR-sized inputs), rank 0's
median over interleaved rounds of:

* ``step``: a training step with the default buffer averaging (which the step includes);
* ``step sync_batchnorm``: the same with ``sync_batchnorm=True`` (two small all-reduces per
  BatchNorm layer and step, inside forward and backward);
* ``buffer average``: :class:`spread.comm.buffers.BufferAverager.sync` alone over the model's
  buffers (what the default adds to each step);
* ``buffer broadcast``: a flat broadcast of the same buffers from rank 0 (what DDP's
  ``broadcast_buffers`` does before each forward), for comparison.

    python benchmarks/batchnorm_sync.py [--rounds 7] [--steps 10] [--batch 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import spread
from spread.comm.buffers import BufferAverager
from spread.testing import run_ranks


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet_like() -> nn.Module:
    """ResNet-8-like: stem, three stages of one basic block (16, 32, 64 channels), 10 classes."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        Block(16, 16, 1),
        Block(16, 32, 2),
        Block(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def _rank(rounds: int, steps: int, batch: int) -> dict:
    torch.set_num_threads(1)
    owner = spread.MultiWorkerMirroredStrategy()
    synced = spread.MultiWorkerMirroredStrategy(sync_batchnorm=True)
    try:
        g = torch.Generator().manual_seed(1)
        n = batch * steps
        data = (torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
        loss_fn = nn.CrossEntropyLoss()
        setups = {}
        for label, strategy in (("step", owner), ("step sync_batchnorm", synced)):
            with strategy.scope():
                model = resnet_like()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            setups[label] = (strategy, model, optimizer)
        buffers = list(setups["step"][1].buffers())
        averager = BufferAverager(buffers, owner.collectives)
        times: dict[str, list[float]] = {k: [] for k in [*setups, "buffer average", "buffer broadcast"]}

        def train(strategy, model, optimizer) -> None:
            def step_fn(x, y):
                loss_fn(model(x), y).backward()

            for x, y in strategy.distribute_dataset(data, batch, shuffle=False, prefetch=0):
                optimizer.zero_grad()
                strategy.run(step_fn, args=(x, y))
                optimizer.step()

        for setup in setups.values():  # warm-up
            train(*setup)
        for r in range(rounds):
            order = list(setups) if r % 2 == 0 else list(reversed(setups))
            for label in order:
                owner.collectives.barrier()
                start = time.perf_counter()
                train(*setups[label])
                times[label].append((time.perf_counter() - start) / steps)
            reps = 50
            owner.collectives.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                averager.sync(0.5)
            times["buffer average"].append((time.perf_counter() - start) / reps)
            owner.collectives.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                owner.collectives.broadcast_tensors(buffers, src=0, name="bench_broadcast")
            times["buffer broadcast"].append((time.perf_counter() - start) / reps)
        model = setups["step"][1]
        return {
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "spread_ms": {k: (min(v) * 1e3, max(v) * 1e3) for k, v in times.items()},
            "parameters": sum(p.numel() for p in model.parameters()),
            "batchnorm_layers": sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()),
            "float_buffer_elements": averager.num_elements,
        }
    finally:
        synced.close()
        owner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    result = run_ranks(_rank, 2, args=(args.rounds, args.steps, args.batch), timeout=1200)[0]
    print(
        f"ResNet-like CNN: {result['parameters']} parameters, {result['batchnorm_layers']} BatchNorm "
        f"layers, {result['float_buffer_elements']} float buffer elements; 2 processes, global batch "
        f"{args.batch}, {args.rounds} interleaved rounds of {args.steps} steps"
    )
    step = result["median_ms"]["step"]
    print(f"{'what':<22} {'median ms':>10} {'min-max ms':>16} {'of a step':>10}")
    for label, median in result["median_ms"].items():
        lo, hi = result["spread_ms"][label]
        print(f"{label:<22} {median:>10.3f} {f'{lo:.3f}-{hi:.3f}':>16} {median / step:>10.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **result}, f, indent=2)


if __name__ == "__main__":
    main()
