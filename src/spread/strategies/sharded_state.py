"""ShardedStrategy's layout of training state: pieces per rank, never gathered to one.

Every rank writes its piece of each parameter and of each per-element optimizer state (momentum,
moments) through DCP, as a ``DTensor`` with ``Shard(0)`` of the flattened one-device tensor; the
chief writes the rest (buffers, parameter groups, step counts). At another world size DCP reads each
rank the saved ranges that overlap its new piece; a strategy holding whole tensors
(MultiWorkerMirrored) reads each piece whole; a checkpoint of the one-device state (written by such
a strategy) is cut into this rank's chunks on load. So a job that ran out of memory under
MultiWorkerMirrored continues sharded, and back.

The one-device state (:meth:`ShardedLayout.full_state_dict`) is gathered: collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from spread.strategies.checkpointing import Saved, StateLayout, dtype_named
from spread.strategies.sharded_block import fill_chunk, index_in, is_per_element

if TYPE_CHECKING:  # pragma: no cover
    from spread.strategies.sharded import ShardedStrategy


class ShardedLayout(StateLayout):
    """See the module docstring."""

    def __init__(self, strategy: ShardedStrategy) -> None:
        super().__init__(strategy)
        self.sharded = strategy

    # -- the one-device state ----------------------------------------------------------------------
    def full_state_dict(self, obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
        s = self.sharded
        if isinstance(obj, nn.Module):
            with s.unsharded():
                return {k: v.detach().clone() for k, v in obj.state_dict().items()}
        params = s._optimizer_params(obj)
        saved = obj.state_dict()
        full: dict[int, dict[str, Any]] = {}
        for index, state in saved["state"].items():
            block = s._shard_to_block.get(id(params[index]))
            if block is None:
                full[index] = state
                continue
            i = index_in(block, params[index])
            full[index] = {k: s._gather_state(block, i, k, v) for k, v in state.items()}
        return {"state": full, "param_groups": saved["param_groups"]}

    def load_full_state_dict(self, obj: nn.Module | torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        s = self.sharded
        if isinstance(obj, nn.Module):
            with s.unsharded():
                obj.load_state_dict(dict(state))
                for block in s._blocks:
                    block.refresh_shards()
            return
        self.load_optimizer(obj, state, {}, {})

    def module_signature(self, model: nn.Module) -> dict[str, torch.Tensor]:
        s = self.sharded
        with s.reading_released_state():
            state = model.state_dict(keep_vars=True)
        signature: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            if id(value) in s._block_of:
                block, i = s._block_of[id(value)]
                value = torch.empty(block.layout.shapes[i], dtype=value.dtype, device="meta")
            signature[name] = value
        return signature

    def optimizer_shapes(self, optimizer: torch.optim.Optimizer) -> list[torch.Size]:
        s = self.sharded
        shapes = []
        for p in s._optimizer_params(optimizer):
            block = s._shard_to_block.get(id(p))
            shapes.append(block.layout.shapes[index_in(block, p)] if block is not None else p.shape)
        return shapes

    # -- checkpoints -------------------------------------------------------------------------------
    def module_state(self, model: nn.Module) -> Saved:
        s = self.sharded
        mesh = s._mesh()
        managed = s._managed_names(model)
        with s.reading_released_state():
            everything = model.state_dict(keep_vars=True)
        canonical = {id(model.get_parameter(name)): name for name in managed}
        return Saved(
            state={k: v.detach().clone() for k, v in everything.items() if id(v) not in s._block_of},
            pieces={
                name: s._piece(block, i, block.shards[i].detach(), mesh)
                for name, (block, i) in managed.items()
            },
            shapes={name: list(block.layout.shapes[i]) for name, (block, i) in managed.items()},
            # A tied weight under a second name (an LM head sharing the embedding): saved once.
            aliases={
                k: canonical[id(v)]
                for k, v in everything.items()
                if id(v) in canonical and canonical[id(v)] != k
            },
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Saved:
        s = self.sharded
        mesh = s._mesh()
        params = s._optimizer_params(optimizer)
        saved = optimizer.state_dict()
        kept: dict[int, dict[str, Any]] = {}
        result = Saved(state={"state": kept, "param_groups": saved["param_groups"]})
        for index, entry in saved["state"].items():
            block = s._shard_to_block.get(id(params[index]))
            kept[index] = {}
            for key, value in entry.items():
                if block is not None and is_per_element(key, value, params[index].shape):
                    i = index_in(block, params[index])
                    result.pieces[f"{index}/{key}"] = s._piece(block, i, value, mesh)
                    result.shapes[f"{index}/{key}"] = list(block.layout.shapes[i])
                else:
                    kept[index][key] = value
        return result

    def pieces_like(
        self,
        obj: nn.Module | torch.optim.Optimizer,
        shapes: Mapping[str, list[int]],
        dtypes: Mapping[str, str],
    ) -> dict[str, torch.Tensor]:
        """This rank's piece of each saved piece (DCP reads the overlapping saved ranges); a name
        that fits nothing here is left out (the comparison before it listed it)."""
        s = self.sharded
        mesh = s._mesh()
        like: dict[str, torch.Tensor] = {}
        if isinstance(obj, nn.Module):
            managed = s._managed_names(obj)
            for name in shapes:
                if name in managed:
                    block, i = managed[name]
                    like[name] = s._piece(block, i, _empty(block.shards[i], dtypes[name]), mesh)
            return like
        params = s._optimizer_params(obj)
        for name in shapes:
            index = int(name.split("/", 1)[0])
            owner = s._shard_to_block.get(id(params[index])) if 0 <= index < len(params) else None
            if owner is not None:
                i = index_in(owner, params[index])
                like[name] = s._piece(owner, i, _empty(owner.shards[i], dtypes[name]), mesh)
        return like

    def load_module(
        self,
        model: nn.Module,
        state: Mapping[str, Any],
        pieces: Mapping[str, torch.Tensor],
        shapes: Mapping[str, list[int]],
        aliases: Mapping[str, str],
    ) -> None:
        """Collective at ``"optimizer"`` and ``"gradients"`` (the model's full values are gathered
        from the restored shards). A parameter saved whole (a one-device checkpoint) is cut."""
        s = self.sharded
        managed = s._managed_names(model)
        rank = s.shard_rank
        with s.reading_released_state():
            everything = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, (block, i) in managed.items():
                if name in pieces:
                    fill_chunk(block.shards[i], pieces[name])
                else:
                    block.shards[i].copy_(block.layout.chunk_of(i, state[name], rank))
        rest = {k: v for k, v in state.items() if k in everything and id(everything[k]) not in s._block_of}
        with s.reading_released_state():
            model.load_state_dict(rest, strict=False)  # buffers; the comparison checked every name
        s._restore_blocks(list({id(b): b for b, _ in managed.values()}.values()))

    def load_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, Any],
        pieces: Mapping[str, torch.Tensor],
        shapes: Mapping[str, list[int]],
    ) -> None:
        """This rank's chunk of every per-element state: from its piece, or cut from a whole one."""
        s = self.sharded
        params = s._optimizer_params(optimizer)
        mine: dict[int, dict[str, Any]] = {}
        for index, entry in state["state"].items():
            p = params[int(index)]
            block = s._shard_to_block.get(id(p))
            if block is None:
                mine[int(index)] = dict(entry)
                continue
            i = index_in(block, p)
            mine[int(index)] = {k: s._chunk_state(block, i, k, v) for k, v in entry.items()}
        for name, piece in pieces.items():
            index_text, key = name.split("/", 1)
            index = int(index_text)
            chunk = params[index].detach().new_zeros(params[index].shape, dtype=piece.dtype)
            fill_chunk(chunk, piece)
            mine.setdefault(index, {})[key] = chunk
        optimizer.load_state_dict({"state": mine, "param_groups": state["param_groups"]})
        if s._offload is not None:  # loaded state is in memory: to the files (or the host) again
            s._offload.adopt_state(optimizer, params)


def _empty(shard: torch.Tensor, dtype: str) -> torch.Tensor:
    return torch.empty_like(shard, dtype=dtype_named(dtype))
