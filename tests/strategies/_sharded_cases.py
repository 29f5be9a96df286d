"""ShardedStrategy configurations run one after another in one job, shared by the sharded tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import spread


def make_sharded(config: str, **options) -> spread.ShardedStrategy:
    """``"stage"`` or ``"stage/units"`` (``"parameters/modules"``) as a strategy."""
    shard, _, units = config.partition("/")
    return spread.ShardedStrategy(shard=shard, units=units or "model", **options)


def every_stage(configs: tuple[str, ...], job: Callable[[spread.ShardedStrategy, int], Any]) -> dict:
    """Run ``job(strategy, rank)`` under each configuration; the first strategy owns the process group."""
    rank = int(os.environ["RANK"])
    out = {}
    owner = None
    try:
        for stage in configs:
            strategy = make_sharded(stage)
            owner = owner or strategy
            out[stage] = job(strategy, rank)
            if strategy is not owner:
                strategy.close()
        return out
    finally:
        if owner is not None:
            owner.close()
