"""A deterministic measure of activation memory: the bytes autograd saves for backward.

Why: peak-memory readings on a CPU depend on the allocator and on what else runs; the tensors a
forward pass saves for backward do not. :class:`SavedTensorBytes` counts them through a saved-tensor
hook (each storage once), which is what checkpointing and offload are meant to reduce. Tensors saved
inside a checkpointed block are dropped by the checkpoint and are not counted, by design.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks


class SavedTensorBytes(saved_tensors_hooks):
    """Context manager counting the bytes saved for backward inside it (``.bytes``, ``.tensors``).

    ``exclude``: tensors not to count (pass ``model.parameters()`` to count activations only).
    Storages are counted once each, however many views of them are saved.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self.tensors = 0
        super().__init__(self._pack, _unpack)

    def __enter__(self) -> SavedTensorBytes:  # type: ignore[override]  # torch types it -> None
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
            self.tensors += 1
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
