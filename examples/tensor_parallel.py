"""Tensor parallel with data parallel: a transformer block split over 2 processes, 2 replicas of it.

spread run -n 4 examples/tensor_parallel.py                      # 2 replicas x 2-way tensor parallel
spread run -n 2 examples/tensor_parallel.py --tensor-parallel 1  # plain data parallelism, same result

The block's attention heads and MLP are split with torch's ``parallelize_module`` over the tensor
axis of the strategy's mesh (``strategy.mesh["tp"]``); MultiWorkerMirroredStrategy averages the
gradients over the data axis. The weights written at the end are one device's (``full_state_dict``
gathers the shards), loadable into the unsplit model.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import spread


class Block(nn.Module):
    """Pre-norm attention and MLP; the head count per rank is whatever the projections hold."""

    def __init__(self, dim: int = 64, heads: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.classify = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        h = self.norm1(x)
        q, k, v = (
            f(h).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, -1))
        x = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return self.classify(x.mean(dim=1))


# Megatron's split: q, k, v and up by output features (heads), out and down by input features; the
# LayerNorms and the classifier stay whole on every rank.
PLAN = {
    "q": ColwiseParallel(),
    "k": ColwiseParallel(),
    "v": ColwiseParallel(),
    "out": RowwiseParallel(),
    "up": ColwiseParallel(),
    "down": RowwiseParallel(),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tensor-parallel", type=int, default=2, help="processes per tensor-parallel group")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save", default="", help="write the one-device weights here (torch.save)")
    args = parser.parse_args()

    strategy = spread.MultiWorkerMirroredStrategy(tensor_parallel=args.tensor_parallel)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, 64, generator=g)
    pooled = x.mean(dim=1)
    y = pooled[:, 0].gt(0).long() + 2 * pooled[:, 1].gt(0).long()  # 4 classes

    torch.manual_seed(0)
    with strategy.scope():
        model = Block()
        if strategy.mesh is not None:  # tensor_parallel > 1: split the block over the tensor axis
            parallelize_module(model, strategy.mesh["tp"], PLAN)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
    history = trainer.fit((x, y), epochs=args.epochs, global_batch_size=64, verbose=0)

    weights = strategy.full_state_dict(model)  # collective: every rank gathers the shards
    if strategy.is_chief:
        print(
            f"{strategy.num_replicas_in_sync} replicas x {args.tensor_parallel}-way tensor parallel: "
            f"loss {history.history['loss'][-1]:.4f}, accuracy {history.history['accuracy'][-1]:.3f}"
        )
        if args.save:
            torch.save({k: v.detach().clone() for k, v in weights.items()}, args.save)
    strategy.close()


if __name__ == "__main__":
    main()
