"""A TensorFlow-tutorial-style parameter-server script: one Trainer.fit driven by the chief.

The same script runs on every task; nothing is closed. Workers end inside fit; the chief prints its
History, evaluates once and prints the servers' applied-update counts."""

import json
import os

import torch
from torch import nn

import spread

strategy = spread.ParameterServerStrategy()  # a ps task serves here and never returns
with strategy.scope():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

g = torch.Generator().manual_seed(1)
centers = torch.randn(4, 16, generator=g) * 0.5
labels = torch.randint(0, 4, (600,), generator=g)
features = centers[labels] + torch.randn(600, 16, generator=g)
train, val = (features[:480], labels[:480]), (features[480:], labels[480:])

coordinator = spread.ClusterCoordinator(strategy)
trainer = spread.Trainer(
    model,
    optimizer,
    nn.CrossEntropyLoss(),
    strategy=strategy,
    coordinator=coordinator,
    metrics=["accuracy"],
    lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    clip_grad_norm=5.0,
)
if os.environ.get("SPREAD_TEST_FAIL_ON_WORKER") and strategy.rank == 1:
    trainer.loss_fn = None  # the worker's steps fail: the chief must name the task and end
history = trainer.fit(train, epochs=3, global_batch_size=32, validation_data=val, verbose=2)
print("HISTORY " + json.dumps(history.history), flush=True)
result = trainer.evaluate(val)
print("EVALUATE " + json.dumps(result), flush=True)
print("APPLIED " + json.dumps([s["applied"] for s in strategy.server_stats()]), flush=True)
