"""The optimizer-state wire format of a checkpoint gathered from several ranks (each owning some
parameters' state): a JSON header and flat tensors, so no rank ever unpickles another's bytes."""

from __future__ import annotations

import json
from typing import Any

import torch

from spread.comm import Collectives
from spread.errors import SpreadError


def broadcast_optimizer_state(
    collectives: Collectives,
    state: dict[int, dict[str, Any]],
    owned: list[int],
    *,
    src: int,
    device: torch.device,
) -> dict[int, dict[str, Any]]:
    """Rank ``src``'s optimizer state for the parameter indices ``owned``, on every rank: a JSON
    description (keys, dtypes, shapes, plain values; never a pickle), then the tensors, one flat
    broadcast per dtype. Tensors that were on the CPU at ``src`` arrive on the CPU, the others on
    ``device``. Collective over ``collectives``' group."""
    mine = collectives.rank == src
    entries: list[list[Any]] = []
    tensors: list[torch.Tensor] = []
    if mine:
        for i in owned:
            for key, value in state.get(i, {}).items():
                if isinstance(value, torch.Tensor):
                    dtype_name = str(value.dtype).removeprefix("torch.")
                    entries.append(
                        [i, key, "tensor", dtype_name, list(value.shape), value.device.type == "cpu"]
                    )
                    tensors.append(value.detach().to(collectives.device))
                elif value is None or isinstance(value, (bool, int, float)):
                    entries.append([i, key, "value", value])
                else:
                    raise TypeError(
                        f"optimizer state {i}.{key} is a {type(value).__name__}; cannot gather it"
                    )
    blob = torch.tensor(list(json.dumps(entries).encode()) if mine else [], dtype=torch.uint8)
    size = torch.tensor([blob.numel()], dtype=torch.int64, device=collectives.device)
    collectives.broadcast(size, src=src, name="optimizer_state_header_size")
    header = (
        blob.to(collectives.device)
        if mine
        else torch.empty(int(size.item()), dtype=torch.uint8, device=collectives.device)
    )
    collectives.broadcast(header, src=src, name="optimizer_state_header")
    if not mine:
        entries = json.loads(bytes(header.cpu().tolist()).decode())
        for entry in entries:
            if entry[2] == "tensor":
                dtype = getattr(torch, entry[3], None)
                if not isinstance(dtype, torch.dtype):
                    raise SpreadError(f"rank {src} described optimizer state with dtype {entry[3]!r}")
                tensors.append(torch.empty(entry[4], dtype=dtype, device=collectives.device))
    collectives.broadcast_tensors(tensors, src=src, name="pipeline_optimizer_state")
    out: dict[int, dict[str, Any]] = {}
    pending = iter(tensors)
    for entry in entries:
        i, key = int(entry[0]), str(entry[1])
        if entry[2] == "tensor":
            value = next(pending)
            out.setdefault(i, {})[key] = (value.cpu() if entry[5] else value.to(device)).clone()
        else:
            out.setdefault(i, {})[key] = entry[3]
    return out
