"""spread: distributed training for PyTorch, with the strategies tf.distribute describes.

One training script moves from one CPU to many machines by changing the strategy, not the code::

    strategy = spread.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = spread.Trainer(model, optimizer, loss_fn, strategy=strategy, metrics=["accuracy"])
    trainer.fit(train_dataset, epochs=3, global_batch_size=256)

Public names are loaded lazily so that ``spread run`` (the launcher) starts without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Strategy": "spread.strategies",
    "OneDeviceStrategy": "spread.strategies",
    "MirroredStrategy": "spread.strategies",
    "MultiWorkerMirroredStrategy": "spread.strategies",
    "CentralStorageStrategy": "spread.strategies",
    "ParameterServerStrategy": "spread.strategies",
    "ClusterCoordinator": "spread.ps",
    "PipelineStrategy": "spread.strategies",
    "ShardedStrategy": "spread.strategies",
    "PerReplica": "spread.strategies",
    "ReplicaContext": "spread.strategies",
    "get_replica_context": "spread.strategies",
    "get_strategy": "spread.strategies",
    "ReduceOp": "spread.strategies.tf_compat",
    "InputContext": "spread.strategies.tf_compat",
    "compute_average_loss": "spread.strategies.tf_compat",
    "Trainer": "spread.train",
    "callbacks": "spread.callbacks",
    "export": "spread.export",
    "ClusterSpec": "spread.cluster",
    "resolve_cluster": "spread.cluster",
    "errors": "spread.errors",
}

__all__ = [
    "CentralStorageStrategy",
    "ClusterCoordinator",
    "ClusterSpec",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PerReplica",
    "InputContext",
    "PipelineStrategy",
    "ReduceOp",
    "ReplicaContext",
    "ShardedStrategy",
    "Strategy",
    "Trainer",
    "__version__",
    "callbacks",
    "compute_average_loss",
    "errors",
    "export",
    "get_replica_context",
    "get_strategy",
    "resolve_cluster",
]

if TYPE_CHECKING:  # pragma: no cover
    from spread import callbacks, errors, export
    from spread.cluster import ClusterSpec, resolve_cluster
    from spread.ps import ClusterCoordinator
    from spread.strategies import (
        CentralStorageStrategy,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        OneDeviceStrategy,
        ParameterServerStrategy,
        PerReplica,
        PipelineStrategy,
        ReplicaContext,
        ShardedStrategy,
        Strategy,
        get_replica_context,
        get_strategy,
    )
    from spread.strategies.tf_compat import InputContext, ReduceOp, compute_average_loss
    from spread.train import Trainer


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'spread' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name.endswith(name) else getattr(module, name)
    globals()[name] = value
    return value
