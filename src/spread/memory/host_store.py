"""Where offloaded training state lives: pinned host memory beside an accelerator, memory-mapped files on
a CPU machine.

Why: the point of offload is memory the device (an accelerator's, or a CPU process's RAM) does not
have to hold. Beside an accelerator that is host memory, pinned so copies to and from the device are
asynchronous (:class:`PinnedStore`). On a CPU machine the state is already in host memory, so the
only place left is a file: :class:`DiskStore` maps one shared file per tensor (``MAP_SHARED``, written
back by the kernel; under memory pressure its pages are evicted as any file cache's, and they count
in no process's anonymous memory or ``RLIMIT_DATA``). Each file is unlinked as soon as it is mapped,
so nothing is left on disk after a crash, even a ``SIGKILL``; the per-rank directory holding them is
removed by :meth:`DiskStore.close` (or when the store is collected).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Protocol

import torch


class HostStore(Protocol):
    """Allocates the tensors offloaded state lives in."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements in the store (contents undefined)."""
        ...

    def close(self) -> None: ...


def copy_into(store: HostStore, tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (same shape and dtype) in ``store``."""
    out = store.empty(tensor.numel(), tensor.dtype).view(tensor.shape)
    with torch.no_grad():
        out.copy_(tensor)
    return out


def is_offloaded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a store: a memory-mapped file or pinned host memory."""
    if tensor.device.type != "cpu":
        return False
    storage = tensor.untyped_storage()
    return storage.filename is not None or (storage.nbytes() > 0 and tensor.is_pinned())


class PinnedStore:
    """Pinned (page-locked) host memory: the store beside an accelerator."""

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def close(self) -> None:
        """Nothing to do: the tensors are freed with their last reference."""


class DiskStore:
    """Memory-mapped files in a directory of this process's own (see the module docstring).

    Args:
        directory: where this rank's directory is made (default: the system's temporary directory,
            ``TMPDIR``); it must be on a disk, not a RAM file system, for the state to leave memory.
        rank: named in the directory's name (several ranks of a job share ``directory``).
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, rank: int = 0) -> None:
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix=f"spread-offload-rank{rank}-", dir=directory)
        self._count = 0
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self._cleanup.alive:
            raise RuntimeError(f"DiskStore {self.directory} is closed")
        if numel == 0:  # a file cannot be mapped empty
            return torch.empty(0, dtype=dtype)
        path = os.path.join(self.directory, f"{self._count}.bin")
        self._count += 1
        try:
            tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
        finally:
            if os.path.exists(path):
                os.unlink(path)  # the mapping keeps the file's blocks until it is gone
        return tensor

    def close(self) -> None:
        """Remove this rank's directory (its files were unlinked already; their blocks go with the
        last tensor mapping them)."""
        self._cleanup()
