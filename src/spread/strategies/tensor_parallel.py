"""Tensor parallelism (torch's ``DTensor``, ``parallelize_module``) with data parallelism on the other axis.

The job's processes form a 2-D mesh: along the *tensor* axis the ranks of a tensor-parallel group
hold shards of one model replica (torch's ``ColwiseParallel``/``RowwiseParallel`` make the
parameters ``DTensor``s and run the group's collectives in forward and backward); along the *data*
axis the ranks holding the same shard of different replicas average their gradients, as plain data
parallelism does for whole tensors. This module holds what the data-parallel side needs to know:

* :class:`DataAxis`: which processes this one averages with (its data-parallel group), every such
  group of the job, and the mesh when the strategy built it. The strategy learns the axis from an
  explicit argument (``tensor_parallel=N``: it builds the mesh itself, after it joined the job, so
  the user needs no process group of their own; or ``data_mesh=``: a mesh the script built), never
  by guessing from the parameters: a parameter's mesh says which ranks share it, not which ranks
  hold other replicas;
* :func:`check_parameters`: a ``DTensor`` parameter must be split only across ranks *off* the data
  axis (its mesh meets this process's data-parallel group in this process alone), else averaging
  its local shards would mix different parts of it (FSDP2's ``fully_shard`` on the data axis, or a
  plain strategy over the whole job);
* :func:`refuse_dtensor_parameters`: what every strategy that does not train tensor-parallel
  models says, by name, before it exchanges anything;
* :class:`TensorParallelLayout`: the one-device state (``full_state_dict``, checkpoints): each
  ``DTensor`` gathered whole (``full_tensor``, collective over its tensor-parallel group), and cut
  back to this rank's shard on loading without communication (every rank holds the whole state
  then), so checkpoints are the same as one device's and resume under any data-parallel strategy;
* :func:`gradient_norm`: the whole model's gradient norm for clipping, DTensor shards summed over
  their groups by torch's DTensor arithmetic.

Why the data-parallel collectives run over local shards: torch's collectives refuse a ``DTensor``
("does not have a sharding strategy registered"), and ranks with the same tensor-parallel coordinate
hold the same shard, so averaging shard by shard is averaging the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.utils import get_total_norm

from spread.comm import Collectives
from spread.errors import SpreadError
from spread.strategies.checkpointing import StateLayout
from spread.strategies.clipping import local_norm

DATA_AXIS, TENSOR_AXIS = "dp", "tp"  # torchtitan's names for the two axes


@dataclass(frozen=True)
class DataAxis:
    """The data axis of a job whose replicas are tensor-parallel groups.

    ``collectives`` run over this process's data-parallel group (global ``ranks``, in group order);
    ``groups`` are every data-parallel group of the job, each rank in exactly one; ``mesh`` is the
    ``(dp, tp)`` mesh the strategy built (None when the script passed its own ``data_mesh``).
    """

    collectives: Collectives
    ranks: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    mesh: DeviceMesh | None

    @property
    def first_rank(self) -> int:
        """The global rank of this data-parallel group's first process (it broadcasts the initial
        weights and reads a stream for the group)."""
        return self.ranks[0]

    @property
    def counts_statistics(self) -> bool:
        """Whether this process's group is the one whose step statistics count (rank 0's): every
        tensor-parallel group computes the same loss and metrics, so one data-parallel group's sum is
        the job's."""
        return 0 in self.ranks


def check_axis_arguments(tensor_parallel: Any, data_mesh: Any) -> None:
    """Raise ``ValueError`` naming the argument for a ``tensor_parallel``/``data_mesh`` that cannot
    describe a data axis (before the job is joined: nothing to undo)."""
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be a positive integer, got {tensor_parallel!r}")
    if data_mesh is not None and tensor_parallel != 1:
        raise ValueError(
            "pass tensor_parallel (the strategy builds the mesh) or data_mesh (a mesh you built), not both"
        )
    if data_mesh is not None and (not isinstance(data_mesh, DeviceMesh) or data_mesh.ndim != 1):
        raise ValueError(
            f"data_mesh must be a 1-D DeviceMesh, the data axis of your mesh (e.g. mesh['dp']), "
            f"got {_describe_mesh(data_mesh)}"
        )


