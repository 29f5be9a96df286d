"""This process's device and the job's process group, for strategies with a process per replica or stage.

Shared by MultiWorkerMirroredStrategy, PipelineStrategy and ParameterServerStrategy so that device
placement and joining the job happen one way everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.cluster import ClusterSpec
from spread.cluster.rendezvous import Rendezvous, default_backend, rendezvous


def local_device(cluster: ClusterSpec) -> torch.device:
    """This process's GPU (``local_rank`` modulo the GPUs, made current), or the CPU without one."""
    if torch.cuda.is_available():
        torch.cuda.set_device(cluster.local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def join_process_group(
    cluster: ClusterSpec,
    device: torch.device,
    *,
    init_timeout: float | None = None,
    collective_timeout: float | None = None,
) -> Rendezvous | None:
    """Rendezvous and create the default process group, unless one exists already (then ``None``).

    The returned :class:`Rendezvous` owns the group: close it to destroy the group.
    """
    if dist.is_initialized():
        return None
    return rendezvous(
        cluster,
        backend=default_backend(device),
        init_timeout=init_timeout,
        collective_timeout=collective_timeout,
    )
