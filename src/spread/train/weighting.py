"""Keras' per-sample weights in ``fit``: ``sample_weight=`` and ``class_weight=``.

Keras weighs each sample's loss and divides by the batch's sample count ("sum over batch size"), not by
the sum of the weights; so does this. A replica's weighted mean over its slice, combined by the
strategies' usual sample-count weighting, is then the one-device loss of the global batch. Class
weights apply to training only (Keras ignores them in evaluation); sample weights also apply to
validation data that carries them.
"""

from __future__ import annotations

import copy
import inspect
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def class_weight_table(class_weight: Mapping[int, float] | None) -> torch.Tensor | None:
    """``{class index: weight}`` as a lookup table; classes left out weigh 1, as in Keras."""
    if class_weight is None:
        return None
    if not isinstance(class_weight, Mapping) or not class_weight:
        raise ValueError(f"class_weight must be a non-empty dict of class index to weight: {class_weight!r}")
    table: dict[int, float] = {}
    for cls, weight in class_weight.items():
        try:
            index = operator.index(cls)  # numpy integers too (scikit-learn's compute_class_weight)
            value = float(weight)
        except (TypeError, ValueError):
            index, value = -1, math.nan
        if isinstance(cls, bool) or index < 0 or not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"class_weight maps class indices (int >= 0) to weights (finite, >= 0): {cls!r}: {weight!r}"
            )
        table[index] = value
    weights = torch.ones(max(table) + 1, dtype=torch.float64)
    for cls, weight in table.items():
        weights[cls] = weight
    return weights


def class_weights_of(table: torch.Tensor, targets: Any) -> torch.Tensor:
    """Each sample's class weight: targets are class indices ``[n]`` or one-hot/probabilities ``[n, C]``
    (their argmax, as Keras takes it)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"class_weight needs tensor targets, got {type(targets).__name__}")
    if targets.is_floating_point() and targets.ndim == 2:
        targets = targets.argmax(dim=1)
    if targets.is_floating_point() or targets.ndim != 1:
        raise ValueError(
            f"class_weight needs class-index targets of shape [n] (or one-hot [n, C]), got "
            f"{targets.dtype} targets of shape {list(targets.shape)}"
        )
    table = table.to(targets.device)
    inside = targets.clamp(0, table.numel() - 1)
    return torch.where((targets >= 0) & (targets < table.numel()), table[inside], table.new_ones(()))


def per_sample_loss(
    loss_fn: Callable[..., torch.Tensor], prediction: torch.Tensor, targets: Any
) -> torch.Tensor:
    """``loss_fn``'s loss of each sample ``[n]``: a torch loss module run with ``reduction="none"``, or a
    function taking ``reduction=``; values beyond the sample dimension are averaged (Keras' per-sample
    loss of a sequence or a vector)."""
    if isinstance(loss_fn, nn.modules.loss._Loss):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        values = unreduced(prediction, targets)
    elif _takes_reduction(loss_fn):
        values = loss_fn(prediction, targets, reduction="none")
    else:
        raise TypeError(
            "sample_weight and class_weight weigh each sample's loss, so the loss_fn must give one: use a "
            "torch.nn loss module (it is run with reduction='none'), or a function taking reduction= "
            f"(such as torch.nn.functional.cross_entropy); {loss_fn!r} is neither"
        )
    if values.ndim == 0:
        raise ValueError(f"the loss_fn returned a scalar under reduction='none': {loss_fn!r}")
    return values.reshape(values.shape[0], -1).mean(dim=1) if values.ndim > 1 else values


def _takes_reduction(fn: Callable[..., torch.Tensor]) -> bool:
    try:
        return "reduction" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def weighted_mean(per_sample: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Keras' "sum over batch size": the weighted losses summed, divided by the sample count."""
    return (per_sample * weights.to(per_sample.dtype)).sum() / per_sample.shape[0]
