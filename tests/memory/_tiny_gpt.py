"""A small GPT-style decoder with dropout, for the checkpointing and offload tests."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 4, 16


class TinyGPT(nn.Module):
    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                DIM, HEADS, 4 * DIM, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.ln = nn.LayerNorm(DIM)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        return self.ln(h) @ self.tok.weight.T


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def batches(n: int, batch: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=g) for _ in range(n)]


def train(model: nn.Module, steps: int = 5, seed: int = 42) -> dict[str, torch.Tensor]:
    """A few AdamW steps from a fixed RNG state (dropout draws included)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    model.train()
    for ids in batches(steps):
        optimizer.zero_grad()
        lm_loss(model, ids).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fresh(dropout: float = 0.1) -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(dropout)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)
