"""What the Trainer takes from a model's output: the prediction, and the loss the model computed.

Models return a tensor, a tuple, or a mapping of named results (Hugging Face's ``ModelOutput`` is
an ordered dict with ``loss`` and ``logits``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def prediction_of(output: Any) -> torch.Tensor:
    """The tensor metrics and ``predict`` use: the output itself, its ``logits``, or its first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"]
        values = [v for k, v in output.items() if k != "loss" and isinstance(v, torch.Tensor)]
    elif isinstance(output, tuple | list):
        values = [v for v in output if isinstance(v, torch.Tensor)]
    else:
        values = []
    if not values:
        raise TypeError(
            f"cannot take a prediction tensor from a model output of type {type(output).__name__}"
        )
    return values[0]


def loss_of(output: Any) -> torch.Tensor:
    """The loss the model computed (``Trainer(loss_fn=None)``): ``output.loss`` / ``output["loss"]``."""
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "Trainer(loss_fn=None) uses the loss the model computes, but the model's output "
            f"({type(output).__name__}) has no 'loss': give the batch its 'labels', or pass a loss_fn"
        )
    return loss
