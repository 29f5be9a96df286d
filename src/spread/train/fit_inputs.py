"""Keras' ways of handing ``fit`` its data: ``sample_weight=`` beside tensors, ``validation_split=``.

Both apply to in-memory tensors only, as in Keras: ``(x, y)`` (a tuple or list) or ``{"x": ..., "y":
...}``, every tensor holding the samples along dimension 0. A dataset carries its own weights as
``(x, y, sample_weight)`` triples (or a ``"sample_weight"`` entry) and its own validation set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _tensor_data(data: Any) -> bool:
    if isinstance(data, tuple | list):
        return len(data) in (2, 3) and all(isinstance(t, torch.Tensor) for t in data)
    if isinstance(data, Mapping):
        return {"x", "y"} <= data.keys() and all(isinstance(t, torch.Tensor) for t in data.values())
    return False


def _samples(data: Any) -> int:
    tensors = list(data.values()) if isinstance(data, Mapping) else list(data)
    counts = {int(t.shape[0]) if t.ndim else -1 for t in tensors}
    if len(counts) != 1 or -1 in counts:
        raise ValueError(f"fit's tensors must hold the same number of samples, got {sorted(counts)}")
    return counts.pop()


def with_sample_weight(data: Any, sample_weight: Any) -> Any:
    """``data`` with each sample's weight beside it: ``(x, y, w)``, or a ``"sample_weight"`` entry."""
    if not _tensor_data(data) or (isinstance(data, tuple | list) and len(data) == 3):
        raise TypeError(
            "fit(sample_weight=...) goes with tensor data, (x, y) or {'x': ..., 'y': ...}, as in Keras; "
            "a dataset yields (x, y, sample_weight) triples instead"
        )
    weights = torch.as_tensor(sample_weight).to(torch.float32)
    if weights.ndim != 1:
        raise ValueError(f"sample_weight must be a 1-D array of numbers, got shape {list(weights.shape)}")
    n = _samples(data)
    if weights.shape[0] != n:
        raise ValueError(f"sample_weight holds {weights.shape[0]} weights for {n} samples")
    if isinstance(data, Mapping):
        return {**data, "sample_weight": weights}
    return (data[0], data[1], weights)


def split_for_validation(data: Any, fraction: float) -> tuple[Any, Any]:
    """``(train, validation)``: the last ``fraction`` of the samples, before any shuffling, held out
    for validation (Keras' ``validation_split``)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction < 1:
        raise ValueError(f"validation_split must be a fraction in (0, 1), got {fraction!r}")
    if not _tensor_data(data):
        raise TypeError(
            "fit(validation_split=...) splits tensor data, (x, y) or {'x': ..., 'y': ...}, as in Keras; "
            f"a {type(data).__name__} cannot be split: pass validation_data instead"
        )
    n = _samples(data)
    split_at = math.floor(n * (1.0 - fraction))
    if split_at == 0 or split_at == n:
        raise ValueError(f"validation_split={fraction} of {n} samples leaves one side empty")
    if isinstance(data, Mapping):
        return {k: t[:split_at] for k, t in data.items()}, {k: t[split_at:] for k, t in data.items()}
    return tuple(t[:split_at] for t in data), tuple(t[split_at:] for t in data)
