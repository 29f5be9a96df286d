"""W1, W2 and W3 of DESIGN.md as chains of blocks (``nn.Sequential``), for the planner and pipelines.

A pipeline splits a chain at block boundaries and the planner profiles it block by block, so these
versions are built from blocks (``workloads.py`` has the throughput-benchmark versions). Each
factory returns ``(model, loss_fn, make_optimizer, make_batch, global_batch)``; data is synthetic from
a fixed seed (nothing downloaded).

- W1: MLP 784-2048-2048-10, SGD, global batch 512.
- W2: GPT decoder, 4 layers, d=256, 4 heads, seq 128, vocab 8192, AdamW, global batch 16 sequences.
- W3: a 1M x 64 embedding (8 ids per sample, mean-pooled) + MLP 64-256-2, Adagrad, global batch 512.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Workload = tuple[nn.Module, Callable[..., torch.Tensor], Callable[..., torch.optim.Optimizer], Callable, int]


def w1() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)
    )

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)

    return model, nn.CrossEntropyLoss(), lambda params: torch.optim.SGD(params, lr=0.01), batch, 512


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(seq, dim))
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions[: ids.shape[1]]


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and a 4x MLP, GPT-2 style."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class LanguageModelHead(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def w2(layers: int = 4, dim: int = 256, heads: int = 4, seq: int = 128, vocab: int = 8192) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        TokenEmbedding(vocab, dim, seq),
        *(DecoderBlock(dim, heads) for _ in range(layers)),
        LanguageModelHead(dim, vocab),
    )
    for name, p in model.named_parameters():
        if name.endswith("proj.weight"):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (n, seq + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return model, next_token_loss, lambda params: torch.optim.AdamW(params, lr=3e-4), batch, 16


class MeanEmbedding(nn.Module):
    """An embedding table looked up with several ids per sample, averaged (a bag of features)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids).mean(1)


def w3(rows: int = 1_000_000, dim: int = 64, ids_per_sample: int = 8) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(MeanEmbedding(rows, dim), nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 2))

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, rows, (n, ids_per_sample), generator=g), torch.randint(
            0, 2, (n,), generator=g
        )

    return model, nn.CrossEntropyLoss(), lambda params: torch.optim.Adagrad(params, lr=0.05), batch, 512


WORKLOADS: dict[str, Callable[[], Workload]] = {"W1": w1, "W2": w2, "W3": w3}


def make(name: str) -> Workload:
    try:
        return WORKLOADS[name.upper()]()
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}") from None


def plan_factory(name: str = "W1") -> tuple[Any, ...]:
    """``(model, loss_fn, inputs, targets, optimizer)`` for ``spread plan --model``."""
    model, loss, opt, batch, global_batch = make(name)
    x, y = batch(global_batch)
    return model, loss, x, y, opt(model.parameters())


def plan_w1() -> tuple[Any, ...]:
    return plan_factory("W1")


def plan_w2() -> tuple[Any, ...]:
    return plan_factory("W2")


def plan_w3() -> tuple[Any, ...]:
    return plan_factory("W3")
