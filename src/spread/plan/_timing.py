"""Timing primitives shared by the model profile and the concurrency measurements."""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import nn

from spread._device import wait_for_device


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


Key = TypeVar("Key", bound=Hashable)


def interleaved_medians(
    calls: dict[Key, Callable[[], None]],
    repeats: int,
    before: Callable[[Key], None] | None = None,
    min_seconds: float = 0.0,
) -> dict[Key, float]:
    """Median seconds of each of ``calls``, timed in ``repeats`` interleaved rounds after a warm-up round.

    Why not each setting's repeats in a block: this VM's speed drifts by tens of percent within minutes,
    so settings timed one block after another (all of 1 thread, then all of 2 threads) are compared on
    two different machines, and their ratio (what the planner predicts from) takes the drift. Here each
    round times every call once, the order rotating from round to round, so drift hits all settings
    alike. ``before(key)`` runs untimed before each call (for example to set the thread count).

    ``min_seconds``: go on with more rounds until the timed rounds span at least this long. Interleaving
    cancels drift between settings, not drift of all of them: a few seconds of rounds take the speed of
    that moment (a ResNet's step, in 10-second windows of one run, read 84 to 130 ms), and every
    prediction made from it moves with it. Rounds over half a minute take the machine's typical speed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if min_seconds < 0:
        raise ValueError(f"min_seconds must be at least 0, got {min_seconds}")
    keys = list(calls)
    for key in keys:  # warm-up: allocator, kernels, lazy optimizer state
        if before is not None:
            before(key)
        calls[key]()
    times: dict[Key, list[float]] = {key: [] for key in keys}
    began = time.perf_counter()
    r = 0
    while keys and (r < repeats or time.perf_counter() - began < min_seconds):
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            if before is not None:
                before(key)
            wait_for_device()
            start = time.perf_counter()
            calls[key]()
            wait_for_device()
            times[key].append(time.perf_counter() - start)
        r += 1
    return {key: statistics.median(seconds) for key, seconds in times.items()}
