"""Mixed precision for the Trainer: autocast around forward and loss, a loss scaler for fp16.

``"32"``: nothing changes. ``"bf16"``: forward passes and losses run under ``torch.autocast`` with
bfloat16 on the strategy's device type (CPU or accelerator); bfloat16 has float32's range, so no loss
scaling is needed. ``"fp16"``: autocast with float16 and a ``torch.amp.GradScaler``: the loss is
multiplied by the scale before backward, gradients are unscaled before clipping and the optimizer
step, and a step whose gradients overflowed is skipped and the scale lowered (that is the scaler
working, not a failure: it is counted in ``Trainer.scaler_skipped_steps``, not handed to
``on_nonfinite``, which still judges the loss itself). fp16 on the CPU is supported because torch's
CPU autocast and GradScaler support it (it is usually slower than bf16 there).

Parameters, gradients and optimizer state stay float32 (autocast casts per operation; it never
changes the parameters), so gradients are reduced between replicas in float32. Evaluation and
prediction run under the same autocast as training. The scaler's state (scale, growth tracker) is part
of :class:`~spread.callbacks.BackupAndRestore` backups.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

PRECISIONS = ("32", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: Any) -> str:
    """``precision`` as one of :data:`PRECISIONS` (``32`` the number is accepted too)."""
    value = str(precision) if isinstance(precision, int) and not isinstance(precision, bool) else precision
    if value not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got precision={precision!r}")
    return value


class Precision:
    """The autocast context and (fp16) the loss scaler of one Trainer on ``device``."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.name = check_precision(precision)
        self.device_type = device.type
        self.dtype = _DTYPES.get(self.name)
        self.scaler = torch.amp.GradScaler(device.type) if self.name == "fp16" else None

    def autocast(self) -> AbstractContextManager[Any]:
        """The context of forward passes and losses (nothing for ``"32"``)."""
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (multiplied by the loss scale under fp16)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (before clipping or reading their norm)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """``optimizer.step()``; under fp16 through the scaler, which skips it on overflow and lowers
        its scale. Returns whether the optimizer stepped."""
        if self.scaler is None:
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= scale  # lowered only after an overflow

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
