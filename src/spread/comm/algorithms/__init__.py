"""All-reduce algorithms over a flat buffer, chosen by name (see :data:`ALGORITHMS`).

``"auto"`` rule (provisional until measured on more machines): ``shm`` when the backend is gloo
(CPU buffers) and every rank runs on this machine, ``native`` otherwise (NCCL on GPUs, or ranks on
several hosts). On the 2-core development machine ``shm`` beat gloo's all-reduce at every size from
4 KB to 64 MB between 2 processes (see ``benchmarks/allreduce_bus.py``), so the rule has no size
threshold.
"""

from __future__ import annotations

import torch.distributed as dist

from spread.comm.algorithms.base import AllReduceAlgorithm, PendingAllReduce, segment_bounds
from spread.comm.algorithms.hierarchical import HierarchicalAllReduce
from spread.comm.algorithms.native import NativeAllReduce
from spread.comm.algorithms.reduce_to_one import ReduceToOneAllReduce
from spread.comm.algorithms.ring import RingAllReduce
from spread.comm.algorithms.shm import ShmAllReduce, same_host
from spread.comm.ops import Collectives

ALGORITHMS: dict[str, type[AllReduceAlgorithm]] = {
    "native": NativeAllReduce,
    "ring": RingAllReduce,
    "reduce_to_one": ReduceToOneAllReduce,
    "hierarchical": HierarchicalAllReduce,
    "shm": ShmAllReduce,
}
ALGORITHM_NAMES = ("auto", *ALGORITHMS)


def resolve_auto(collectives: Collectives) -> str:
    """The algorithm ``"auto"`` stands for on this group (collective: every rank must call)."""
    if dist.get_backend(collectives.group) != "gloo" or collectives.device.type != "cpu":
        return "native"
    return "shm" if same_host(collectives) else "native"


def make_algorithm(
    name: str, collectives: Collectives, *, local_world_size: int | None = None
) -> AllReduceAlgorithm:
    """Build the algorithm called ``name`` over ``collectives``' group, on every rank at once.

    ``local_world_size`` (ranks per node, default: the whole group) is used by ``hierarchical``.
    Raises ``ValueError`` for an unknown name, and for ``shm`` when the ranks are on several hosts.
    """
    if name not in ALGORITHM_NAMES:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; choose one of {', '.join(ALGORITHM_NAMES)}")
    if name == "auto":
        name = resolve_auto(collectives)
    if name == "hierarchical":
        local = collectives.world_size if local_world_size is None else local_world_size
        return HierarchicalAllReduce(collectives, local_world_size=local)
    return ALGORITHMS[name](collectives)


__all__ = [
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "AllReduceAlgorithm",
    "HierarchicalAllReduce",
    "NativeAllReduce",
    "PendingAllReduce",
    "ReduceToOneAllReduce",
    "RingAllReduce",
    "ShmAllReduce",
    "make_algorithm",
    "segment_bounds",
    "resolve_auto",
]
