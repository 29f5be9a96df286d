"""Which samples each replica gets: the split of every global batch, and the shard policies.

Synchronous equivalence with one device needs one rule everywhere: global batch ``b`` is the slice
``order[b*B : (b+1)*B]`` of one permutation that every process computes from the same seed, and
replica ``r`` takes a contiguous piece of it whose size differs from the others by at most one.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class ShardPolicy(StrEnum):
    """How a dataset is divided among workers (the names of ``tf.data.experimental.AutoShardPolicy``).

    * ``AUTO``: ``FILE`` when the dataset can shard itself (has ``shard(num_shards, index)``),
      else ``DATA``;
    * ``DATA``: every global batch is split by sample across replicas (equivalent to one device);
    * ``FILE``: each process reads only its own shard via ``dataset.shard(num_processes, index)``
      and forms its local batches from it (fast for file-backed data, not sample-equivalent);
    * ``OFF``: no sharding: every process iterates the whole dataset with its own shuffle and forms
      per-replica batches of ``global_batch_size // num_replicas``.
    """

    AUTO = "auto"
    DATA = "data"
    FILE = "file"
    OFF = "off"

    @classmethod
    def parse(cls, value: str | ShardPolicy) -> ShardPolicy:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"shard_policy must be one of {choices}, got {value!r}") from None


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous pieces of ``total`` items, differing by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The sample order for one epoch; identical on every process given the same seed and epoch."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator()
    generator.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def global_batches(num_samples: int, global_batch_size: int, drop_remainder: bool) -> int:
    """How many global batches an epoch holds."""
    full, rest = divmod(num_samples, global_batch_size)
    return full + (1 if rest and not drop_remainder else 0)
