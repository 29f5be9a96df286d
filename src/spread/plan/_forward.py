"""How the planner runs a model on a batch: as the Trainer does, so what it times is what trains.

A dict of inputs goes in as keyword arguments (Hugging Face style); the loss is ``loss_fn`` on the
output's prediction (a ``ModelOutput``'s ``logits``), or with ``loss_fn=None`` the loss the model
computed. Both come from :mod:`spread.train.outputs`, the Trainer's own helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from spread.train.outputs import loss_of, prediction_of

LossFn = Callable[[Any, Any], torch.Tensor] | None


def forward_loss(model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any) -> torch.Tensor:
    """The loss of ``model`` on one batch, computed as ``Trainer.fit`` computes it."""
    output = model(**inputs) if isinstance(inputs, Mapping) else model(inputs)
    if loss_fn is None:
        return loss_of(output)
    return loss_fn(prediction_of(output), targets)


def samples_in(inputs: Any, targets: Any) -> int:
    """Samples in a batch: the targets' first dimension, else that of the first tensor of the inputs
    (a dict of keyword arguments without ``labels``, for a model that computes its own loss)."""
    for value in (targets, inputs):
        found = _first_tensor(value)
        if found is not None:
            return int(found.shape[0]) if found.ndim else 1
    raise ValueError(f"cannot count the samples of a batch of {type(inputs).__name__}")


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None
