"""Seven model families the planner was not fitted on, for ``plan_validation.py --workloads``.

Issue 20's suite: the planner's earlier validation used W1-W3 only (``block_workloads.py``), the
workloads it was tuned on. Each family here is built in this file from a config (nothing is
downloaded), with synthetic data from a fixed seed, and returns what ``block_workloads.make`` does:
``(model, loss_fn, make_optimizer, make_batch, global_batch)``. Where a user would write a chain of
blocks the model is an ``nn.Sequential`` of them (the planner profiles it block by block and can cut
it into pipeline stages); the Hugging Face GPT-2 stays the ``transformers`` model a user loads.

- ``mlp``: 512-1024-1024-1024-10 with ReLU, SGD with momentum, global batch 256.
- ``cnn``: three 3x3 conv layers (32, 64, 128 channels) on 32x32 RGB, global pooling, Adam, batch 128.
- ``resnet``: a stem and four residual blocks with batch norm (16-64 channels), SGD with momentum,
  batch 64.
- ``transformer``: a 4-layer ``nn.TransformerEncoder``-style classifier (d=128, 4 heads, seq 64),
  AdamW, batch 32.
- ``gpt2``: ``transformers.GPT2LMHeadModel`` from a ``GPT2Config`` (6 layers, d=192, 6 heads, seq 64,
  vocab 4096), AdamW, batch 16 sequences.
- ``recommender``: a 100k-row user table and a 200k-row item table (history of 16 items, mean-pooled)
  feeding an MLP 64-256-128-1, Adagrad, batch 1024.
- ``lstm``: an embedding and a 2-layer LSTM (hidden 256, seq 32) classifying from the last step,
  Adam, batch 64.

``FITTED`` names the half of the families the planner may be adjusted on; ``HELD_OUT`` the half it
is only checked on (issue 20's held-out check). The split was fixed before any family was measured.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Workload = tuple[nn.Module, Callable[..., torch.Tensor], Callable[..., torch.optim.Optimizer], Callable, int]

FITTED = ("mlp", "cnn", "transformer")
HELD_OUT = ("resnet", "gpt2", "recommender", "lstm")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def mlp() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(512, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        return torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g)

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    return model, nn.CrossEntropyLoss(), optimizer, batch, 256


def _image_batch(channels: int = 3, size: int = 32, classes: int = 10) -> Callable:
    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        return torch.randn(n, channels, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)

    return batch


def cnn() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)),
    )
    return model, nn.CrossEntropyLoss(), lambda params: torch.optim.Adam(params, lr=1e-3), _image_batch(), 128


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a projection when the shape changes)."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet() -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU()),
        ResidualBlock(16, 16),
        ResidualBlock(16, 32, stride=2),
        ResidualBlock(32, 32),
        ResidualBlock(32, 64, stride=2),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)),
    )

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)

    return model, nn.CrossEntropyLoss(), optimizer, _image_batch(), 64


class TokensAndPositions(nn.Module):
    def __init__(self, vocab: int, dim: int, seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class MeanPoolClassifier(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x.mean(1)))


def transformer(
    layers: int = 4, dim: int = 128, heads: int = 4, seq: int = 64, vocab: int = 5000
) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        TokensAndPositions(vocab, dim, seq),
        *(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        ),
        MeanPoolClassifier(dim, 4),
    )

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, 4, (n,), generator=g)

    return model, nn.CrossEntropyLoss(), lambda params: torch.optim.AdamW(params, lr=3e-4), batch, 32


def _language_model_loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def gpt2(layers: int = 6, dim: int = 192, heads: int = 6, seq: int = 64, vocab: int = 4096) -> Workload:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=dim,
        n_layer=layers,
        n_head=heads,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq + 1), generator=_generator(seed))
        return ids[:, :-1], ids[:, 1:]

    return model, _language_model_loss, lambda params: torch.optim.AdamW(params, lr=3e-4), batch, 16


class UserAndHistory(nn.Module):
    """Column 0 is a user id, the rest the items the user saw: a user row and the items' mean."""

    def __init__(self, users: int, items: int, dim: int) -> None:
        super().__init__()
        self.users = nn.Embedding(users, dim)
        self.items = nn.EmbeddingBag(items, dim, mode="mean")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.users(ids[:, 0]), self.items(ids[:, 1:])], dim=1)


def recommender(users: int = 100_000, items: int = 200_000, dim: int = 32, history: int = 16) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(
        UserAndHistory(users, items, dim),
        nn.Linear(2 * dim, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, 1),
    )

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        user = torch.randint(0, users, (n, 1), generator=g)
        seen = torch.randint(0, items, (n, history), generator=g)
        return torch.cat([user, seen], dim=1), torch.randint(0, 2, (n, 1), generator=g).float()

    loss = nn.BCEWithLogitsLoss()
    return model, loss, lambda params: torch.optim.Adagrad(params, lr=0.05), batch, 1024


class LSTMLayers(nn.Module):
    """``nn.LSTM`` as a block: the sequence of hidden states, without the final state tuple."""

    def __init__(self, inputs: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(inputs, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


class LastStep(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x[:, -1])


def lstm(vocab: int = 5000, dim: int = 128, hidden: int = 256, seq: int = 32) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, dim), LSTMLayers(dim, hidden, 2), LastStep(hidden, 5))

    def batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        return torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, 5, (n,), generator=g)

    return model, nn.CrossEntropyLoss(), lambda params: torch.optim.Adam(params, lr=1e-3), batch, 64


FAMILIES: dict[str, Callable[[], Workload]] = {
    "mlp": mlp,
    "cnn": cnn,
    "resnet": resnet,
    "transformer": transformer,
    "gpt2": gpt2,
    "recommender": recommender,
    "lstm": lstm,
}


def make(name: str) -> Workload:
    """A family by name, or W1-W3 of ``block_workloads.py``."""
    if name.lower() in FAMILIES:
        return FAMILIES[name.lower()]()
    import block_workloads

    return block_workloads.make(name)
