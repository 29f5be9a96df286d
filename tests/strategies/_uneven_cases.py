"""File-sharded data whose shards differ in size, shared by the uneven-shard tests of every strategy."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset


def sample(i: int) -> tuple[torch.Tensor, int]:
    """Sample ``i`` of 24: its id in column 0 (so a model can record what it trained on), 4
    features, a label of 3 classes."""
    features = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    return torch.cat([torch.tensor([float(i)]), features[i]]), i % 3


class Files(IterableDataset):
    """Files of samples; ``shard`` keeps every n-th file: at 2 shards, shards of 8 and 16 samples."""

    SIZES = (5, 7, 3, 9)

    def __init__(self, files: list[range] | None = None) -> None:
        if files is None:
            starts = [sum(self.SIZES[:i]) for i in range(len(self.SIZES))]
            files = [range(s, s + n) for s, n in zip(starts, self.SIZES, strict=True)]
        self.files = files

    def shard(self, num_shards: int, index: int) -> Files:
        return Files(self.files[index::num_shards])

    def __iter__(self):
        for file in self.files:
            for i in file:
                yield sample(i)
