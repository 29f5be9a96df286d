"""Wrap a module's forward in place, without changing its type or its state_dict keys (checkpointing,
offload and the pipeline strategy share it).

Why not a wrapper module: a wrapper renames every parameter (``block.module.weight``), so
checkpoints would no longer load into the plain model. An instance attribute ``forward`` shadows the
class's method instead; removing it restores the module exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class WrappedForward:
    """Callable stored as ``module.forward``: calls ``around(inner, *args, **kwargs)``."""

    def __init__(self, module: nn.Module, kind: str, around: Callable[..., Any]) -> None:
        self.module = module
        self.kind = kind
        self.around = around
        self.previous = module.__dict__.get("forward")  # an instance forward set before us, if any

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.around(self.inner, *args, **kwargs)


def wrappers(module: nn.Module) -> list[WrappedForward]:
    """The forward wrappers on ``module``, outermost first."""
    found = []
    current = module.__dict__.get("forward")
    while isinstance(current, WrappedForward):
        found.append(current)
        current = current.previous
    return found


def has_wrapper(module: nn.Module, kind: str) -> bool:
    return any(w.kind == kind for w in wrappers(module))


def wrap_forward(module: nn.Module, kind: str, around: Callable[..., Any]) -> bool:
    """Add a ``kind`` wrapper around ``module.forward``; False when one is already there."""
    if has_wrapper(module, kind):
        return False
    module.forward = WrappedForward(module, kind, around)
    return True


def unwrap_forward(module: nn.Module, kind: str) -> bool:
    """Remove the ``kind`` wrapper from ``module``; False when there was none."""
    chain = wrappers(module)
    for i, w in enumerate(chain):
        if w.kind != kind:
            continue
        if i == 0:
            if w.previous is None:
                del module.forward
            else:
                module.forward = w.previous
        else:
            chain[i - 1].previous = w.previous
        return True
    return False
