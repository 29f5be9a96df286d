"""Broadcast a nested value (dicts, lists, tuples, plain scalars, strings, tensors) without pickle.

Recovery without restart hands the survivors one rank's optimizer state and loop position; a pickle
from another process would run whatever it names when loaded. Here the structure travels as JSON
(tensors replaced by their index, dtype and shape) and the tensors as tensors, so a receiver builds
only plain values and tensors of described dtypes.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from spread.comm.ops import Collectives
from spread.errors import SpreadError

_PLAIN = (type(None), bool, int, float, str)


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        dtype = str(value.dtype).removeprefix("torch.")
        return {"T": [len(tensors) - 1, dtype, list(value.shape), value.device.type == "cpu"]}
    if isinstance(value, dict):
        if not all(isinstance(k, _PLAIN) for k in value):
            raise TypeError(f"cannot send a dict keyed by {sorted({type(k).__name__ for k in value})}")
        return {"D": [[k, _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"U": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return {"L": [_encode(v, tensors) for v in value]}
    if isinstance(value, float) and value != value:  # JSON has no NaN literal we accept back
        return {"F": "nan"}
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return {"F": "inf" if value > 0 else "-inf"}
    if isinstance(value, _PLAIN):
        return {"V": value}
    raise TypeError(f"cannot send a {type(value).__name__} (only dicts, lists, tuples, scalars, tensors)")


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    ((kind, body),) = node.items()
    if kind == "T":
        tensor = tensors[body[0]]
        return tensor.cpu() if body[3] else tensor  # where it was at the sender: CPU, or the device
    if kind == "D":
        return {k: _decode(v, tensors) for k, v in body}
    if kind == "U":
        return tuple(_decode(v, tensors) for v in body)
    if kind == "L":
        return [_decode(v, tensors) for v in body]
    if kind == "F":
        return float(body)
    if kind == "V":
        return body
    raise SpreadError(f"a peer sent a structure with an unknown node {kind!r}")


def _tensor_table(node: Any, table: dict[int, tuple[str, list[int]]]) -> None:
    """Index -> (dtype, shape) of every tensor the structure describes."""
    ((kind, body),) = node.items()
    if kind == "T":
        table[body[0]] = (body[1], body[2])
    elif kind == "D":
        for _, v in body:
            _tensor_table(v, table)
    elif kind in ("U", "L"):
        for v in body:
            _tensor_table(v, table)


def broadcast_structure(collectives: Collectives, value: Any, *, src: int, name: str) -> Any:
    """Rank ``src``'s ``value`` on every rank (``value`` is ignored elsewhere). Tensors arrive with
    their dtype and shape, on the CPU if they were there at ``src``, else on the collectives' device.
    Collective over ``collectives``' group."""
    device = collectives.device
    mine = collectives.rank == src
    tensors: list[torch.Tensor] = []
    blob = torch.tensor(list(json.dumps(_encode(value, tensors)).encode()) if mine else [], dtype=torch.uint8)
    size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
    collectives.broadcast(size, src=src, name=f"{name}.header_size")
    header = blob.to(device) if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    collectives.broadcast(header, src=src, name=f"{name}.header")
    tree = json.loads(bytes(header.cpu().tolist()).decode())
    if mine:
        moved = [t.to(device).contiguous() for t in tensors]
    else:
        table: dict[int, tuple[str, list[int]]] = {}
        _tensor_table(tree, table)
        moved = []
        for index in range(len(table)):
            dtype_name, shape = table[index]
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise SpreadError(f"rank {src} described a tensor of dtype {dtype_name!r}")
            moved.append(torch.empty(shape, dtype=dtype, device=device))
    if moved:
        collectives.broadcast_tensors(moved, src=src, name=f"{name}.tensors")
    return value if mine else _decode(tree, moved)
