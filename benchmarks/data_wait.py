"""How long W1 training waits for data when each sample costs ~1 ms to load (I/O-like latency).

    python benchmarks/data_wait.py [--steps 12]

Runs MultiWorkerMirroredStrategy with 2 processes on W1 (MLP 784-2048-2048-10, global batch 512)
over a dataset whose ``__getitem__`` sleeps 1 ms, with three input pipelines: no prefetch, the
background-thread prefetch alone, and prefetch with DataLoader worker processes. Reports the share
of the training loop spent waiting for batches (``DistributedDataset.wait_clock``) and samples/s.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn
from torch.utils.data import Dataset

GLOBAL_BATCH = 512


class SlowDataset(Dataset):
    """Synthetic W1 samples that each take ``delay`` seconds to "load"."""

    def __init__(self, n: int = 8192, delay: float = 1e-3) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.delay = (
            torch.randn(n, 784, generator=g),
            torch.randint(0, 10, (n,), generator=g),
            delay,
        )

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def _rank(steps: int, prefetch: int, num_workers: int) -> dict:
    import spread

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 sleeping workers on 2 cores
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        torch.manual_seed(0)
        with strategy.scope():
            model = nn.Sequential(
                nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loss_fn = nn.CrossEntropyLoss()
        data = strategy.distribute_dataset(
            SlowDataset(), GLOBAL_BATCH, prefetch=prefetch, num_workers=num_workers
        )
        it = iter(data)
        for _ in range(2):  # warm-up (and worker start-up) not timed
            x, y = next(it)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        data.wait_clock.reset()
        start = time.perf_counter()
        for _ in range(steps):
            x, y = next(it)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        elapsed = time.perf_counter() - start
        it.close()
        return {"wait": data.wait_clock.seconds / elapsed, "rate": GLOBAL_BATCH * steps / elapsed}
    finally:
        strategy.close()


def main() -> None:
    from spread.testing import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print("| input pipeline | data wait (share of loop time, rank 0) | samples/s |")
    print("| --- | ---: | ---: |")
    for label, prefetch, workers in [
        ("no prefetch, loading in the training process", 0, 0),
        ("background-thread prefetch (2 batches)", 2, 0),
        ("prefetch 2 + 4 DataLoader worker processes", 2, 4),
    ]:
        result = run_ranks(_rank, 2, args=(args.steps, prefetch, workers), timeout=600)[0]
        print(f"| {label} | {100 * result['wait']:.1f}% | {result['rate']:,.0f} |")


if __name__ == "__main__":
    main()
