"""Find the model in a user's training script without training it.

``spread plan train.py`` runs the script in this process, single-process (no ``WORLD_SIZE``, no
``TF_CONFIG``), until it calls ``Trainer.fit``; at that call the trainer's model, loss, optimizer,
training data and global batch size are taken and the script is stopped. A script with its own loop
can instead name a factory, ``module:function`` returning ``(model, loss_fn, inputs, targets)`` or
``(model, loss_fn, inputs, targets, optimizer)`` with ``inputs``/``targets`` one global batch. Either
way the model is profiled as the Trainer runs it: a dict of inputs as keyword arguments, ``loss_fn``
on the output's prediction (a Hugging Face ``ModelOutput``'s ``logits``), and ``loss_fn=None`` for a
model that computes its own loss (from ``labels``).
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spread.data.batches import as_batch
from spread.errors import WorldSizeError
from spread.plan._forward import LossFn, samples_in
from spread.strategies import OneDeviceStrategy
from spread.train import Trainer
from spread.train.trainer import resolve_global_batch_size

_CLUSTER_VARIABLES = ("TF_CONFIG", "WORLD_SIZE", "RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_ID")


class CaptureError(RuntimeError):
    """The script or factory did not give the planner a model to profile."""


@dataclass
class CapturedWorkload:
    """A model with what it trains on, ready for :func:`spread.plan.workload.measure_model`."""

    model: nn.Module
    loss_fn: LossFn  # None: the model computes its own loss (Trainer(loss_fn=None))
    inputs: Any
    targets: Any
    optimizer: torch.optim.Optimizer | None
    global_batch: int
    source: str


class _FitReached(BaseException):
    """Raised inside the script at ``Trainer.fit`` to stop it (a BaseException: scripts catch Exception)."""

    def __init__(self, workload: CapturedWorkload) -> None:
        super().__init__("spread plan: captured the workload at Trainer.fit")
        self.workload = workload


def _first_batch(data: Any, global_batch: int) -> tuple[Any, Any]:
    """The inputs and targets of the first global batch, as the Trainer splits them (a dict of the
    model's keyword arguments is the inputs, with its ``labels`` as the targets)."""
    batches = OneDeviceStrategy().distribute_dataset(data, global_batch, shuffle=False)
    for batch in batches:
        first = as_batch(batch, who="Trainer")
        return first.inputs, first.targets
    raise CaptureError("the training data given to Trainer.fit is empty")


@contextmanager
def _single_process_environment() -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in _CLUSTER_VARIABLES if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def capture_script(path: str, args: Sequence[str] = (), *, source: str | None = None) -> CapturedWorkload:
    """Run the script at ``path`` with ``args`` until its first ``Trainer.fit`` and capture that."""
    if not os.path.isfile(path):
        raise CaptureError(f"no such script: {path}")
    original_fit = Trainer.fit

    def fit(
        self: Trainer,
        train_data: Any,
        *,
        global_batch_size: int | None = None,
        batch_size: int | None = None,
        **_: Any,
    ) -> Any:
        global_batch_size = resolve_global_batch_size(global_batch_size, batch_size)
        x, y = _first_batch(train_data, global_batch_size)
        raise _FitReached(
            CapturedWorkload(
                self.model, self.loss_fn, x, y, self.optimizer, global_batch_size, source or path
            )
        )

    argv, search_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python path` does: imports beside it
    Trainer.fit = fit  # type: ignore[method-assign]
    try:
        with _single_process_environment():
            runpy.run_path(path, run_name="__main__")
    except _FitReached as reached:
        return reached.workload
    except SystemExit as exc:
        raise CaptureError(f"{path} exited (status {exc.code}) before calling Trainer.fit") from None
    except WorldSizeError as exc:  # e.g. PipelineStrategy(stages=2): it cannot be built in one process
        raise CaptureError(
            f"spread plan runs {path} as one process, but its strategy needs {exc.needed} processes; "
            f"give the model instead: `spread plan --model module:function` returning "
            f"(model, loss_fn, inputs, targets[, optimizer])"
        ) from None
    except CaptureError:
        raise
    except Exception as exc:  # the script's own failure before Trainer.fit: say why it may have failed here
        raise CaptureError(
            f"{path} raised {type(exc).__name__} before calling spread.Trainer.fit: {exc}\n"
            f"spread plan runs the script as one process with no cluster in its environment (no RANK, "
            f"WORLD_SIZE or TF_CONFIG) and stops it at Trainer.fit; a script that sets up "
            f"torch.distributed itself or trains in its own loop cannot be planned from the script: "
            f"give the model instead, `spread plan --model module:function` returning "
            f"(model, loss_fn, inputs, targets[, optimizer])"
        ) from exc
    finally:
        Trainer.fit = original_fit  # type: ignore[method-assign]
        sys.argv = argv
        sys.path[:] = search_path
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # a strategy the script built and never closed
    raise CaptureError(
        f"{path} finished without calling spread.Trainer.fit; for a custom training loop pass a factory "
        f"instead: `spread plan --model module:function` returning (model, loss_fn, inputs, targets)"
    )


def capture_factory(spec: str) -> CapturedWorkload:
    """Call ``module:function`` and take the model, loss and one global batch it returns."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CaptureError(f"--model must look like 'package.module:function', got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise CaptureError(f"cannot load {spec!r}: {exc}") from None
    result = factory()
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise CaptureError(f"{spec} must return (model, loss_fn, inputs, targets[, optimizer])")
    model, loss_fn, inputs, targets, *rest = result
    if not isinstance(model, nn.Module):
        raise CaptureError(f"{spec} returned {type(model).__name__} as the model, not an nn.Module")
    batch = samples_in(inputs, targets)
    return CapturedWorkload(model, loss_fn, inputs, targets, rest[0] if rest else None, batch, spec)
