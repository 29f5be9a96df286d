"""Where am I: the strategy whose scope is active, and the replica this thread is running.

Glossary (the tf.distribute words, used the same way across spread):

* **replica**: one copy of the model's computation, fed one slice of each global batch;
* **worker**: one process driving one or more replicas;
* **cross-replica context**: code outside ``strategy.run`` (the training loop itself);
* **replica context**: code inside ``strategy.run``: ``get_replica_context()`` says which replica.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from spread.strategies.base import Strategy

_local = threading.local()
_scope_stack: list[Strategy] = []
_default: Strategy | None = None  # the strategy outside any scope: one device, made on first use


@dataclass(frozen=True, slots=True)
class ReplicaContext:
    """The replica a piece of code runs for, inside ``strategy.run``."""

    strategy: Strategy
    replica_id_in_sync_group: int
    num_replicas_in_sync: int
    weight: float = 1.0  # this replica's share of the global batch (samples / global samples)


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or None in cross-replica context."""
    return getattr(_local, "replica", None)


def _set_replica_context(ctx: ReplicaContext | None) -> None:
    _local.replica = ctx


def get_strategy() -> Strategy:
    """The strategy whose ``scope()`` is active (innermost), else a default one-device strategy."""
    ctx = get_replica_context()
    if ctx is not None:
        return ctx.strategy
    if _scope_stack:
        return _scope_stack[-1]
    from spread.strategies.one_device import OneDeviceStrategy

    global _default
    if _default is None:
        _default = OneDeviceStrategy()
    return _default


def _push_scope(strategy: Strategy) -> None:
    _scope_stack.append(strategy)


def _pop_scope(strategy: Strategy) -> None:
    if _scope_stack and _scope_stack[-1] is strategy:
        _scope_stack.pop()
