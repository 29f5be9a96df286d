"""``hierarchical``: sum inside each node, across one leader per node, then hand the result back.

A node is ``local_world_size`` consecutive ranks (as ``spread run``/torchrun number them), so on one
machine a smaller ``local_world_size`` simulates several nodes. Per call:

1. all-reduce inside the node: ``shm`` when the node's ranks share a host (always, for a real node),
   else the backend's own all-reduce in the node's subgroup;
2. the node leaders (local rank 0) all-reduce the node sums across nodes (``ring`` by default);
3. each leader broadcasts the total inside its node (through shared memory with ``shm``).

``bytes_sent`` adds up the inner algorithms' counts. Construction creates process subgroups with
``dist.new_group``, which every process of the default group must call in the same order: build
this algorithm on every rank at the same point (as :func:`make_algorithm` does), over the default
group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.comm.algorithms.base import AllReduceAlgorithm
from spread.comm.algorithms.native import NativeAllReduce
from spread.comm.algorithms.ring import RingAllReduce
from spread.comm.algorithms.shm import ShmAllReduce, same_host
from spread.comm.ops import Collectives, destroy_group


class HierarchicalAllReduce(AllReduceAlgorithm):
    """Two-level all-reduce: inside nodes of ``local_world_size`` ranks, then across node leaders."""

    name = "hierarchical"

    def __init__(self, collectives: Collectives, *, local_world_size: int, across: str = "ring") -> None:
        super().__init__(collectives)
        n, local = self.world_size, local_world_size
        if collectives.group is not None and self.peers != list(range(dist.get_world_size())):
            raise ValueError("hierarchical all-reduce runs over the default process group only")
        if not isinstance(local, int) or local < 1 or n % local:
            raise ValueError(f"local_world_size must divide the world size {n}, got {local!r}")
        if across not in ("ring", "native"):
            raise ValueError(f"across must be 'ring' or 'native', got {across!r}")
        self.local_world_size = local
        self.node, self.local_rank = divmod(self.rank, local)
        nodes = n // local
        self.inner: AllReduceAlgorithm | None = None
        self.outer: AllReduceAlgorithm | None = None
        self._node_group = None
        self._groups: list = []  # every subgroup made here (non-members' entries included), to destroy
        if local > 1:
            groups = [dist.new_group(list(range(k * local, (k + 1) * local))) for k in range(nodes)]
            self._groups += groups
            self._node_group = groups[self.node]
            node = Collectives(self._node_group, device=collectives.device)
            self.inner = ShmAllReduce(node) if same_host(node) else NativeAllReduce(node)
        if nodes > 1:
            leaders = dist.new_group([k * local for k in range(nodes)])
            self._groups.append(leaders)
            if self.local_rank == 0:
                outer_cls = RingAllReduce if across == "ring" else NativeAllReduce
                self.outer = outer_cls(Collectives(leaders, device=collectives.device))

    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        before = self._inner_bytes()
        if self.inner is not None:
            self.inner._all_reduce_flat(buffer)
        if self.outer is not None:
            self.outer._all_reduce_flat(buffer)
        if self.inner is not None and self.world_size > self.local_world_size:
            if isinstance(self.inner, ShmAllReduce):
                self.inner.broadcast_flat(buffer, src=0)
            else:
                leader = self.node * self.local_world_size
                dist.broadcast(buffer, src=leader, group=self._node_group)
        self.bytes_sent += self._inner_bytes() - before

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """In shared memory when the node's sum goes through ``shm`` (no copy inside the node)."""
        if self.inner is not None:
            return self.inner.allocate(numel, dtype, device)
        return super().allocate(numel, dtype, device)

    def _inner_bytes(self) -> int:
        return sum(a.bytes_sent for a in (self.inner, self.outer) if a is not None)

    def close(self) -> None:
        super().close()
        for algorithm in (self.inner, self.outer):
            if algorithm is not None:
                algorithm.close()
                algorithm.collectives.close()
        for group in self._groups:
            destroy_group(group)
        self._groups.clear()
        self._node_group = None
