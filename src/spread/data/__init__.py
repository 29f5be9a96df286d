"""Distribute a dataset over replicas: sharding, per-replica batches, shared-seed shuffling."""

from spread.data.distributed import DataChannel, DistributedDataset, ReplicaLayout, StepInfo
from spread.data.sharding import ShardPolicy, split_sizes

__all__ = ["DataChannel", "DistributedDataset", "ReplicaLayout", "ShardPolicy", "StepInfo", "split_sizes"]
