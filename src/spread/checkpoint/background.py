"""Asynchronous checkpoints: copy the state off the training loop at a step boundary, write it on a
background thread, at most one write in flight.

Why a copy first: the tensors of a ``state_dict`` share the model's and optimizer's storage, which the
next optimizer step overwrites in place. :func:`snapshot` copies every tensor of a state (a CPU clone;
a GPU tensor into pinned host memory with a non-blocking copy, ordered on the current stream before
the next step's kernels, so the training thread does not wait for it) and the background write waits
for the copy (:meth:`Snapshot.ready`) before serialising it. The stall of a save is then the copy, not
the serialisation, the fsyncs and the renames.

Why one write in flight: a second snapshot would double the host memory held, and checkpoints must
be committed in step order (``latest`` never goes back). :meth:`BackgroundWriter.submit` first waits
for the previous write and raises its failure, on the training thread: a failed background write is
never swallowed, it surfaces at the next save or at :meth:`BackgroundWriter.wait` (the end of ``fit``).

The write itself is the same code as a synchronous save (the atomic commit of
:mod:`spread.checkpoint.atomic`), so a crash (SIGKILL) during a background write leaves the previous
checkpoint as ``latest``, exactly as one during a synchronous write does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree


@dataclass
class Snapshot:
    """A copy of a state, detached from the training state; :meth:`ready` before reading it."""

    state: Any
    _event: torch.cuda.Event | None = None

    def ready(self) -> Any:
        """Wait until every copy has landed (GPU copies are asynchronous); returns the state."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.state


class Stager:
    """Makes :class:`Snapshot` s; keeps the pinned host buffers of GPU tensors between snapshots
    (pinning memory is slow, and a job saves the same shapes every time). A buffer is reused only
    once the write that read it has finished, which :class:`BackgroundWriter` guarantees by waiting
    for the previous write before the next snapshot."""

    def __init__(self) -> None:
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}

    def snapshot(self, state: Any) -> Snapshot:
        copies: dict[int, torch.Tensor] = {}  # by id: a tensor held twice (tied weights) is copied once
        on_gpu = False
        leaves, spec = pytree.tree_flatten_with_path(state)
        out = []
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) not in copies:
                    copies[id(leaf)] = self._copy(pytree.keystr(path), leaf)
                    on_gpu = on_gpu or _local(leaf).device.type == "cuda"
                leaf = copies[id(leaf)]
            out.append(leaf)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        return Snapshot(pytree.tree_unflatten(out, spec), event)

    def _copy(self, where: str, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            # This rank's piece, copied, under the same placement (no communication). Built from the
            # spec, as DCP's own staging does: ``from_local`` would move a host copy back to the GPU.
            return DTensor(self._copy(where, tensor.to_local()), tensor._spec, requires_grad=False)
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.clone()
        key = (where, tensor.device.index or 0)
        buffer = self._pinned.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._pinned[key] = buffer
        buffer.copy_(tensor, non_blocking=True)
        return buffer


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class BackgroundWriter:
    """One background thread at a time, writing one checkpoint; its failure raised on the caller's
    thread at the next :meth:`submit` or :meth:`wait`.

    ``name`` says what is written (``"backup"``), in the thread's name and in errors.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.stager = Stager()
        self._thread: threading.Thread | None = None
        self._what = ""
        self.last_write_seconds: float | None = None  # how long the last finished write took

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, state: Any, write: Callable[[Any], object], what: str) -> None:
        """Wait for the write in flight (raising its failure), copy ``state`` (:class:`Stager`: here,
        on the caller's thread), then run ``write(copy)`` on a new thread. ``what`` names the write
        in its failure (``"the checkpoint of step 12 to /ckpt"``)."""
        self.wait()  # first: the copy may reuse the buffers the previous write read
        snapshot = self.stager.snapshot(state)
        failure: list[BaseException] = []

        def run() -> None:
            started = time.perf_counter()
            try:
                write(snapshot.ready())
            except BaseException as exc:  # handed to the training thread by wait()
                failure.append(exc)
            self.last_write_seconds = time.perf_counter() - started

        # daemon: a write stuck on a dead peer or a hung filesystem must not keep a finished process
        # alive; every normal path joins it (wait() at the next save, at the end of fit, at close()).
        thread = threading.Thread(target=run, name=f"spread-{self.name}-writer", daemon=True)
        thread.failure = failure  # type: ignore[attr-defined]
        self._thread, self._what = thread, what
        thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the write in flight is done; raise its failure (once), with a note naming it.
        With ``timeout`` (seconds), raise TimeoutError if it is still running then (it is left running)."""
        failure = self.finish(timeout)
        if failure is not None:
            raise failure

    def finish(self, timeout: float | None = None) -> BaseException | None:
        """Like :meth:`wait`, but return the failure instead of raising it."""
        thread = self._thread
        if thread is None:
            return None
        thread.join(timeout)
        if thread.is_alive():
            return TimeoutError(f"{self._what} was still being written after {timeout:g}s in the background")
        self._thread = None
        errors = thread.failure  # type: ignore[attr-defined]
        if not errors:
            return None
        error = errors[0]
        error.add_note(f"(raised by the background write of {self._what})")
        return error
