"""Train the digits classifier split into pipeline stages, one process per stage.

    spread run -n 2 examples/pipeline.py                       # 2 stages, 4 micro-batches, 1F1B
    spread run -n 4 examples/pipeline.py --replicas 2          # 2 stages x 2 data-parallel replicas
    spread run -n 3 examples/pipeline.py --stages 3 --schedule gpipe

Each rank builds the whole nn.Sequential; PipelineStrategy keeps only its stage's layers busy. At the
end every rank takes part in full_state_dict (a collective) and the chief saves the full model's
state_dict, which loads into a plain one-process model (checked below).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from sklearn.datasets import load_digits
from torch import nn

import spread


def load_data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb"])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--verbose", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(0)
    strategy = spread.PipelineStrategy(
        stages=args.stages, microbatches=args.microbatches, schedule=args.schedule, replicas=args.replicas
    )
    train, val = load_data()
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
    trainer.fit(train, epochs=args.epochs, global_batch_size=args.batch_size, verbose=args.verbose)
    result = trainer.evaluate(val)  # runs through the pipeline; the same numbers on every rank

    state = strategy.full_state_dict(model)  # collective: every rank calls it
    if strategy.is_chief:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model.pt")
            torch.save(state, path)
            plain = make_model()  # one process, no strategy
            plain.load_state_dict(torch.load(path, weights_only=True))
            with torch.no_grad():
                accuracy = (plain(val[0]).argmax(1) == val[1]).float().mean().item()
        print(
            f"pipeline: {args.stages} stages x {args.replicas} replica(s), {args.schedule}, "
            f"M={args.microbatches}, split {strategy.stage_bounds}: val_accuracy {result['accuracy']:.4f}; "
            f"reloaded in one process: {accuracy:.4f}"
        )
    strategy.close()


if __name__ == "__main__":
    main()
