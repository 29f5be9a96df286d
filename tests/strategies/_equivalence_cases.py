"""Shared pieces of the equivalence tests: one model, one data set, one training loop for all."""

from __future__ import annotations

import torch
from torch import nn

NUM_SAMPLES = 151  # 9 full global batches of 16, then an uneven one of 7
GLOBAL_BATCH = 16
STEPS = 20  # two epochs, each ending with the uneven batch


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, 10, generator=g)
    y = torch.randint(0, 3, (NUM_SAMPLES,), generator=g)
    return x, y


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    raise ValueError(name)


def train_custom_loop(strategy, optimizer_name: str, *, init_seed: int = 0) -> dict[str, torch.Tensor]:
    """The custom loop a user writes: the only spread-specific lines are scope, distribute, run."""
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = make_optimizer(optimizer_name, model)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, shuffle=True, seed=7)

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
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        scale = b[k].abs().max().clamp_min(1e-12)
        worst = max(worst, float((a[k] - b[k]).abs().max() / scale))
    return worst
