"""Metrics as per-sample functions, summed over replicas so that every rank sees the same numbers.

A metric is a function ``(y_pred, y_true) -> tensor of per-sample values``; its value over an epoch
is the sum of those values over all samples of all replicas divided by the sample count. Summing
(not averaging averages) is what keeps the result exact when replicas hold different sample counts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accuracy(y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy for class scores ``[n, classes]``; thresholded at 0.5 for one output per sample."""
    if y_pred.ndim == y_true.ndim + 1:
        return (y_pred.argmax(dim=-1) == y_true).float().reshape(y_true.shape[0], -1).mean(dim=1)
    return ((y_pred > 0.5).to(y_true.dtype) == y_true).float().reshape(y_true.shape[0], -1).mean(dim=1)


def mean_squared_error(y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
    return (y_pred - y_true).pow(2).reshape(y_true.shape[0], -1).mean(dim=1)


def mean_absolute_error(y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
    return (y_pred - y_true).abs().reshape(y_true.shape[0], -1).mean(dim=1)


BUILTIN: dict[str, MetricFn] = {
    "accuracy": accuracy,
    "acc": accuracy,
    "mse": mean_squared_error,
    "mean_squared_error": mean_squared_error,
    "mae": mean_absolute_error,
    "mean_absolute_error": mean_absolute_error,
}


def resolve_metrics(metrics: Sequence[str | MetricFn] | None) -> dict[str, MetricFn]:
    """Names and functions of the requested metrics ("accuracy", "mse", "mae" or callables)."""
    resolved: dict[str, MetricFn] = {}
    for m in metrics or ():
        if isinstance(m, str):
            if m not in BUILTIN:
                raise ValueError(f"unknown metric {m!r}; built in: {sorted(BUILTIN)}, or pass a function")
            name = "accuracy" if m == "acc" else m
            resolved[name] = BUILTIN[m]
        elif callable(m):
            name = getattr(m, "__name__", type(m).__name__)
            if name == "loss" or name in resolved:
                raise ValueError(f"metric name {name!r} is taken; give the function another name")
            resolved[name] = m
        else:
            raise TypeError(f"a metric must be a name or a function, got {m!r}")
    return resolved


class RunningSums:
    """Sums of loss and metrics over the samples seen, kept in float64 on the CPU."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = ["loss", *names]
        self.totals = torch.zeros(len(self.names) + 1, dtype=torch.float64)

    def add(self, packed: torch.Tensor) -> None:
        """``packed`` = [loss_sum, sample_count, metric_sums...] already reduced over replicas."""
        self.totals += packed.detach().to("cpu", torch.float64)

    @property
    def count(self) -> int:
        return int(self.totals[1].item())

    def results(self, prefix: str = "") -> dict[str, float]:
        count = self.totals[1].item()
        if count <= 0:
            return {}
        values = [self.totals[0], *self.totals[2:]]
        return {prefix + name: float(v / count) for name, v in zip(self.names, values, strict=True)}
