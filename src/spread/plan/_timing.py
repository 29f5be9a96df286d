"""Timing primitives shared by the model profile and the concurrency measurements."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def take(batch: Any, n: int) -> Any:
    """The first ``n`` samples of ``batch`` (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, list | tuple):
        return type(batch)(take(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: take(v, n) for k, v in batch.items()}
    return batch


def same_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and settings over ``params`` (the copies).

    ``defaults`` can hold keys the constructor does not take (torch 2.13's AdamW records
    ``decoupled_weight_decay``), so only the constructor's own arguments are passed on.
    """
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return type(optimizer)(params, **settings)


def median_time(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm-up: allocator, kernels, lazy init
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
