"""What ShardedStrategy's buddy copy costs per step under ``spread run --recover``: after every
optimizer step each rank sends its shard (parameter chunks and Adam's moments) to its ring neighbour
and keeps the other neighbour's, and before it packs its own shard as a rollback point
(:mod:`spread.strategies.sharded_buddy`; the Trainer keeps its loop state), against the same fit
without it.

    python benchmarks/sharded_recovery_overhead.py [--rounds 6] [--shard parameters]

ShardedStrategy, 2 processes x 1 thread, ``Trainer.fit`` with Adam, on a small MLP (a step of about
a millisecond, where a fixed cost shows most) and on W1 (5.8 M parameters: a 35 MB shard of
parameters and moments sent per step per rank). The copy is switched per round on the one strategy
with ``SPREAD_RECOVER`` for the Trainer (what ``spread run --recover`` switches on), so both settings
share every process; each round runs both, order alternating; ratios paired by round, median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import spread
from spread import env
from spread.strategies.sharded_buddy import BuddyCopy
from spread.testing import run_ranks


def _small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g))
    return model, nn.functional.cross_entropy, data, 64


def _w1():
    model, loss_fn, _, batch, global_batch = workloads.make("W1")
    return model, loss_fn, batch(global_batch * 8), global_batch


def _job(rounds: int, shard: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    strategy = spread.ShardedStrategy(shard=shard)
    out: dict[str, list[float]] = {}
    try:
        for name, make in (("small MLP", _small), ("W1", _w1)):
            with strategy.scope():
                model, loss_fn, data, global_batch = make()
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy)
            trainer.fit(data, epochs=1, global_batch_size=global_batch, verbose=0)  # warm-up, untimed
            for r in range(rounds):
                for copy in (True, False) if r % 2 == 0 else (False, True):
                    strategy._buddy = BuddyCopy() if copy else None
                    if copy:  # the Trainer's side of --recover too: it keeps its loop state per step
                        os.environ[env.RECOVER] = "1"
                    else:
                        os.environ.pop(env.RECOVER, None)
                    strategy.collectives.barrier()
                    start = time.perf_counter()
                    trainer.fit(data, epochs=2, global_batch_size=global_batch, verbose=0)
                    elapsed = time.perf_counter() - start
                    steps = 2 * -(-len(data[0]) // global_batch)
                    out.setdefault(f"{name} {'on' if copy else 'off'}", []).append(elapsed / steps)
        return out
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--shard", default="parameters", choices=("optimizer", "gradients", "parameters"))
    args = parser.parse_args()
    (result, _) = run_ranks(
        _job, 2, args=(args.rounds, args.shard), timeout=590, env={"OMP_NUM_THREADS": "1"}
    )
    print(f"ShardedStrategy(shard={args.shard!r}), Adam, 2 x 1 thread, seconds per step (median of rounds)")
    for name in ("small MLP", "W1"):
        on, off = result[f"{name} on"], result[f"{name} off"]
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        extra_ms = statistics.median(a - b for a, b in zip(on, off, strict=True)) * 1e3
        off_ms, on_ms = statistics.median(off) * 1e3, statistics.median(on) * 1e3
        rounded = [round(x, 3) for x in ratios]
        print(f"  {name:9}  off {off_ms:7.2f} ms  on {on_ms:7.2f} ms  per step {extra_ms:+.2f} ms")
        print(f"             on/off {statistics.median(ratios):.3f} (rounds {rounded})")


if __name__ == "__main__":
    main()
