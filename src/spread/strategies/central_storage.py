"""CentralStorageStrategy: one copy of the variables, the computation replicated on local devices.

tf.distribute's contract: variables are not mirrored; they live once, on one device (the CPU, or the
only accelerator), every local replica computes its slice of the global batch against that one copy,
the replicas' gradients are reduced onto it and the optimizer applies one update.

In spread the replicas run on threads of one process (the machinery of
:class:`~spread.strategies.mirrored.MirroredStrategy`, reused, not copied): each replica's forward reads
the central parameters directly, and autograd's per-parameter locked accumulation sums the replicas'
gradients, each weighted by its share of the global batch, into the central ``.grad``. That *is* the
reduction onto the central copy, with no gradient copy at all. One ``optimizer.step()`` then updates
the one copy; there is nothing to broadcast back.

Where the variables may live: on the CPU when the replicas compute on the CPU (one logical device per
core by default), or on the accelerator when the replicas compute on one accelerator (as TF does for a
single GPU). Variables on the CPU with computation on a GPU would need per-replica device copies of
every parameter for each step; that is not built, and asking for it is refused with that reason.
Several GPUs in one process are refused too (one process per GPU:
:class:`~spread.strategies.multi_worker_mirrored.MultiWorkerMirroredStrategy`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spread.errors import SpreadError
from spread.strategies.mirrored import MirroredStrategy


def _physical(device: torch.device) -> torch.device:
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is not None:
        return device
    current = device.type == "cuda" and torch.cuda.is_available()
    return torch.device(device.type, torch.cuda.current_device() if current else 0)


class CentralStorageStrategy(MirroredStrategy):
    """Synchronous data parallelism in one process, variables stored once on ``parameter_device``.

    Args:
        compute_devices: the replicas' devices (all on one physical device); default: one logical
            CPU device per core, or the GPU (one replica) when there is one.
        parameter_device: where the one copy of the variables lives; default and only supported
            value: the physical device the replicas compute on (``"cpu"`` for CPU replicas).
        num_replicas: number of replicas when ``compute_devices`` is not given.
        intra_op_threads: threads each replica's ops may use (see MirroredStrategy).
        sync_batchnorm: BatchNorm statistics over the global batch (see MirroredStrategy).
    """

    def __init__(
        self,
        compute_devices: Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
        *,
        num_replicas: int | None = None,
        intra_op_threads: int | str = "auto",
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(
            devices=compute_devices,
            num_replicas=num_replicas,
            intra_op_threads=intra_op_threads,
            sync_batchnorm=sync_batchnorm,
        )
        compute = _physical(self.device)
        wanted = compute if parameter_device is None else _physical(torch.device(parameter_device))
        if wanted != compute:
            self.close()
            raise SpreadError(
                f"CentralStorageStrategy keeps the variables where the replicas compute; got "
                f"parameter_device={str(parameter_device)!r} with replicas on {compute}. Variables on one "
                f"device with computation on another (per-replica parameter copies each step) is not built."
            )
        self._parameter_device = compute

    @property
    def parameter_device(self) -> torch.device:
        """The device holding the one copy of every variable."""
        return self._parameter_device

    @property
    def compute_devices(self) -> tuple[torch.device, ...]:
        return self.devices
