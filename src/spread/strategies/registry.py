"""Strategies by name, for ``Trainer(strategy="mirrored")`` and the command line."""

from __future__ import annotations

from typing import Any

from spread.strategies.base import Strategy
from spread.strategies.central_storage import CentralStorageStrategy
from spread.strategies.mirrored import MirroredStrategy
from spread.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from spread.strategies.one_device import OneDeviceStrategy
from spread.strategies.parameter_server import ParameterServerStrategy
from spread.strategies.pipeline import PipelineStrategy
from spread.strategies.sharded import ShardedStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "one_device": OneDeviceStrategy,
    "mirrored": MirroredStrategy,
    "multi_worker_mirrored": MultiWorkerMirroredStrategy,
    "parameter_server": ParameterServerStrategy,
    "central_storage": CentralStorageStrategy,
    "pipeline": PipelineStrategy,
    "sharded": ShardedStrategy,
}


def make_strategy(name_or_strategy: str | Strategy | None, **options: Any) -> Strategy:
    """Return the strategy itself, or build one from its registered name."""
    if isinstance(name_or_strategy, Strategy):
        return name_or_strategy
    if name_or_strategy is None:
        return OneDeviceStrategy(**options)
    try:
        cls = STRATEGIES[name_or_strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {name_or_strategy!r}; known: {sorted(STRATEGIES)}") from None
    return cls(**options)
