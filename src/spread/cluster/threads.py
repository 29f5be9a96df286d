"""Each training process's share of the host's cores when no launcher chose one.

``spread run`` and torchrun set ``OMP_NUM_THREADS`` for the processes they start; processes started
another way (one per task with ``TF_CONFIG``, ``srun``, a scheduler's own variables) each default to
every core, and several of them on one host then fight over the cores: on 2 cores, 0.8-3.4 s per
step against 4-23 ms. So a strategy joining a job with several training processes on this host
sets torch's threads to the host's share, unless ``OMP_NUM_THREADS`` says otherwise.
"""

from __future__ import annotations

import logging
import os

import torch

from spread.cluster.spec import ClusterSpec

_log = logging.getLogger(__name__)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def share_cores(spec: ClusterSpec) -> int | None:
    """Give this process its share of the host's cores (``torch.set_num_threads``) when it is one
    of several training processes here and ``OMP_NUM_THREADS`` is not set; the thread count set,
    or None when nothing changed."""
    if spec.local_world_size <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    share = max(1, _cores() // spec.local_world_size)
    if torch.get_num_threads() <= share:
        return None
    torch.set_num_threads(share)
    if spec.local_rank == 0:
        _log.warning(
            "spread: %d training processes share this host's %d cores and OMP_NUM_THREADS is not set: "
            "each uses %d thread(s), as under spread run (set OMP_NUM_THREADS to choose)",
            spec.local_world_size,
            _cores(),
            share,
        )
    return share
