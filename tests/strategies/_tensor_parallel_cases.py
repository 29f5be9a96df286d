"""Shared pieces of the tensor-parallel tests: two tiny models, their tensor-parallel plans, the data,
and the loops, run alike on one device (the reference) and on a 2 x 2 (data x tensor) job."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

NUM_SAMPLES = 40  # global batches of 16, 16, then an uneven 8
GLOBAL_BATCH = 16
STEPS = 4  # one epoch and the first batch of the next
FEATURES, CLASSES, TOKENS = 8, 3, 4


class MLP(nn.Module):
    """Column-parallel up projection, row-parallel down projection, a replicated classifier (with
    ``batchnorm``: a BatchNorm, replicated too, on the down projection's output)."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, 32)
        self.down = nn.Linear(32, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.down(torch.tanh(self.up(x))))))


class Block(nn.Module):
    """A transformer block in miniature: attention with heads split over the tensor axis (q, k, v
    column-parallel, the output row-parallel), then a column/row-parallel MLP, LayerNorms and a
    classifier replicated."""

    def __init__(self, dim: int = FEATURES, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no key bias: softmax ignores it, so its gradient is rounding noise that Adam would magnify
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.classify = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        h = self.norm1(x)
        # -1: the heads this rank holds (all of them on one device, half under tensor_parallel=2)
        q, k, v = (
            f(h).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, -1))
        x = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return self.classify(x.mean(dim=1))


def mlp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def block_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "q": ColwiseParallel(),
        "k": ColwiseParallel(),
        "v": ColwiseParallel(),
        "out": RowwiseParallel(),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
    }


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict]]] = {
    "mlp": (MLP, mlp_plan),
    "mlp_batchnorm": (lambda: MLP(batchnorm=True), mlp_plan),
    "block": (Block, block_plan),
}


def make_data(model_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    shape = (NUM_SAMPLES, TOKENS, FEATURES) if model_name == "block" else (NUM_SAMPLES, FEATURES)
    return torch.randn(*shape, generator=g), torch.randint(0, CLASSES, (NUM_SAMPLES,), generator=g)


def make_model(model_name: str, seed: int, tp_mesh=None) -> nn.Module:
    """The model of ``seed``'s initial weights, parallelised on ``tp_mesh`` when given."""
    torch.manual_seed(seed)
    build, plan = MODELS[model_name]
    model = build()
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, plan())
    return model


def train_custom_loop(strategy, model_name: str, *, tp_mesh=None, seed: int = 0):
    """The user's custom loop; returns (model, optimizer, dataset) after STEPS steps."""
    with strategy.scope():
        model = make_model(model_name, seed, tp_mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(model_name), GLOBAL_BATCH, shuffle=True, seed=7)

    def step_fn(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    steps = 0
    while steps < STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(step_fn, args=(x, y))
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    return model, optimizer, dataset


def train_with_trainer(strategy, model_name: str, *, tp_mesh=None, seed: int = 0) -> tuple[nn.Module, dict]:
    """``Trainer.fit`` for two epochs with gradient clipping (the clip binds: max norm 0.05); the
    model and the per-epoch logs."""
    import spread

    with strategy.scope():
        model = make_model(model_name, seed, tp_mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"], clip_grad_norm=0.05
    )
    history = trainer.fit(
        make_data(model_name), epochs=2, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=7, verbose=0
    )
    return model, history.history


def copied(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        scale = b[k].abs().max().clamp_min(1e-12)
        worst = max(worst, float((a[k] - b[k]).abs().max() / scale))
    return worst
