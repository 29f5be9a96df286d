"""Argument checks and "is this better?" rules shared by the callbacks that watch a metric.

ModelCheckpoint and EarlyStopping must agree on what ``mode="auto"`` means and on the wording of
their errors, so both take them from here instead of keeping two copies that drift apart.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

MODES = ("auto", "min", "max")
# Metric names that grow as the model gets better; everything else (loss, mse, mae) shrinks.
_HIGHER_IS_BETTER = ("acc", "auc")


def invalid(name: str, value: Any, expected: str) -> ValueError:
    """A Keras-worded error naming the argument and the value received."""
    return ValueError(f"Invalid value for argument `{name}`. Expected {expected}. Received: {name}={value!r}")


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise invalid("mode", mode, f"one of {MODES}")
    return mode


def resolve_mode(monitor: str, mode: str) -> str:
    """``"min"`` or ``"max"``: ``"auto"`` picks max for accuracy/AUC-like names, min otherwise."""
    check_mode(mode)
    if mode != "auto":
        return mode
    return "max" if any(tag in monitor.lower() for tag in _HIGHER_IS_BETTER) else "min"


def monitor_op(mode: str) -> Callable[[float, float], bool]:
    """Strict comparison ``(current, reference) -> bool`` that says "current is better"."""
    return operator.lt if mode == "min" else operator.gt


def worst_value(mode: str) -> float:
    return math.inf if mode == "min" else -math.inf


def check_freq(name: str, value: Any) -> str | int:
    """``"epoch"`` or a positive number of batches (bools are refused: ``True`` is not a count)."""
    if value == "epoch" and isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise invalid(name, value, '"epoch" or a positive integer number of batches')


def as_float(value: Any) -> float | None:
    """The monitored value as a Python float, or None when it is not a number (missing, a string)."""
    if value is None:
        return None
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
