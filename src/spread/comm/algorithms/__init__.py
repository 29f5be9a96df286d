"""All-reduce algorithms over a flat buffer, chosen by name (see :data:`ALGORITHMS`).

The ``"auto"`` rule, by backend and buffer size, written from ``benchmarks/allreduce_bus.py`` on the
2-core development machine (2 processes, fp32, 4 KB to 64 MB; ``docs/results/``, all-reduce studies):

* **gloo (CPU buffers), every rank on this host, Linux** -> ``shm`` at every size. With buffers from
  ``allocate`` (as the gradient buckets are) it measured 2.5-9.5x gloo's bus bandwidth on a quiet
  machine (5.8x at 16 MB, 7x at 64 MB) and 5-17x on a loaded one, where gloo's loopback TCP suffers
  most; it also won at 4 KB (one round of two datagram barriers against gloo's TCP round trips).
  No size threshold: no size was found where another algorithm beat it.
  Not under a file-size limit (``ulimit -f``) on any rank: the kernel counts its segments as files.
* **gloo across hosts** -> ``native``. Our ``ring`` measured 0.9-1.1x ``native`` for 4-64 MB and far
  worse below 1 MB (each point-to-point message costs a Python round trip), ``reduce_to_one``
  0.7-0.9x from 4 MB; ``hierarchical`` across real hosts was not measured, so it is not chosen.
* **NCCL (GPU buffers)** -> ``native``: NCCL's own rings and trees are the reference there.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from spread.comm.algorithms.base import AllReduceAlgorithm, PendingAllReduce, segment_bounds
from spread.comm.algorithms.hierarchical import HierarchicalAllReduce
from spread.comm.algorithms.native import NativeAllReduce
from spread.comm.algorithms.reduce_to_one import ReduceToOneAllReduce
from spread.comm.algorithms.ring import RingAllReduce
from spread.comm.algorithms.shm import ShmAllReduce, same_host, shm_supported, shm_unlimited
from spread.comm.ops import Collectives

ALGORITHMS: dict[str, type[AllReduceAlgorithm]] = {
    "native": NativeAllReduce,
    "ring": RingAllReduce,
    "reduce_to_one": ReduceToOneAllReduce,
    "hierarchical": HierarchicalAllReduce,
    "shm": ShmAllReduce,
}
ALGORITHM_NAMES = ("auto", *ALGORITHMS)

_log = logging.getLogger(__name__)


def resolve_auto(collectives: Collectives) -> str:
    """The algorithm ``"auto"`` stands for on this group (collective: every rank must call)."""
    if dist.get_backend(collectives.group) != "gloo" or collectives.device.type != "cpu":
        return "native"
    on_one_host = same_host(collectives)  # collective: called on every rank, whatever the platform
    if not (on_one_host and shm_supported()):
        return "native"
    if not shm_unlimited(collectives):
        _log.warning(
            "communication 'auto' uses 'native', not 'shm': a rank has a file-size limit (`ulimit -f`), "
            "and the kernel counts shared memory as a file"
        )
        return "native"
    return "shm"


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
