"""One replica on one device: the reference every synchronous strategy must match, and the way to
run a spread script without any distribution (testing, debugging, a laptop)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spread.data import ReplicaLayout
from spread.strategies.base import Strategy, one_replica_tensor
from spread.strategies.context import ReplicaContext, _set_replica_context, get_replica_context
from spread.values import on_device


def default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


class OneDeviceStrategy(Strategy):
    """Everything on ``device`` (default: the current CUDA device if any, else the CPU).

    ``sync_batchnorm`` is accepted so that scripts can pass it to any strategy; with one replica the
    batch is the global batch, so it changes nothing.
    """

    def __init__(self, device: str | torch.device | None = None, *, sync_batchnorm: bool = False) -> None:
        super().__init__(sync_batchnorm=sync_batchnorm)
        self._device = torch.device(device) if device is not None else default_device()

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def _layout(self) -> ReplicaLayout:
        return ReplicaLayout(num_replicas=1, first_local_replica=0, num_local_replicas=1)

    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        pass  # nothing to synchronise with

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        outer = get_replica_context()
        args, kwargs = on_device(args, self.device), on_device(kwargs or {}, self.device)
        _set_replica_context(ReplicaContext(self, 0, 1, 1.0))
        try:
            return fn(*args, **kwargs)
        finally:
            _set_replica_context(outer)

    def _sum_over_replicas(self, value: Any) -> tuple[torch.Tensor, int]:
        return one_replica_tensor(value, self.device), 1

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        return one_replica_tensor(value, self.device)
