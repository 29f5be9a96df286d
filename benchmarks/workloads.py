"""The benchmark workloads of DESIGN.md (Benchmarks), shared by the benchmark scripts.

* ``W1``: dense MLP 784-2048-2048-10, SGD lr 0.01, global batch 512 samples (compute-bound, 23 MB
  of gradients);
* ``W2``: small GPT decoder, 4 pre-norm layers, d_model 256, 4 heads, sequence 128, vocabulary
  8192, tied LM head, causal LM loss, AdamW lr 3e-4, global batch 16 sequences (2,048 tokens);
  ``nn.TransformerEncoder`` with a causal mask (the anchors' fallback when ``transformers`` is not
  installed; it is not a dependency of spread);
* ``W3``: sparse: an embedding table of 1M x 64 rows (mean of 8 ids per sample) and a small MLP,
  SGD, global batch 512 (the parameter-server case).

:func:`make` returns ``(model, loss_fn, make_optimizer, make_batch, global_batch)``: ``loss_fn(outputs,
targets)`` is the per-replica mean loss, ``make_optimizer(params)`` the workload's optimizer and
``make_batch(n)`` ``n`` synthetic samples ``(inputs, targets)``. ``quick=True`` shrinks every
workload to a few thousand parameters for smoke tests (same code paths, meaningless timings).
Models are seeded, so every configuration starts from the same weights.

(Reconstructed on 2026-11-23 after the first version of this file was overwritten by mistake; the
``make`` contract is the one ``plan_validation.py`` and ``_validation_worker.py`` use.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

UNITS = {"W1": ("samples/s", 1), "W2": ("tokens/s", 128), "W3": ("samples/s", 1)}
QUICK_SEQ = 16


class Decoder(nn.Module):
    """A GPT-style decoder: token + position embeddings, pre-norm causal layers, tied LM head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)
        for table in (self.tok, self.pos):  # GPT-2's initialisation: logits start near uniform
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.tok(ids) + self.pos(positions)
        h = self.blocks(h, mask=self.mask[: ids.shape[1], : ids.shape[1]], is_causal=True)
        return self.ln(h) @ self.tok.weight.T


class SparseModel(nn.Module):
    """W3: the mean embedding of a sample's ids, then a small MLP."""

    def __init__(self, rows: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids))


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def make(name: str, *, quick: bool = False) -> tuple[nn.Module, Callable, Callable, Callable, int]:
    """``(model, loss_fn, make_optimizer, make_batch, global_batch)`` of workload ``name``."""
    key = name.upper()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    if key == "W1":
        hidden = 64 if quick else 2048
        model = nn.Sequential(
            nn.Linear(784, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g)

        return model, nn.functional.cross_entropy, _sgd, batch, 64 if quick else 512
    if key == "W2":
        vocab, d, layers, heads, seq = (256, 32, 1, 2, QUICK_SEQ) if quick else (8192, 256, 4, 4, 128)
        model = Decoder(vocab, d, layers, heads, seq)

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, vocab, (n, seq), generator=g)
            return ids, ids

        return model, _lm_loss, _adamw, batch, 4 if quick else 16
    if key == "W3":
        rows, dim, hidden = (1000, 8, 16) if quick else (1_000_000, 64, 256)
        model = SparseModel(rows, dim, hidden)

        def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randint(0, rows, (n, 8), generator=g), torch.randint(0, 10, (n,), generator=g)

        return model, nn.functional.cross_entropy, _sgd, batch, 64 if quick else 512
    raise ValueError(f"unknown workload {name!r}; choose W1, W2 or W3")


def unit(name: str, *, quick: bool = False) -> tuple[str, int]:
    """``(throughput unit, units per sample)``: W2 counts tokens."""
    label, per_sample = UNITS[name.upper()]
    return label, (QUICK_SEQ if quick and name.upper() == "W2" else per_sample)


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4)
