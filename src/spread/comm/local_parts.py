"""What a tensor holds on this rank: the part data-parallel collectives exchange.

A tensor-parallel model (torch's ``parallelize_module``) holds ``DTensor`` parameters: each rank of a
tensor-parallel group holds a shard (or a replica) of the whole tensor, and the ranks at the same
place in every data-parallel replica hold the same part. Data parallelism then averages those parts
rank by rank over the data axis, never the whole tensor: torch's collectives refuse a ``DTensor``
("does not have a sharding strategy registered"), and its whole value is not on any one rank.
Plain tensors are their own part, so code written for them is unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``tensor``: a ``DTensor``'s local shard (sharing its storage, so
    writing into it writes the ``DTensor``), a plain tensor itself."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():  # outside autograd: the storage itself, not a differentiable view
        return tensor.to_local()


def like_parameter(local: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """A gradient for ``parameter`` made of this rank's part ``local``: a ``DTensor`` laid out as
    ``parameter`` is when it is one, else ``local`` itself."""
    if not isinstance(parameter, DTensor):
        return local
    return DTensor.from_local(
        local,
        parameter.device_mesh,
        parameter.placements,
        shape=parameter.shape,
        stride=parameter.stride(),
    )
