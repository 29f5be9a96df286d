"""One reader for a stream: process 0 reads an ``IterableDataset`` and sends each global batch on.

A stream that cannot shard itself (no ``shard(num_shards, index)``) would otherwise be read in
full by every process, each keeping its slice of every global batch: N times the reading, and a
stream that is consumed as it is read (a queue, a socket) would hand each sample to one process
only. Here process 0 alone reads and collates each global batch and broadcasts it; every process
cuts its own replicas' slice as from any global batch, so the result is the same as one device's.
Accelerate's ``dispatch_batches`` does the same. Large streams are better given a ``shard`` method
(each process then reads only its files).

What travels is tensors and a JSON description (tree structure, dtypes, shapes, sample count):
nothing is unpickled. Batches must be trees of tensors (``default_collate`` makes numbers tensors);
anything else is refused with a message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

_END: dict[str, Any] = {"end": True}
Broadcast = Callable[[list[torch.Tensor]], None]  # every process's tensors become process 0's


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a dispatched batch names an unknown dtype {name!r}")
    return dtype


def _send_description(broadcast: Broadcast, description: dict[str, Any] | None) -> dict[str, Any]:
    """Process 0 passes its description; the others pass ``None`` and get it."""
    encoded = json.dumps(description).encode() if description is not None else b""
    length = torch.tensor([len(encoded)], dtype=torch.int64)
    broadcast([length])
    buffer = (
        torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
        if description is not None
        else torch.empty(int(length), dtype=torch.uint8)
    )
    broadcast([buffer])
    return description if description is not None else json.loads(bytes(buffer.tolist()).decode())


def dispatched(
    global_batches: Iterator[tuple[Any, int]] | None,
    broadcast: Broadcast,
    cut: Callable[[Any, int], tuple[Any, list[int]]],
) -> Iterator[tuple[Any, list[int], int]]:
    """Each step's local batch, sizes and global count. ``global_batches`` (process 0 only, else
    ``None``) yields collated global batches with their sample counts; ``cut(batch, count)`` takes
    this process's part of one."""
    try:
        yield from _dispatch(global_batches, broadcast, cut)
    finally:  # abandoned or failed: process 0's reading thread must stop too
        if isinstance(global_batches, Generator):
            global_batches.close()


def _dispatch(
    global_batches: Iterator[tuple[Any, int]] | None,
    broadcast: Broadcast,
    cut: Callable[[Any, int], tuple[Any, list[int]]],
) -> Iterator[tuple[Any, list[int], int]]:
    while True:
        if global_batches is not None:
            item = next(global_batches, None)
            if item is None:
                _send_description(broadcast, _END)
                return
            batch, count = item
            leaves, spec = pytree.tree_flatten(batch)
            if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
                kinds = sorted({type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)})
                _send_description(broadcast, _END)  # the others must not wait for a batch
                raise TypeError(
                    f"a stream read by one process and sent to the others must give batches of tensors; "
                    f"this one holds {', '.join(kinds)}: give the dataset a shard(num_shards, index) "
                    f"method so that each process reads its own part, or a collate_fn returning tensors"
                )
            description: dict[str, Any] = {
                "spec": pytree.treespec_dumps(spec),
                "leaves": [[str(t.dtype), list(t.shape)] for t in leaves],
                "count": count,
            }
            _send_description(broadcast, description)
            tensors = [t.contiguous() for t in leaves]
        else:
            description = _send_description(broadcast, None)
            if description.get("end"):
                return
            spec = pytree.treespec_loads(description["spec"])
            tensors = [torch.empty(shape, dtype=_dtype(dtype)) for dtype, shape in description["leaves"]]
            count = int(description["count"])
        broadcast(tensors)
        local, sizes = cut(pytree.tree_unflatten(tensors, spec), count)
        yield local, sizes, count
