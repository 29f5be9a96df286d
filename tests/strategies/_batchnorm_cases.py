"""A small BatchNorm CNN, its data and the custom loop the BatchNorm tests share."""

from __future__ import annotations

import torch
from torch import nn

NUM_SAMPLES = 37  # two global batches of 16, then an uneven one of 5 (3 + 2 over two replicas)
GLOBAL_BATCH = 16
STEPS = 8  # nearly three epochs, each ending with the uneven batch


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 3, 6, 6, generator=g) * 2 + 0.5
    y = torch.randint(0, 3, (NUM_SAMPLES,), generator=g)
    return x, y


def make_model(seed: int = 0) -> nn.Module:
    """Conv + BatchNorm2d (momentum 0.1 and cumulative), and a BatchNorm1d on the features."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8, momentum=None),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 6),
        nn.BatchNorm1d(6),
        nn.Linear(6, 3),
    )


def train_custom_loop(strategy, *, init_seed: int = 0, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Weights and buffers after ``steps`` SGD steps with momentum (the model's whole state_dict)."""
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, shuffle=True, seed=3)

    def step_fn(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    done = 0
    while done < steps:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(step_fn, args=(x, y))
            optimizer.step()
            done += 1
            if done == steps:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)))
    return worst


def fit_with_trainer(strategy, *, global_batch: int, accumulation_steps: int = 1, epochs: int = 2) -> dict:
    """``Trainer.fit`` on the shared data; the model's one-device state_dict afterwards."""
    import spread

    with strategy.scope():
        model = make_model(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, accumulation_steps=accumulation_steps
    )
    trainer.fit(make_data(), epochs=epochs, global_batch_size=global_batch, verbose=0)
    state = strategy.full_state_dict(model)  # collective under a pipeline
    return {k: v.detach().clone() for k, v in state.items()}
