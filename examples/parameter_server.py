"""Asynchronous training on parameter servers: the digits classifier, two ways.

    spread run --workers 1 --ps 2 examples/parameter_server.py                 # Trainer.fit on chief + worker
    spread run --workers 2 --ps 2 examples/parameter_server.py --coordinator   # the chief schedules steps

The same script runs on every task: a ``ps`` task serves from ``ParameterServerStrategy()`` on and
never returns; with ``--coordinator``, a worker serves the chief's scheduled steps from its first
``schedule`` call on. Only the chief prints the result.
"""

from __future__ import annotations

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import spread

STATE: dict = {}  # the model and optimizer, for the scheduled step function


def load_data():
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def batches():
    """Each worker's own data (with --coordinator): shuffled batches of 64, forever."""
    (x, y), _ = load_data()
    order = torch.randperm(len(x))
    return [(x[order[i : i + 64]], y[order[i : i + 64]]) for i in range(0, len(x), 64)]


def train_step(iterator):
    """One step on a worker: forward, backward, and optimizer.step() pushes to the servers."""
    x, y = next(iterator)
    STATE["optimizer"].zero_grad()
    loss = nn.functional.cross_entropy(STATE["model"](x), y)
    loss.backward()
    STATE["optimizer"].step()
    return loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--coordinator", action="store_true", help="schedule steps from the chief")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    strategy = spread.ParameterServerStrategy()  # on a ps task: serves until the chief stops it
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    STATE.update(model=model, optimizer=optimizer)
    train, val = load_data()

    if args.coordinator:
        coordinator = spread.ClusterCoordinator(strategy)
        iterator = iter(coordinator.create_per_worker_dataset(batches))
        steps = args.epochs * len(train[0]) // 64
        losses = [coordinator.schedule(train_step, args=(iterator,)) for _ in range(steps)]
        coordinator.join()  # (on a worker, schedule() served the chief's steps and exited)
        print(f"{steps} steps on the workers; last loss {float(losses[-1].fetch()):.3f}")
        print(f"coordinator: {coordinator.stats()}")
        coordinator.shutdown()
        strategy.pull()
    else:
        trainer = spread.Trainer(
            model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"]
        )
        trainer.fit(
            torch.utils.data.TensorDataset(*train), epochs=args.epochs, global_batch_size=64, verbose=0
        )
        if not strategy.is_chief:
            strategy.close()
            return
        strategy.wait_for_workers()  # every worker's last push is in
    with torch.no_grad():
        accuracy = float((model(val[0]).argmax(1) == val[1]).float().mean())
    updates = [s["applied"] for s in strategy.server_stats()]
    print(f"validation accuracy {accuracy:.3f}; updates applied per server: {updates}")
    strategy.close()


if __name__ == "__main__":
    main()
