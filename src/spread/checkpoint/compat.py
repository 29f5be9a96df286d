"""Say exactly how a checkpoint differs from what it is loaded into, before anything is overwritten.

``torch``'s own ``load_state_dict`` errors stop at the first kind of problem and say nothing about
the optimizer or the strategy; a resumed run that silently mixes layouts is worse. These helpers list
every missing, unexpected, reshaped or retyped tensor and every differing configuration field.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from spread.errors import CheckpointMismatchError


def tensor_leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(dotted.path, tensor)`` for every tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from tensor_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from tensor_leaves(value, f"{prefix}.{i}" if prefix else str(i))


def _signature(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def tensor_mismatches(saved: Any, expected: Any) -> list[str]:
    """Every tensor path missing from ``saved``, unexpected in it, or with another shape or dtype."""
    have = dict(tensor_leaves(saved))
    want = dict(tensor_leaves(expected))
    problems = [f"missing key {k!r}" for k in want if k not in have]
    problems += [f"unexpected key {k!r}" for k in have if k not in want]
    for key in want.keys() & have.keys():
        if _signature(want[key]) != _signature(have[key]):
            problems.append(f"{key!r}: saved {_signature(have[key])}, expected {_signature(want[key])}")
    return sorted(problems, key=lambda p: p.split("'")[1] if "'" in p else p)


def field_mismatches(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """Every configuration field whose saved value differs from the current one."""
    return [
        f"{name}: saved {saved.get(name)!r}, now {value!r}"
        for name, value in expected.items()
        if name in saved and saved[name] != value
    ]


def optimizer_mismatches(
    saved: Mapping[str, Any], optimizer: torch.optim.Optimizer, shapes: Sequence[torch.Size] | None = None
) -> list[str]:
    """Parameter groups and per-parameter state shapes of a saved optimizer vs ``optimizer``.
    ``shapes``: the one-device shape of each of its parameters, in group order, where the
    optimizer steps something else (a strategy's shards of them); default: its parameters' own."""
    problems = []
    groups = [len(g["params"]) for g in saved.get("param_groups", [])]
    current = [len(g["params"]) for g in optimizer.param_groups]
    if groups != current:
        return [f"optimizer parameters per group: saved {groups}, now {current}"]
    if shapes is None:
        shapes = [p.shape for g in optimizer.param_groups for p in g["params"]]
    for index, state in sorted(saved.get("state", {}).items()):
        if not isinstance(index, int) or not 0 <= index < len(shapes):
            problems.append(f"optimizer state for unknown parameter {index!r}")
            continue
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shapes[index]:
                problems.append(
                    f"optimizer state {index}.{name}: saved {tuple(value.shape)}, "
                    f"parameter is {tuple(shapes[index])}"
                )
    return problems


def raise_if(problems: list[str], path: str, what: str) -> None:
    if problems:
        raise CheckpointMismatchError(path, what, problems)
