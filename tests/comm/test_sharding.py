"""The shard layout: chunks, padding and the rank-major buffers that reduce-scatter and all-gather move."""

from __future__ import annotations

import pytest
import torch

from spread.comm.sharding import ShardLayout

SHAPES = [torch.Size([3, 5]), torch.Size([7]), torch.Size([]), torch.Size([2, 2, 2]), torch.Size([1])]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gathering_every_ranks_shard_gives_back_every_tensor(world):
    tensors = [torch.randn(s) for s in SHAPES]
    layout = ShardLayout.of(SHAPES, world)
    shards = [torch.cat([layout.chunk_of(i, t, r) for i, t in enumerate(tensors)]) for r in range(world)]
    assert all(s.numel() == layout.shard_numel for s in shards)
    gathered = torch.cat(shards)  # what all_gather_into leaves on every rank
    for i, t in enumerate(tensors):
        out = torch.empty(SHAPES[i])
        layout.unpack_into(gathered, i, out)
        assert torch.equal(out, t)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pack_puts_each_ranks_chunk_in_its_row_scaled_with_zero_padding(world):
    tensors = [torch.randn(s) for s in SHAPES]
    layout = ShardLayout.of(SHAPES, world, extra=len(SHAPES))
    packed = torch.full((world * layout.row_numel,), 9.0)
    layout.pack([*tensors[:2], None, *tensors[3:]], packed, scale=0.5)
    rows = packed.view(world, layout.row_numel)
    for r in range(world):
        for i, t in enumerate(tensors):
            off, c = layout.offsets[i], layout.chunks[i]
            expected = torch.zeros(c) if i == 2 else layout.chunk_of(i, t, r) * 0.5
            assert torch.equal(rows[r, off : off + c], expected), (r, i)
        assert torch.equal(rows[r, layout.shard_numel :], torch.full((len(SHAPES),), 9.0))  # extra: untouched


def test_chunks_are_equal_per_rank_and_padded():
    layout = ShardLayout.of([torch.Size([5]), torch.Size([4])], 2)
    assert layout.chunks == (3, 2)
    assert layout.offsets == (0, 3)
    t = torch.arange(5.0)
    assert torch.equal(layout.chunk_of(0, t, 1), torch.tensor([3.0, 4.0, 0.0]))


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be positive, got 0"):
        ShardLayout.of([torch.Size([2])], 0)
