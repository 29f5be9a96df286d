"""This process's device and the job's process group, for strategies with a process per replica or stage.

Shared by MultiWorkerMirroredStrategy, PipelineStrategy and ParameterServerStrategy so that device
placement and joining the job happen one way everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.cluster import ClusterSpec
from spread.cluster.rendezvous import Rendezvous, default_backend, rendezvous
from spread.errors import SpreadError


def local_device(cluster: ClusterSpec) -> torch.device:
    """This process's GPU (the ``local_rank``-th, made current), or the CPU without one.

    More processes on a machine than GPUs is refused here: NCCL would fail later with "Duplicate GPU
    detected", and a GPU shared by two ranks would halve each one's memory anyway.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if cluster.local_world_size > gpus:
        raise SpreadError(
            f"rank {cluster.rank}: {cluster.local_world_size} processes on this machine but {gpus} "
            f"GPU{'s' if gpus != 1 else ''}; NCCL needs a GPU per process. Start at most {gpus} per "
            f"machine (spread run -n {gpus}), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPUs"
        )
    torch.cuda.set_device(cluster.local_rank)
    return torch.device("cuda", cluster.local_rank)


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
