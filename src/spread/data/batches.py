"""What a training batch is made of: inputs and targets, from the shapes datasets yield."""

from __future__ import annotations

from typing import Any


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
