"""What the chief's and the workers' coordinators exchange: task references, values, results.

A scheduled task travels as a *reference*, never code: the function's module and qualified name,
which the worker looks up among functions of its own script (:func:`resolve_function`), and its
arguments as tensors and JSON values (:func:`encode_value`), per-worker iterators standing for each
worker's own dataset. Results come back the same way and complete the chief's :class:`RemoteValue`.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from spread.errors import SpreadError
from spread.ps.wire import Tensors

FunctionReference = tuple[str, str]  # (module, qualified name)
DatasetSource = Callable[[], Iterable[Any]] | Iterable[Any]  # what create_per_worker_dataset takes


class RemoteValue:
    """The result of a scheduled function, available once a worker ran it (``fetch``)."""

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self._done = threading.Event()
        self._value: Any = None
        self._error: str | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's return value; raises :class:`SpreadError` if it raised on the worker."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"task {self.task_id} did not finish within {timeout}s")
        if self._error is not None:
            raise SpreadError(f"task {self.task_id} failed on a worker: {self._error}")
        return self._value

    def _set(self, value: Any, error: str | None) -> None:
        """Set once, by the chief's coordinator: the task's value, or its error."""
        self._value, self._error = value, error
        self._done.set()


@dataclass(frozen=True)
class PerWorkerIterator:
    """Stands for each worker's own iterator over a per-worker dataset, when passed to ``schedule``."""

    dataset_id: int

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError("a per-worker iterator is read inside a scheduled function, on a worker")


@dataclass(frozen=True)
class PerWorkerDataset:
    """A dataset built on each worker by ``dataset_fn``; ``iter()`` it to pass to scheduled functions."""

    dataset_id: int

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self.dataset_id)


# -- function references ---------------------------------------------------------------------------
def function_reference(fn: Callable[..., Any]) -> FunctionReference:
    """How ``fn`` travels: it must be a module-level Python function workers can find by name."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname or not _is_own_function(_lookup(module, qualname), module, qualname):
        raise ValueError(
            f"schedule() needs a module-level Python function that workers can find by name; got {fn!r}. "
            f"Define it at the top level of the script (workers run the same script)."
        )
    if _lookup(module, qualname) is not fn:
        raise ValueError(f"schedule() got {fn!r}, but {module}.{qualname} is another object")
    return module, qualname


def resolve_function(module: str, qualname: str, *, modules: set[str]) -> Callable[..., Any]:
    """The function the chief named, if it is one this worker may run: a plain Python function
    defined in one of ``modules`` (the script's); a name never causes an import."""
    module, qualname = str(module), str(qualname)
    fn = _lookup(module, qualname) if module in modules and "<" not in qualname else None
    if not _is_own_function(fn, module, qualname):
        raise SpreadError(
            f"the chief scheduled {module}.{qualname}, which this worker does not run: a worker runs only "
            f"Python functions defined at the top level of its script's modules "
            f"({', '.join(sorted(modules))})"
        )
    return fn


def _is_own_function(obj: Any, module: str, qualname: str) -> TypeGuard[types.FunctionType]:
    """A plain Python function defined where its name says (not a builtin, a class, or a function
    of another module reached through an attribute or an import into this one)."""
    return isinstance(obj, types.FunctionType) and obj.__module__ == module and obj.__qualname__ == qualname


def _lookup(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


# -- values ----------------------------------------------------------------------------------------
def encode_value(value: Any, tensors: Tensors) -> Any:
    """``value`` as JSON, its tensors moved into ``tensors`` (a frame's tensors) by key."""
    if isinstance(value, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = value.detach()
        return {"$tensor": key}
    if isinstance(value, PerWorkerIterator):
        return {"$iterator": value.dataset_id}
    if isinstance(value, list | tuple):
        return {"$list": [encode_value(v, tensors) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("dict keys in scheduled arguments and results must be strings")
        return {"$dict": {k: encode_value(v, tensors) for k, v in value.items()}}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(
        f"scheduled arguments and results must be tensors, numbers, strings, lists, dicts or "
        f"per-worker iterators; got {type(value).__name__}"
    )


def decode_value(value: Any, tensors: Tensors, iterator: Callable[[int], Any] | None = None) -> Any:
    """The value :func:`encode_value` encoded; ``iterator(dataset_id)`` gives a worker's own
    iterator (None on the chief: results cannot carry one)."""
    if isinstance(value, dict):
        if "$tensor" in value:
            return tensors[value["$tensor"]]
        if "$iterator" in value:
            if iterator is None:
                raise SpreadError("a per-worker iterator cannot be returned to the chief")
            return iterator(int(value["$iterator"]))
        if "$list" in value:
            return [decode_value(v, tensors, iterator) for v in value["$list"]]
        if "$dict" in value:
            return {k: decode_value(v, tensors, iterator) for k, v in value["$dict"].items()}
        raise SpreadError(f"malformed scheduled value {value!r}")
    return value
