"""A hand-made ModelProfile for tests that check its arithmetic (no measuring)."""

from __future__ import annotations

from typing import Any

from spread.plan.workload import ModelProfile


def toy_profile(**changes: Any) -> ModelProfile:
    """A one-thread profile of a 1-byte model, with ``changes`` applied to its fields."""
    fields: dict[str, Any] = dict(
        name="toy",
        param_bytes=1.0,
        sparse_bytes=0.0,
        sparse_row_bytes=0.0,
        sparse_rows_per_sample=0.0,
        optimizer_bytes=0.0,
        activation_bytes_per_sample=0.0,
        compute={1: (0.0, 1e-3)},
        backward_fraction=0.5,
        optimizer_seconds=0.0,
        batch=8,
    )
    fields.update(changes)
    return ModelProfile(**fields)
