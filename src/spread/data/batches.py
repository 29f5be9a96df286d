"""What a training batch is made of, from the shapes datasets yield.

Two shapes: ``(inputs, targets)`` (or ``{"x": ..., "y": ...}``), and a dict of named tensors that is
the model's keyword arguments (Hugging Face style: ``{"input_ids": ..., "attention_mask": ...,
"labels": ...}``), where the model computes its own loss and ``labels`` are the targets. As in Keras,
each may carry per-sample weights: ``(inputs, targets, sample_weight)``, or a ``"sample_weight"``
entry (never passed to the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

WEIGHTS_KEY = "sample_weight"  # a dict batch's per-sample weights (Keras' name)


@dataclass(frozen=True)
class Batch:
    """One replica's batch: what the model is called with, the targets, how many samples."""

    inputs: Any  # a tensor (or structure) passed positionally, or a Mapping passed as **kwargs
    targets: Any  # None for a keyword batch without "labels"
    size: int
    weights: torch.Tensor | None = None  # each sample's loss weight (Keras' sample_weight)

    @property
    def as_keywords(self) -> bool:
        return isinstance(self.inputs, Mapping)

    def as_data(self) -> Any:
        """The batch in the shape a dataset yields it (what :func:`as_batch` reads back)."""
        if self.as_keywords:
            return self.inputs if self.weights is None else {**self.inputs, WEIGHTS_KEY: self.weights}
        pair = (self.inputs, self.targets)
        return pair if self.weights is None else (*pair, self.weights)


def inputs_and_targets(batch: Any, *, who: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch given as a pair or as ``{"x": ..., "y": ...}``.

    ``who`` names the caller in the error a batch of another shape gets.
    """
    if isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1]
    if isinstance(batch, dict) and {"x", "y"} <= batch.keys():
        return batch["x"], batch["y"]
    raise TypeError(
        f"{who} expects batches of (inputs, targets) or {{'x': ..., 'y': ...}}; got {type(batch).__name__}"
    )


def as_batch(batch: Any, *, who: str) -> Batch:
    """A :class:`Batch` of a pair, an ``{"x", "y"}`` dict, or a dict of the model's keyword arguments."""
    if isinstance(batch, Mapping) and not {"x", "y"} <= batch.keys():
        if not batch:
            raise TypeError(f"{who} got an empty dict as a batch")
        inputs = {k: v for k, v in batch.items() if k != WEIGHTS_KEY}
        size = _samples(inputs, who)
        return Batch(inputs, batch.get("labels"), size, _checked_weights(batch.get(WEIGHTS_KEY), size, who))
    weights = None
    if isinstance(batch, tuple | list) and len(batch) == 3:
        batch, weights = batch[:2], batch[2]
    elif isinstance(batch, Mapping):
        weights = batch.get(WEIGHTS_KEY)
    inputs, targets = inputs_and_targets(batch, who=who)
    size = int(targets.shape[0]) if isinstance(targets, torch.Tensor) else len(targets)
    return Batch(inputs, targets, size, _checked_weights(weights, size, who))


def _checked_weights(weights: Any, size: int, who: str) -> torch.Tensor | None:
    if weights is not None and (not isinstance(weights, torch.Tensor) or weights.shape != (size,)):
        shape = list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"{who} got sample weights of shape {shape} for a batch of {size} samples")
    return weights


def _samples(value: Any, who: str) -> int:
    """Samples along dim 0 of the first tensor found in ``value``."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.ndim else 1
    if isinstance(value, Mapping):
        for item in value.values():
            if isinstance(item, torch.Tensor):
                return _samples(item, who)
    if isinstance(value, tuple | list):
        for item in value:
            if isinstance(item, torch.Tensor):
                return _samples(item, who)
        return len(value)
    raise TypeError(f"{who} cannot count the samples of a {type(value).__name__}")
