"""The caller's thread-local torch state, carried into replica threads.

PyTorch keeps autocast (enabled and dtype, per device type), grad mode, inference mode, the default
saved-tensor hooks and the current accelerator per *thread*. A pool thread starts with the defaults,
so a replica run on one would silently compute in fp32 with gradients on while the caller's thread
(replica 0) used ``torch.autocast(dtype=torch.bfloat16)`` or ``torch.no_grad()``. torch's own
``nn.parallel.parallel_apply`` carries grad mode and autocast's on/off only (the dtype falls back to
the device type's default); :func:`capture` takes all of the above, :func:`applied` re-enters it on
the replica thread, so every replica computes under the caller's contexts.

Not carried: ``TorchFunctionMode``/``TorchDispatchMode`` stacks (``with torch.device(...)`` and
similar modes): they are Python objects whose sharing between threads is the mode's own business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

# Device types torch's autocast knows (``torch.is_autocast_enabled(t)`` accepts each); the current
# accelerator's type is added at capture time, which covers a renamed PrivateUse1 backend.
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia")


@dataclass(frozen=True)
class ThreadState:
    """What a replica thread must share with the thread that called ``strategy.run``."""

    grad_enabled: bool
    inference_mode: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) of each enabled autocast
    autocast_cache: bool
    saved_tensor_hooks: tuple[Callable, Callable] | None
    accelerator_index: int | None


def _autocast_device_types() -> list[str]:
    types = list(AUTOCAST_DEVICE_TYPES)
    if torch.accelerator.is_available():
        current = torch.accelerator.current_accelerator()
        if current is not None and current.type not in types:
            types.append(current.type)
    return types


def capture() -> ThreadState:
    """The calling thread's state (call it on the thread that calls ``strategy.run``)."""
    enabled = tuple(
        (t, torch.get_autocast_dtype(t)) for t in _autocast_device_types() if torch.is_autocast_enabled(t)
    )
    accelerator = torch.accelerator.current_device_index() if torch.accelerator.is_available() else None
    return ThreadState(
        grad_enabled=torch.is_grad_enabled(),
        inference_mode=torch.is_inference_mode_enabled(),
        autocast=enabled,
        autocast_cache=torch.is_autocast_cache_enabled(),
        saved_tensor_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
        accelerator_index=accelerator,
    )


@contextmanager
def applied(state: ThreadState) -> Iterator[None]:
    """Run the body on this thread under ``state`` (entered in the order a caller would have)."""
    with ExitStack() as stack:
        if state.accelerator_index is not None:
            stack.enter_context(torch.accelerator.device_index(state.accelerator_index))
        if state.inference_mode:
            stack.enter_context(torch.inference_mode(True))
        stack.enter_context(torch.set_grad_enabled(state.grad_enabled))
        for device_type, dtype in state.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=state.autocast_cache))
        if state.saved_tensor_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state.saved_tensor_hooks))
        yield
