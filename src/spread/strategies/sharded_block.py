"""One block of ShardedStrategy's parameters: sharded, all-gathered and gradient-reduced together.

A block owns this rank's shard of its parameters (:class:`~spread.comm.sharding.ShardLayout`): a flat
copy of its chunks at ``"parameters"``, where the model's values are released between uses, and
views of the model's parameters below, where they stay (no second copy). It owns the shard
parameters the optimizer steps, the gather/release of the model's full values and the reduction of
their gradients, each one collective per block (see :mod:`spread.strategies.sharded`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from spread.comm import Collectives, PendingCollective
from spread.comm.sharding import ShardLayout
from spread.errors import SpreadError
from spread.memory.meta_init import become


class ParameterBlock:
    """Parameters sharded and exchanged together: one all-gather and one reduction each."""

    def __init__(
        self,
        params: list[nn.Parameter],
        collectives: Collectives,
        shard: str,
        replicas: Collectives | None = None,
    ) -> None:
        self.params = params
        self.collectives = collectives  # the ranks the parameters are split over
        self.replicas = replicas  # hybrid sharding: the ranks holding the same shard in other groups
        self.shard = shard
        self.device = collectives.device  # where collectives run (the shards may live on the host: offload)
        self.layout = ShardLayout.of([p.shape for p in params], collectives.world_size, extra=len(params))
        rank, world = collectives.rank, collectives.world_size
        self.flat_shard: torch.Tensor | None = None  # "parameters": this rank's chunks, the only copy
        if shard == "parameters":
            with torch.no_grad():
                if any(p.is_meta for p in params):  # their chunks come from materialise()
                    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
                    numel = self.layout.shard_numel
                    self.flat_shard = torch.zeros(numel, dtype=dtype, device=collectives.device)
                    for i, p in enumerate(params):
                        if not p.is_meta:
                            self._chunk(i).copy_(self.layout.chunk_of(i, p, rank))
                else:
                    chunks = [self.layout.chunk_of(i, p, rank) for i, p in enumerate(params)]
                    self.flat_shard = torch.cat(chunks) if chunks else params[0].new_zeros(0)
            pieces = [
                self.flat_shard[off : off + c]
                for off, c in zip(self.layout.offsets, self.layout.chunks, strict=True)
            ]
        else:
            # The model keeps its full parameters: each shard is a view of its parameter's own chunk,
            # so the optimizer's step writes into the model and no second copy exists.
            pieces = [_own_chunk(p, c, world, rank) for p, c in zip(params, self.layout.chunks, strict=True)]
        self.shards = [
            nn.Parameter(piece, requires_grad=p.requires_grad)
            for p, piece in zip(params, pieces, strict=True)
        ]
        self.trainable = sum(p.requires_grad for p in params)
        self.resident = True  # whether the model's parameters hold their full values
        # The tensors holding the full values (their storage is released and regrown: autograd's
        # saved views of a parameter keep that storage), and what a released parameter shows
        # meanwhile: zeros of its shape in one element of memory (shapes and parameter counts stay
        # right; reading freed memory would crash; writing into it raises).
        self.full = [p.data for p in params]
        self._stand_ins = [p.data.new_zeros(1).expand(p.shape) for p in params]
        self.ready: set[int] = set()  # parameters whose gradient arrived in this backward pass
        # A prefetch in flight: the collective, its output, and its input (kept alive until done).
        self._gathering: tuple[PendingCollective, torch.Tensor, torch.Tensor] | None = None
        # A reduction in flight: the collective, the buffer the shards' gradients are cut from, where
        # the presence flags are in it, and what the replicas all-reduce next (hybrid sharding).
        self._reducing: tuple[PendingCollective, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # Its second stage (hybrid sharding: the replicas' all-reduce, None without), and the same views.
        self._across: tuple[PendingCollective | None, torch.Tensor, torch.Tensor] | None = None
        # Offload beside an accelerator (spread.strategies.sharded_offload) with the flat shard on the
        # host: whether the device keeps a copy of it, and that copy with the versions it was made at.
        self.keep_device_copy = False
        self._device_copy: tuple[tuple[int, ...], torch.Tensor] | None = None

    def _chunk(self, i: int) -> torch.Tensor:
        """This rank's chunk of parameter ``i`` in the flat shard (``shard="parameters"`` only)."""
        assert self.flat_shard is not None, "only shard='parameters' keeps a flat shard"
        return self.flat_shard[self.layout.offsets[i] : self.layout.offsets[i] + self.layout.chunks[i]]

    def materialise(self, i: int, value: torch.Tensor) -> None:
        """Parameter ``i``, on the meta device (or just initialised in place), takes ``value``: this
        rank keeps its chunk, and the parameter (the same object) becomes a released real one, zeros
        until gathered. The only full copy is ``value``, the caller's."""
        p = self.params[i]
        with torch.no_grad():
            self._chunk(i).copy_(self.layout.chunk_of(i, value, self.collectives.rank))
        if p.is_meta:
            become(p, torch.empty(p.shape, dtype=p.dtype, device=self.device))
        self.full[i] = p.data
        self._stand_ins[i] = p.data.new_zeros(1).expand(p.shape)
        p.data = self._stand_ins[i]
        self.full[i].untyped_storage().resize_(0)

    def abandon_in_flight(self) -> None:
        """Forget collectives started over a group that broke (a lost peer) and gradients of the step
        that did not finish: the survivors repeat that step."""
        self._gathering = None
        self._reducing = None
        self.ready.clear()
        for p in self.params:
            p.grad = None

    def reshard(self, collectives: Collectives, values: list[torch.Tensor]) -> None:
        """Cut the block again over ``collectives`` (a regrouped world, smaller or larger) from the
        parameters' whole one-device ``values``: new shards (new shard parameters: the caller swaps
        them into the optimizer), the model's parameters resident with ``values`` until released.
        Nothing in flight."""
        with torch.no_grad():
            for p, value in zip(self.params, values, strict=True):
                p.grad = None
                p.data = value
        self.__init__(self.params, collectives, self.shard)  # type: ignore[misc]

    # -- parameters --------------------------------------------------------------------------------
    def start_gather(self) -> None:
        """Collective, asynchronous: start gathering every rank's chunks (a prefetch); a no-op when
        the parameters are resident or a gather is in flight."""
        if self.resident or self._gathering is not None:
            return
        layout = self.layout
        mine = self._shard_on_device()
        gathered = mine.new_empty(layout.world_size * layout.shard_numel)
        pending = self.collectives.all_gather_into_async(gathered, mine, name="sharded.all_gather_parameters")
        self._gathering = (pending, gathered, mine)

    def _shard_on_device(self) -> torch.Tensor:
        """This rank's chunks, flat, on the device the collectives run on: the flat shard, or the shards
        packed (views of the parameters, or host copies under offload: packed, then dropped). A flat
        shard on the host is copied (or its device copy reused while neither it nor a shard changed:
        in-place writes bump their version counters)."""
        if self.flat_shard is not None:
            mine = self.flat_shard
        else:
            mine = torch.cat([s.detach() for s in self.shards])
        if mine.device == self.device:
            return mine
        if not self.keep_device_copy:
            return mine.to(self.device, non_blocking=True)
        versions = (mine._version, *(s._version for s in self.shards))
        if self._device_copy is None or self._device_copy[0] != versions:
            self._device_copy = (versions, mine.to(self.device, non_blocking=True))
        return self._device_copy[1]

    def gather(self) -> None:
        """Make the model's parameters hold their full values (the collective, unless a prefetch
        started it already, then copy out)."""
        if self.resident:
            return
        self.start_gather()
        assert self._gathering is not None
        pending, gathered, _ = self._gathering
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
    def device_copy(self) -> torch.Tensor | None:
        """The device's copy of a flat shard kept on the host (offload), if one was made."""
        return None if self._device_copy is None else self._device_copy[1]

    @property
    def gathering(self) -> bool:
        """Whether a prefetch of this block is in flight."""
        return self._gathering is not None

    def refresh_shards(self) -> None:
        """Take this rank's chunks from the model's (resident) parameters, e.g. after a load (a shard
        that is a view of its parameter's own chunk, below ``"parameters"``, has nothing to take)."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                shard = self.shards[i]
                if (
                    self.flat_shard is None
                    and shard.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
                ):
                    continue
                shard.copy_(self.layout.chunk_of(i, p, self.collectives.rank))

    # -- gradients ---------------------------------------------------------------------------------
    def start_reduce(self, grad_scale: float) -> None:
        """Collective, asynchronous: the model's ``.grad`` times ``grad_scale`` are packed and their
        sum over ranks started (all-reduce at ``"optimizer"``, else reduce-scatter); the model's
        ``.grad`` become ``None``. :meth:`finish_reduce` adds the result to the shards' ``.grad``.

        A presence flag per parameter travels with the gradients, so each rank learns which got a
        gradient on any rank: at ``"optimizer"`` once, after every rank's row (the all-reduced rows
        are the full gradients this stage keeps), else in every rank's row (the reduce-scatter gives
        each rank its row and the flags).

        With hybrid sharding the sum runs over this rank's group here, and :meth:`advance_reduce` sums
        the result over the groups (an all-reduce among the replicas of this rank's shard)."""
        layout, world = self.layout, self.collectives.world_size
        grads = [p.grad for p in self.params]
        if any(g is not None and g.is_sparse for g in grads):
            raise SpreadError("ShardedStrategy does not shard sparse gradients (nn.Embedding(sparse=True))")
        dtype = self.shards[0].dtype
        present = torch.tensor([g is not None for g in grads], dtype=dtype)
        if self.shard == "optimizer":
            packed = torch.empty(world * layout.shard_numel + layout.extra, dtype=dtype, device=self.device)
            _without_flags(layout).pack(grads, packed[: world * layout.shard_numel], grad_scale)
            packed[world * layout.shard_numel :] = present
        else:
            packed = torch.empty(world * layout.row_numel, dtype=dtype, device=self.device)
            layout.pack(grads, packed, grad_scale)
            packed.view(world, layout.row_numel)[:, layout.shard_numel :] = present
        for p in self.params:
            p.grad = None
        if self.shard == "optimizer":
            pending = self.collectives.all_reduce_async(packed, name="sharded.grad_all_reduce")
            rank = self.collectives.rank
            mine = packed[rank * layout.shard_numel : (rank + 1) * layout.shard_numel]
            flags = packed[world * layout.shard_numel :]
            across = packed  # this stage keeps the full gradients: the same on every rank
        else:
            row = packed.new_empty(layout.row_numel)
            pending = self.collectives.reduce_scatter_async(row, packed, name="sharded.grad_reduce_scatter")
            mine, flags = row[: layout.shard_numel], row[layout.shard_numel :]
            across = row
        self._reducing = (pending, mine, flags, across)

    def advance_reduce(self, *, block: bool = True) -> bool:
        """The reduction's first stage over: with hybrid sharding, start the all-reduce of its result
        among the replicas (asynchronous). ``block=False``: only if the first stage completed
        already. Returns whether the first stage is over. Called on blocks in the order their
        reductions started, on every rank alike, so the replicas' all-reduces are issued in order."""
        if self._reducing is None:
            return True
        pending, mine, flags, across = self._reducing
        if not block and not pending.done():
            return False
        self._reducing = None
        pending.wait()
        second = None
        if self.replicas is not None:  # the group's sum, summed over the groups
            second = self.replicas.all_reduce_async(across, name="sharded.grad_all_reduce_replicas")
        self._across = (second, mine, flags)
        return True

    def finish_reduce(self) -> None:
        """Wait for the reduction; a shard without ``.grad`` gets a view of the reduced buffer (no
        copy: at ``"optimizer"`` the view keeps the all-reduced full gradients, as ZeRO-1 keeps
        them, until the optimizer's ``zero_grad``), one with ``.grad`` has it added."""
        self.advance_reduce()
        if self._across is None:
            return
        pending, mine, flags = self._across
        self._across = None
        if pending is not None:
            pending.wait()
        layout = self.layout
        present = flags.tolist()
        for i, shard in enumerate(self.shards):
            if present[i] <= 0:
                continue  # no rank produced a gradient for it: as on one device, it keeps none
            off, c = layout.offsets[i], layout.chunks[i]
            grad = mine[off : off + c]
            if grad.device != shard.device:  # offload: the shard and its gradient live on the host
                grad = _to_host(grad, shard.device)
            if shard.grad is None:
                shard.grad = grad
            else:
                shard.grad.add_(grad)


def _to_host(grad: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``grad`` on ``device`` (the host), pinned beside an accelerator."""
    host = torch.empty(grad.shape, dtype=grad.dtype, device=device, pin_memory=grad.device.type != "cpu")
    host.copy_(grad)
    return host


def _own_chunk(p: nn.Parameter, chunk: int, world: int, rank: int) -> torch.Tensor:
    """A view of ``rank``'s chunk of ``p``'s values. When ``p`` is not contiguous or its chunks need
    padding, ``p`` is first moved into a storage of ``world * chunk`` elements of its own (the tail
    after its values is the padding, never part of ``p``)."""
    numel = p.numel()
    if p.is_contiguous() and numel == world * chunk:
        flat = p.data.view(-1)
    else:
        with torch.no_grad():
            flat = p.new_zeros(world * chunk)
            flat[:numel].copy_(p.reshape(-1))
        p.data = flat[:numel].view(p.shape)
    return flat[rank * chunk : (rank + 1) * chunk]


def _without_flags(layout: ShardLayout) -> ShardLayout:
    """``layout`` with rows of the chunks only (``"optimizer"`` sends the flags once, not per row)."""
    return replace(layout, extra=0)


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