def make_data_axis(
    world: Collectives,
    device: torch.device,
    *,
    tensor_parallel: int,
    data_mesh: DeviceMesh | None,
) -> DataAxis | None:
    """The data axis ``tensor_parallel``/``data_mesh`` describe, or None for plain data parallelism
    over the whole job. Collective over the job (every rank calls it alike, after joining the job):
    builds the ``(dp, tp)`` mesh with tensor-parallel ranks adjacent (one machine's GPUs share a
    tensor-parallel group, the axis that talks most), then learns every rank's data-parallel group
    to check that the groups split the job."""
    check_axis_arguments(tensor_parallel, data_mesh)
    if data_mesh is None and tensor_parallel == 1:
        return None
    mesh: DeviceMesh | None = None
    if data_mesh is None:
        if world.world_size % tensor_parallel:
            raise ValueError(
                f"tensor_parallel={tensor_parallel} does not divide the job's {world.world_size} processes"
            )
        mesh = init_device_mesh(
            device.type,
            (world.world_size // tensor_parallel, tensor_parallel),
            mesh_dim_names=(DATA_AXIS, TENSOR_AXIS),
        )
        data_mesh = mesh[DATA_AXIS]
    if data_mesh.device_type != device.type:
        raise ValueError(
            f"data_mesh is a {data_mesh.device_type!r} mesh but this process trains on {device.type!r}"
        )
    group = data_mesh.get_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    groups = _every_group(world, ranks)
    return DataAxis(Collectives(group, device=device), ranks, groups, mesh)


def _every_group(world: Collectives, ranks: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every rank's data-parallel group (collective), checked to split the job into groups of one
    size, each rank in one: otherwise replicas would average with different sets of peers."""
    mine = torch.tensor(ranks, dtype=torch.int64, device=world.device)
    rows = world.all_gather_uneven(mine, name="data_axis_groups")
    by_rank = [tuple(int(r) for r in row.tolist()) for row in rows]
    groups = tuple(dict.fromkeys(by_rank))
    members = sorted(r for g in groups for r in g)
    sizes = {len(g) for g in groups}
    faults = []
    if members != list(range(world.world_size)):
        faults.append("every rank must be in exactly one data-parallel group")
    if len(sizes) != 1:
        faults.append(f"the groups must be of one size, found sizes {sorted(sizes)}")
    if any(rank not in group for rank, group in enumerate(by_rank)):
        faults.append("each rank must be a member of the group it names")
    if faults:
        raise SpreadError(
            f"the data axis does not split the job's {world.world_size} processes: "
            f"{'; '.join(faults)} (groups by rank: {by_rank})"
        )
    return groups


def _describe_mesh(mesh: Any) -> str:
    if isinstance(mesh, DeviceMesh):
        return f"a {mesh.ndim}-D mesh named {mesh.mesh_dim_names}"
    return type(mesh).__name__


def _describe(p: DTensor) -> str:
    ranks = p.device_mesh.mesh.flatten().tolist()
    return (
        f"a DTensor parameter of shape {tuple(p.shape)} placed {tuple(p.placements)} over "
        f"ranks {ranks} (mesh {p.device_mesh.mesh_dim_names})"
    )


def check_parameters(strategy_name: str, params: Iterable[torch.Tensor], data_ranks: Sequence[int]) -> None:
    """Raise :class:`SpreadError` for a ``DTensor`` parameter split across ranks of the data axis
    ``data_ranks`` (this process's data-parallel group): its shards differ from one replica to the
    next, so averaging them would be wrong."""
    data = set(data_ranks)
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if set(p.device_mesh.mesh.flatten().tolist()) & data != {dist.get_rank()}:
            raise SpreadError(
                f"{strategy_name}: {_describe(p)}, which meets this process's data-parallel group "
                f"(ranks {sorted(data)}) in more ranks than this one: its shards would be averaged "
                "with other parts of it. Parallelise the model over the tensor axis only: "
                "MultiWorkerMirroredStrategy(tensor_parallel=N) and parallelize_module(model, "
                f"strategy.mesh[{TENSOR_AXIS!r}], plan), or pass data_mesh=mesh[{DATA_AXIS!r}] of the "
                "mesh you parallelised on"
            )


def refuse_dtensor_parameters(
    strategy_name: str, params: Iterable[torch.Tensor], why: str, *, planned: bool = False
) -> None:
    """Raise :class:`SpreadError` naming ``strategy_name`` and ``why`` when ``params`` hold a
    ``DTensor`` (a tensor-parallel model): called by every strategy that does not train one, before
    it exchanges anything. ``planned``: the combination may come later ("not supported yet")."""
    for p in params:
        if isinstance(p, DTensor):
            raise SpreadError(
                f"{strategy_name} with tensor-parallel (DTensor) parameters is not supported"
                f"{' yet' if planned else ''}: {why}; found {_describe(p)}. Train a model parallelised "
                f"with parallelize_module under MultiWorkerMirroredStrategy(tensor_parallel=N), data "
                f"parallel along strategy.mesh[{DATA_AXIS!r}]"
            )


# -- the one-device state ----------------------------------------------------------------------------
def _whole(value: Any) -> Any:
    """A ``DTensor``'s one-device value (collective over its mesh); anything else as it is."""
    if isinstance(value, DTensor):
        with torch.no_grad():
            return value.full_tensor()
    return value


def _laid_out_like(value: Any, like: Any) -> Any:
    """A one-device tensor cut to this rank's part of ``like`` (a ``DTensor``), without
    communication; anything else as it is."""
    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(like.shape):
        return value  # load_state_dict then names the mismatch
    return distribute_tensor(
        value.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )


class TensorParallelLayout(StateLayout):
    """The one-device layout of a model with ``DTensor`` parameters (see the module docstring)."""

    def full_state_dict(self, obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
        """Collective over the tensor-parallel groups: every ``DTensor`` gathered whole, in state
        order (the same on every rank)."""
        state = obj.state_dict()
        if isinstance(obj, nn.Module):
            return {key: _whole(value) for key, value in state.items()}
        return {
            **state,
            "state": {
                index: {key: _whole(value) for key, value in entry.items()}
                for index, entry in state["state"].items()
            },
        }

    def load_full_state_dict(self, obj: nn.Module | torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        if isinstance(obj, nn.Module):
            current = obj.state_dict()
            laid_out = {key: _laid_out_like(value, current.get(key)) for key, value in state.items()}
            obj.load_state_dict(laid_out)
            return
        params = [p for group in obj.param_groups for p in group["params"]]
        per_param = {
            index: {
                key: _laid_out_like(value, params[index] if 0 <= int(index) < len(params) else None)
                for key, value in entry.items()
            }
            for index, entry in state["state"].items()
        }
        obj.load_state_dict({**state, "state": per_param})

    def module_signature(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """One-device shapes and dtypes without gathering anything (a ``DTensor`` knows its whole
        shape)."""
        return {
            key: _meta(value) if isinstance(value, DTensor) else value
            for key, value in model.state_dict().items()
        }


def _meta(value: DTensor) -> torch.Tensor:
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


# -- clipping ----------------------------------------------------------------------------------------
def gradient_norm(params: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The L2 norm of the whole model's gradient over ``params`` (0-dim float32 on ``device``), equal
    on every rank: ``DTensor`` gradients through torch's DTensor norm (shards summed over their
    tensor-parallel groups: collective), plain ones (replicated layers) as this process holds them."""
    sharded = [p.grad for p in params if isinstance(p.grad, DTensor)]
    plain = [p for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    norms = [local_norm(plain, device)]
    if sharded:
        with torch.no_grad():
            norm = get_total_norm(sharded)
            norms.append(_whole(norm).to(device, torch.float32))
    return torch.linalg.vector_norm(torch.stack(norms))
