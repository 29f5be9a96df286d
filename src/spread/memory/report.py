"""What a process holds of the model's training state, in bytes: parameters, gradients, optimizer state,
and (when measured) the activations a replica keeps for backward.

Why: sharded data parallelism is chosen for memory, so its saving must be visible and checkable
(``Strategy.memory_report``). Bytes are counted by storage, each storage once, so views into one
flat buffer, and a parameter whose storage was released (size 0), count what is really allocated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from spread.comm.local_parts import local_part


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state held by this process when the report was taken, and the activation bytes
    of the last ``Strategy.measure_activations()`` window (None: never measured): the peak bytes one
    replica kept saved for backward, what ``spread plan`` predicts as activations per device."""

    parameter_bytes: int
    gradient_bytes: int  # ``.grad`` tensors and the gradient exchange's own buffers
    optimizer_state_bytes: int
    activation_bytes: int | None = None
    # Of the three above, the bytes held off the device (``ShardedStrategy(offload=...)``): in host
    # memory beside an accelerator, in memory-mapped files on a CPU (:func:`offloaded_bytes`).
    offloaded_bytes: int = 0
    # Copies kept only to recover without restart (``spread run --recover``): ShardedStrategy's buddy
    # copy of a neighbour's shard and its own rollback point. Not in the three above.
    recovery_copy_bytes: int = 0

    @property
    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state together (what ZeRO divides)."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes

    @property
    def device_bytes(self) -> int:
        """The model state the device holds (a CPU process: in its memory, not in files), with the
        copies kept for recovery."""
        return self.model_state_bytes - self.offloaded_bytes + self.recovery_copy_bytes


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped). ``seen``: storages
    already counted elsewhere (updated), so a storage shared by two categories counts once. A
    tensor-parallel ``DTensor`` counts the shard this process holds."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = local_part(t).untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def offloaded_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device) -> int:
    """Bytes of the distinct storages behind ``tensors`` held off ``device``: in host memory when
    ``device`` is an accelerator, or in a memory-mapped file (:mod:`spread.memory.host_store`)."""
    return storage_bytes(
        t
        for t in tensors
        if t is not None
        and t.device.type == "cpu"
        and (device.type != "cpu" or t.untyped_storage().filename is not None)
    )


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in ``optimizer``'s per-parameter state (moments, momentum buffers, steps)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
