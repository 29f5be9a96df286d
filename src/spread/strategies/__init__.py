"""Strategies: one API (scope, run, reduce, gather, distribute_dataset) over many ways to distribute.

Glossary: a *replica* is one copy of the computation fed a slice of each global batch; a *worker*
is a process driving one or more replicas; code inside ``strategy.run`` is in *replica context*,
the training loop around it in *cross-replica context*.
"""

from spread.strategies.base import Strategy, TrainingProgram
from spread.strategies.central_storage import CentralStorageStrategy
from spread.strategies.checkpointing import Restored, Stateful, StateLayout
from spread.strategies.context import ReplicaContext, get_replica_context, get_strategy
from spread.strategies.mirrored import MirroredStrategy
from spread.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from spread.strategies.one_device import OneDeviceStrategy
from spread.strategies.parameter_server import ParameterServerStrategy
from spread.strategies.pipeline import PipelineStrategy
from spread.strategies.registry import STRATEGIES, make_strategy
from spread.strategies.sharded import SHARD_STAGES, ShardedStrategy
from spread.values import PerReplica

__all__ = [
    "STRATEGIES",
    "CentralStorageStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "PipelineStrategy",
    "ReplicaContext",
    "SHARD_STAGES",
    "ShardedStrategy",
    "Strategy",
    "TrainingProgram",
    "Restored",
    "StateLayout",
    "Stateful",
    "get_replica_context",
    "get_strategy",
    "make_strategy",
]
