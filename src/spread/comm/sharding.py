"""How a group of tensors is split over ranks for sharded data parallelism (ZeRO), and the copy-in /
copy-out between whole tensors and the flat buffers that reduce-scatter and all-gather move.

Each tensor is flattened and cut into ``world_size`` equal chunks, the last ones padded with zeros:
rank ``r`` holds chunk ``r`` of every tensor of the group, one after another in its flat *shard*.
Chunks per tensor (FSDP2's layout) rather than one flat parameter cut once (FSDP1, ZeRO) keep each
parameter a parameter of its own for the optimizer: param groups, per-parameter hyperparameters and
``grad is None`` skipping work as on one device, and every rank's shard has the same size.

One all-gather of the flat shards gives every rank all chunks of every tensor, rank-major
(``world_size`` rows of :attr:`ShardLayout.row_numel`); :meth:`ShardLayout.unpack_into` copies a
tensor out. A reduce-scatter takes the same rank-major layout (:meth:`ShardLayout.pack`) and leaves
each rank the sum of its row. A row can carry ``extra`` slots after the chunks (per-tensor flags).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _ceil_div(n: int, d: int) -> int:
    return -(-n // d)


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor's chunks sit in a rank's flat shard (the same on every rank)."""

    shapes: tuple[torch.Size, ...]
    world_size: int
    chunks: tuple[int, ...]  # elements of each tensor per rank (padded)
    offsets: tuple[int, ...]  # where each tensor's chunk starts in the shard
    extra: int = 0  # slots after the chunks in every row (not part of the shard)

    @classmethod
    def of(cls, shapes: Sequence[torch.Size], world_size: int, *, extra: int = 0) -> ShardLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size!r}")
        chunks = tuple(_ceil_div(torch.Size(s).numel(), world_size) for s in shapes)
        offsets, total = [], 0
        for c in chunks:
            offsets.append(total)
            total += c
        return cls(tuple(torch.Size(s) for s in shapes), world_size, chunks, tuple(offsets), extra)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard (its chunks, padding included)."""
        return sum(self.chunks)

    @property
    def row_numel(self) -> int:
        """Elements of one rank's row in a packed buffer: the shard, then the extra slots."""
        return self.shard_numel + self.extra

    def numel(self, i: int) -> int:
        return self.shapes[i].numel()

    def chunk_of(self, i: int, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of ``rank``'s chunk of tensor ``i`` (flat, zero-padded)."""
        c = self.chunks[i]
        flat = tensor.detach().reshape(-1)
        out = flat.new_zeros(c)
        start, stop = rank * c, min((rank + 1) * c, flat.numel())
        if stop > start:
            out[: stop - start].copy_(flat[start:stop])
        return out

    def pack(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor, scale: float = 1.0) -> None:
        """Write every tensor (times ``scale``; ``None``: zeros) rank-major into ``out`` (``world_size``
        rows of :attr:`row_numel`); the extra slots are left as they are."""
        rows = out.view(self.world_size, self.row_numel)
        for i, t in enumerate(tensors):
            c, off = self.chunks[i], self.offsets[i]
            block = rows[:, off : off + c]
            if t is None:
                block.zero_()
                continue
            flat = t.detach().reshape(-1)
            n = flat.numel()
            full_rows, rest = divmod(n, c) if c else (0, 0)
            if full_rows:
                src = flat[: full_rows * c].view(full_rows, c)
                if scale == 1.0:
                    block[:full_rows].copy_(src)
                else:
                    torch.mul(src, scale, out=block[:full_rows])
            if full_rows < self.world_size:
                tail = block[full_rows]
                tail.zero_()
                if rest:
                    tail[:rest].copy_(flat[full_rows * c :])
                    if scale != 1.0:
                        tail[:rest].mul_(scale)
                block[full_rows + 1 :].zero_()

    def unpack_into(self, gathered: torch.Tensor, i: int, target: torch.Tensor) -> None:
        """Copy tensor ``i`` out of an all-gathered buffer (``world_size`` rows of
        :attr:`shard_numel`) into ``target``."""
        c, off = self.chunks[i], self.offsets[i]
        rows = gathered.view(self.world_size, self.shard_numel)[:, off : off + c]
        target.view(-1).copy_(rows.reshape(-1)[: self.numel(i)])
