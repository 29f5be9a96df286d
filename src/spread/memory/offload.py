"""Activation offload ("memory swap"): tensors saved for backward wait in host memory.

Why: between a layer's forward and its backward, the tensors autograd saved for it sit idle in device
memory. Under :class:`OffloadActivations` they are copied to host memory when saved and copied back
when backward needs them, so device memory holds about the activations of the layer being computed,
for the cost of two host-device copies per saved tensor (asynchronous with pinned memory on CUDA).

On a CPU the "move" is a no-op: tensors are kept where they are, the hooks still run (and count).
Parameters and other tensors named in ``keep`` are never copied (they stay on the device anyway),
nor are tensors smaller than ``min_bytes`` (not worth a copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from spread.memory.forward_wrap import has_wrapper, unwrap_forward, wrap_forward

KIND = "activation_offload"


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, subclasses)
        return 0


class OffloadActivations(saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it are moved to host memory until backward.

    Args:
        pin_memory: copy into pinned host memory, asynchronously (default: when CUDA is available).
        min_bytes: tensors smaller than this stay on their device.
        keep: tensors never to offload (typically the model's parameters: pass ``model.parameters()``).

    Counters (for tests and reports): ``saved`` tensors seen, ``offloaded`` tensors and
    ``offloaded_bytes`` moved to the host, ``restored`` tensors handed back to backward.
    """

    def __init__(
        self,
        *,
        pin_memory: bool | None = None,
        min_bytes: int = 0,
        keep: Iterable[torch.Tensor] = (),
    ) -> None:
        if min_bytes < 0:
            raise ValueError(f"min_bytes must be >= 0, got {min_bytes!r}")
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.min_bytes = min_bytes
        self._keep = {_storage_key(t) for t in keep} - {0}
        self.saved = self.offloaded = self.offloaded_bytes = self.restored = 0
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]  # torch types it -> None
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
        self.saved += 1
        nbytes = tensor.numel() * tensor.element_size()
        if (
            tensor.device.type == "cpu"
            or tensor.is_sparse
            or nbytes < self.min_bytes
            or _storage_key(tensor) in self._keep
        ):
            return None, tensor
        host = torch.empty(
            tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=self.pin_memory
        )
        host.copy_(tensor, non_blocking=self.pin_memory)
        self.offloaded += 1
        self.offloaded_bytes += nbytes
        return tensor.device, host

    def _unpack(self, packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
        self.restored += 1
        device, tensor = packed
        return tensor if device is None else tensor.to(device, non_blocking=self.pin_memory)


def offload_module(
    module: nn.Module, *, pin_memory: bool | None = None, min_bytes: int = 0
) -> OffloadActivations:
    """Offload the activations ``module`` saves in every forward (in place; parameters stay).

    Returns the hooks object whose counters add up over all calls. Undo with :func:`remove_offload`.
    """
    if has_wrapper(module, KIND):
        raise ValueError(f"{type(module).__name__} already offloads its activations")
    hooks = OffloadActivations(pin_memory=pin_memory, min_bytes=min_bytes, keep=module.parameters())

    def offloaded(inner: Any, *args: Any, **kwargs: Any) -> Any:
        with hooks:
            return inner(*args, **kwargs)

    wrap_forward(module, KIND, offloaded)
    return hooks


def remove_offload(model: nn.Module) -> int:
    """Undo :func:`offload_module` on ``model`` and its submodules; returns how many were restored."""
    return sum(unwrap_forward(m, KIND) for m in model.modules())
