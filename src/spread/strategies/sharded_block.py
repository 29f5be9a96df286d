"""One block of ShardedStrategy's parameters: sharded, all-gathered and gradient-reduced together.

A block owns this rank's flat shard of its parameters (:class:`~spread.comm.sharding.ShardLayout`),
the shard parameters the optimizer steps, and the gather/release of the model's full values and the
reduction of their gradients, each one collective per block (see :mod:`spread.strategies.sharded`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spread.comm import Collectives, PendingCollective
from spread.comm.sharding import ShardLayout
from spread.errors import SpreadError


class ParameterBlock:
    """Parameters sharded and exchanged together: one all-gather and one reduction each."""

    def __init__(self, params: list[nn.Parameter], collectives: Collectives, shard: str) -> None:
        self.params = params
        self.collectives = collectives
        self.shard = shard
        self.layout = ShardLayout.of([p.shape for p in params], collectives.world_size, extra=len(params))
        rank = collectives.rank
        with torch.no_grad():
            chunks = [self.layout.chunk_of(i, p, rank) for i, p in enumerate(params)]
            self.flat_shard = torch.cat(chunks) if chunks else params[0].new_zeros(0)
        self.shards = [
            nn.Parameter(self.flat_shard[off : off + c], requires_grad=p.requires_grad)
            for p, off, c in zip(params, self.layout.offsets, self.layout.chunks, strict=True)
        ]
        self.trainable = sum(p.requires_grad for p in params)
        self.grad_buffer: torch.Tensor | None = None  # "optimizer": the all-reduce's, kept
        self.resident = True  # whether the model's parameters hold their full values
        # The tensors holding the full values (their storage is released and regrown: autograd's
        # saved views of a parameter keep that storage), and what a released parameter shows
        # meanwhile: zeros of its shape in one element of memory (shapes and parameter counts stay
        # right; reading freed memory would crash; writing into it raises).
        self.full = [p.data for p in params]
        self._stand_ins = [p.data.new_zeros(1).expand(p.shape) for p in params]
        self.ready: set[int] = set()  # parameters whose gradient arrived in this backward pass
        self._gathering: tuple[PendingCollective, torch.Tensor] | None = None  # a prefetch in flight
        self._reducing: tuple[PendingCollective, torch.Tensor] | None = None  # a reduction in flight

    # -- parameters --------------------------------------------------------------------------------
    def start_gather(self) -> None:
        """Collective, asynchronous: start gathering every rank's chunks (a prefetch); a no-op when
        the parameters are resident or a gather is in flight."""
        if self.resident or self._gathering is not None:
            return
        layout = self.layout
        gathered = self.flat_shard.new_empty(layout.world_size * layout.shard_numel)
        pending = self.collectives.all_gather_into_async(
            gathered, self.flat_shard, name="sharded.all_gather_parameters"
        )
        self._gathering = (pending, gathered)

    def gather(self) -> None:
        """Make the model's parameters hold their full values (the collective, unless a prefetch
        started it already, then copy out)."""
        if self.resident:
            return
        self.start_gather()
        assert self._gathering is not None
        pending, gathered = self._gathering
        self._gathering = None
        pending.wait()
        with torch.no_grad():
            for i, (p, full) in enumerate(zip(self.params, self.full, strict=True)):
                storage = full.untyped_storage()
                needed = int(full.storage_offset() + full.numel()) * full.element_size()
                if storage.nbytes() < needed:
                    storage.resize_(needed)
                self.layout.unpack_into(gathered, i, full)
                if p.data.untyped_storage().data_ptr() != storage.data_ptr():
                    # Through .data: the parameter object and its autograd version counter stay,
                    # so a backward that saved it in forward finds its values again.
                    p.data = full
        self.resident = True

    def release(self) -> None:
        """Free the full values' storage; the parameters read as zeros until :meth:`gather`.
        A prefetch in flight is completed first (every rank issued it)."""
        if self._gathering is not None:
            self.gather()
        for p, full, stand_in in zip(self.params, self.full, self._stand_ins, strict=True):
            p.data = stand_in
            full.untyped_storage().resize_(0)
        self.resident = False

    @property
    def gathering(self) -> bool:
        """Whether a prefetch of this block is in flight."""
        return self._gathering is not None

    def refresh_shards(self) -> None:
        """Take this rank's chunks from the model's (resident) parameters, e.g. after a load."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                self.shards[i].copy_(self.layout.chunk_of(i, p, self.collectives.rank))

    # -- gradients ---------------------------------------------------------------------------------
    def start_reduce(self, grad_scale: float) -> None:
        """Collective, asynchronous: the model's ``.grad`` times ``grad_scale`` are packed and their
        sum over ranks started (all-reduce at ``"optimizer"``, else reduce-scatter); the model's
        ``.grad`` become ``None``. :meth:`finish_reduce` adds the result to the shards' ``.grad``."""
        layout, world = self.layout, self.collectives.world_size
        grads = [p.grad for p in self.params]
        if any(g is not None and g.is_sparse for g in grads):
            raise SpreadError("ShardedStrategy does not shard sparse gradients (nn.Embedding(sparse=True))")
        if self.shard == "optimizer":
            if self.grad_buffer is None:
                self.grad_buffer = self.flat_shard.new_empty(world * layout.row_numel)
            packed = self.grad_buffer
        else:
            packed = self.flat_shard.new_empty(world * layout.row_numel)
        layout.pack(grads, packed, grad_scale)
        rows = packed.view(world, layout.row_numel)
        # A presence flag per parameter in every row: each rank learns which got a gradient anywhere.
        rows[:, layout.shard_numel :] = torch.tensor([g is not None for g in grads], dtype=packed.dtype)
        for p in self.params:
            p.grad = None
        if self.shard == "optimizer":
            pending = self.collectives.all_reduce_async(packed, name="sharded.grad_all_reduce")
            mine = rows[self.collectives.rank]
        else:
            mine = packed.new_empty(layout.row_numel)
            pending = self.collectives.reduce_scatter_async(mine, packed, name="sharded.grad_reduce_scatter")
        self._reducing = (pending, mine)

    def finish_reduce(self) -> None:
        if self._reducing is None:
            return
        pending, mine = self._reducing
        self._reducing = None
        pending.wait()
        layout = self.layout
        present = mine[layout.shard_numel :].tolist()
        for i, shard in enumerate(self.shards):
            if present[i] <= 0:
                continue  # no rank produced a gradient for it: as on one device, it keeps none
            off, c = layout.offsets[i], layout.chunks[i]
            grad = mine[off : off + c]
            if shard.grad is None:
                shard.grad = grad.clone() if self.shard == "optimizer" else grad
            else:
                shard.grad.add_(grad)


def fill_chunk(chunk: torch.Tensor, piece: torch.Tensor) -> None:
    """Write a restored piece into a (padded) chunk; the padding is zeros."""
    chunk.zero_()
    chunk[: piece.numel()].copy_(piece.reshape(-1))


def index_in(block: ParameterBlock, shard: torch.Tensor) -> int:
    return next(j for j, s in enumerate(block.shards) if s is shard)


def is_per_element(key: str, value: Any, shape: torch.Size) -> bool:
    """Whether an optimizer state entry has one value per parameter element (momentum, moments);
    ``step`` counts are shared even for a 0-dim parameter."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == shape
