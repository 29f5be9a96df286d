"""Waiting for an accelerator before reading a clock, for every timer in the package."""

from __future__ import annotations

import torch


def wait_for_device() -> None:
    """Wait for queued GPU work, so a wall-clock reading covers the kernels a call launched.

    CUDA kernels run asynchronously: without this a timed call returns when its kernels are
    queued, not done. On a CPU-only process it does nothing (and never initializes CUDA).
    """
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
