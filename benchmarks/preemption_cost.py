"""What ``BackupAndRestore(save_on_preemption=True)`` (the default) costs per step: the ranks agree
on every step whether one of them got SIGTERM (a 1-element gather), against the same fit with it off.

    python benchmarks/preemption_cost.py [--rounds 6]

MultiWorkerMirrored, 2 processes x 1 thread, ``Trainer.fit`` with ``BackupAndRestore`` whose
``save_freq`` is never reached (no backup is written: only the agreement differs), on W1 (a
step of tens of milliseconds) and on a small MLP (a step of about a millisecond, where a fixed cost
shows most). Each round runs both settings, order alternating; ratios paired by round, median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads

import spread
from spread.callbacks import BackupAndRestore
from spread.testing import run_ranks


def _small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,), generator=g))
    return model, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01), data, 64


def _w1():
    model, loss_fn, make_optimizer, batch, global_batch = workloads.make("W1")
    return model, loss_fn, make_optimizer, batch(global_batch * 8), global_batch


def _job(rounds: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    strategy = spread.MultiWorkerMirroredStrategy()
    out: dict[str, list[float]] = {}
    try:
        for name, make in (("small MLP", _small), ("W1", _w1)):
            with strategy.scope():
                model, loss_fn, make_optimizer, data, global_batch = make()
                optimizer = make_optimizer(model.parameters())
            trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy)
            trainer.fit(data, epochs=1, global_batch_size=global_batch, verbose=0)  # warm-up, untimed
            for r in range(rounds):
                for watch in (True, False) if r % 2 == 0 else (False, True):
                    with tempfile.TemporaryDirectory() as backup_dir:
                        backup = BackupAndRestore(backup_dir, save_freq=10**9, save_on_preemption=watch)
                        strategy.collectives.barrier()
                        start = time.perf_counter()
                        trainer.fit(
                            data, epochs=2, global_batch_size=global_batch, callbacks=[backup], verbose=0
                        )
                        elapsed = time.perf_counter() - start
                    steps = 2 * -(-len(data[0]) // global_batch)
                    out.setdefault(f"{name} {'on' if watch else 'off'}", []).append(elapsed / steps)
        return out
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    (result, _) = run_ranks(_job, 2, args=(args.rounds,), timeout=590, env={"OMP_NUM_THREADS": "1"})
    print("MultiWorkerMirrored, 2 x 1 thread, seconds per step (median of rounds)")
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
