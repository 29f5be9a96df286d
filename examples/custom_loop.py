"""A custom training loop: plain PyTorch plus scope, distribute_dataset and run.

spread run -n 2 examples/custom_loop.py
python examples/custom_loop.py --replicas 2      # MirroredStrategy in one process
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import spread


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicas", type=int, default=1, help="MirroredStrategy replicas when not launched")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        strategy: spread.Strategy = spread.MultiWorkerMirroredStrategy()
    elif args.replicas > 1:
        strategy = spread.MirroredStrategy(num_replicas=args.replicas)
    else:
        strategy = spread.OneDeviceStrategy()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 20, generator=g)
    y = (x @ torch.randn(20, generator=g) > 0).long()

    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset((x, y), global_batch_size=128)

    def train_step(inputs, targets):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    step = 0
    while step < args.steps:
        for inputs, targets in dataset:
            optimizer.zero_grad()
            per_replica_loss = strategy.run(train_step, args=(inputs, targets))
            optimizer.step()
            loss = strategy.reduce("mean", per_replica_loss)
            step += 1
            if strategy.is_chief and step % 20 == 0:
                print(f"step {step}: loss {loss.item():.4f}")
            if step == args.steps:
                break
    if strategy.is_chief:
        print(
            f"done: {step} steps on {strategy.num_replicas_in_sync} replica(s), final loss {loss.item():.4f}"
        )
    strategy.close()


if __name__ == "__main__":
    main()
