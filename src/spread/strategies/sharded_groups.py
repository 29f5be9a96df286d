"""Which processes ShardedStrategy splits its state over: all of them (ZeRO, FSDP's full sharding), or
groups of them (hybrid sharding, HSDP): each group holds one whole copy of the model state, split
over its members, and the groups are replicas of each other.

Why groups: a reduce-scatter and an all-gather over every process of a job cross the slow network
between machines for every block, every step; within one machine's processes they stay on its fast
links, and only the reduced gradient shards (1/group of the gradients) cross machines, in an
all-reduce between the processes that hold the same shard. The price is memory: each rank holds
1/group, not 1/world, of the model state.

The groups are ``count`` runs of ``size`` consecutive ranks (ranks are numbered machine by machine,
as torchrun and ``spread run`` do, so ``size`` = the processes of one machine puts each group on one
machine); the *replica group* of a rank is the ranks at the same position in every group. As a
``DeviceMesh`` this is FSDP2's HSDP mesh: ``(count, size)`` named ``("replicate", "shard")``, tensors
placed ``(Replicate(), Shard(0))``, which is how checkpoints store them (each piece once: DCP drops
the replicas' copies) and why they reshard at another world size or group size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spread.cluster import ClusterSpec
from spread.comm import Collectives
from spread.comm.ops import destroy_group

REPLICATE_AXIS, SHARD_AXIS = "replicate", "shard"  # FSDP2's HSDP mesh dimensions, in its order
NODE = "node"  # shard_group_size="node": one group per machine


def check_shard_group_size(value: object) -> None:
    """Raise ``ValueError`` naming ``shard_group_size`` for a value that is no group size (before the
    job is joined: nothing to undo)."""
    if value is None or value == NODE:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"shard_group_size must be None (every process), 'node' (the processes of one machine) "
            f"or a positive integer, got {value!r}"
        )


def resolve_shard_group_size(value: int | str | None, cluster: ClusterSpec) -> int:
    """The number of processes per group ``value`` asks for in ``cluster``'s job; ``ValueError``
    naming ``shard_group_size`` when the groups would not split the job evenly."""
    check_shard_group_size(value)
    world = cluster.world_size
    if value is None:
        return world
    size = cluster.local_world_size if value == NODE else int(value)
    if world % size:
        where = f"'node' is {size} processes on this machine" if value == NODE else f"{size}"
        raise ValueError(
            f"shard_group_size={value!r} does not divide the job's {world} processes ({where}): "
            f"every group must hold the same number of processes; pass a divisor of {world}"
        )
    return size


@dataclass(frozen=True)
class ShardGroups:
    """This rank's collectives for sharded data parallelism.

    ``shard``: the ranks its state is split over (reduce-scatter, all-gather; the whole job without
    hybrid sharding); ``replicas``: the ranks holding the same shard in the other groups (an
    all-reduce of reduced gradient shards), None with one group; ``mesh``: the ``("replicate",
    "shard")`` DeviceMesh, None with one group.
    """

    shard: Collectives
    replicas: Collectives | None = None
    mesh: DeviceMesh | None = None
    _groups: tuple[dist.ProcessGroup, ...] = field(default=(), repr=False)

    @property
    def size(self) -> int:
        """Processes per group: each holds 1/size of the model state."""
        return self.shard.world_size

    @property
    def count(self) -> int:
        """Number of groups (replicas of the model state)."""
        return 1 if self.replicas is None else self.replicas.world_size

    def release(self) -> None:
        """Let go of the groups made for hybrid sharding (the whole job's group is not ours)."""
        if self.replicas is None:
            return
        self.shard.close()
        self.replicas.close()
        for group in self._groups:
            destroy_group(group)


def make_shard_groups(world: Collectives, device: torch.device, size: int, timeout: float) -> ShardGroups:
    """Groups of ``size`` consecutive ranks of ``world`` (``size`` divides its size; see
    :func:`resolve_shard_group_size`). Collective over the job with more than one group: every rank
    makes every group, in the same order; their collectives fail after ``timeout`` seconds."""
    if world.world_size % size:
        raise ValueError(f"shard_group_size={size} does not divide the job's {world.world_size} processes")
    if size == world.world_size:
        return ShardGroups(world)
    count = world.world_size // size
    layout = torch.arange(world.world_size).view(count, size)
    deadline = timedelta(seconds=timeout)
    shard_groups = [dist.new_group(row.tolist(), timeout=deadline) for row in layout]
    replica_groups = [dist.new_group(column.tolist(), timeout=deadline) for column in layout.t()]
    position, index = world.rank % size, world.rank // size
    mine_shard, mine_replicas = shard_groups[index], replica_groups[position]
    mesh = DeviceMesh.from_group(
        [mine_replicas, mine_shard], device.type, mesh=layout, mesh_dim_names=(REPLICATE_AXIS, SHARD_AXIS)
    )
    return ShardGroups(
        shard=Collectives(mine_shard, device=device),
        replicas=Collectives(mine_replicas, device=device),
        mesh=mesh,
        _groups=(*shard_groups, *replica_groups),
    )
