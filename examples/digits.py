"""Train a digits classifier (scikit-learn's bundled 8x8 digits, no download) with spread.

    spread run -n 2 examples/digits.py            # 2 local workers, MultiWorkerMirroredStrategy
    python examples/digits.py --strategy mirrored # one process, 2 replicas on threads
    torchrun --standalone --nproc-per-node 2 examples/digits.py   # the same script under torchrun

The script is the same for every strategy; only the strategy line changes.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import spread


def load_data(seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_strategy(name: str, compression: str | None = None) -> spread.Strategy:
    if name == "auto":
        name = "multi_worker_mirrored" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "one_device"
    if name == "mirrored":
        return spread.MirroredStrategy(num_replicas=2)
    if name == "multi_worker_mirrored":
        return spread.MultiWorkerMirroredStrategy(compression=compression)
    return spread.OneDeviceStrategy()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--strategy", default="auto", choices=["auto", "one_device", "mirrored", "multi_worker_mirrored"]
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--verbose", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument(
        "--compression",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="exchange gradients in half precision (multi_worker_mirrored only)",
    )
    args = parser.parse_args()

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    strategy = make_strategy(args.strategy, None if args.compression == "none" else args.compression)
    train, val = load_data()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
    history = trainer.fit(
        train,
        epochs=args.epochs,
        global_batch_size=args.batch_size,
        validation_data=val,
        verbose=args.verbose,
    )
    result = trainer.evaluate(val)
    if strategy.is_chief:
        print(
            f"digits: {strategy.num_replicas_in_sync} replica(s) with {type(strategy).__name__}: "
            f"val_accuracy {result['accuracy']:.4f}, val_loss {result['loss']:.4f}, "
            f"{len(history.epoch)} epochs in {time.perf_counter() - started:.1f}s"
        )
    strategy.close()


if __name__ == "__main__":
    main()
