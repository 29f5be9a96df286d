"""A stream without shard() is read by process 0 only; every process gets its slice of each global
batch, the same slices as when every process read the whole stream (threads stand in for processes)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset

from spread.data import DistributedDataset, ReplicaLayout
from spread.testing.threads import ThreadChannels, run_threads


class _Stream(IterableDataset):
    def __init__(self, n: int = 11, strings: bool = False) -> None:
        self.n, self.strings, self.reads = n, strings, 0

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield ({"x": torch.tensor([float(i)]), "name": f"s{i}"} if self.strings else torch.tensor(i))


def _as_processes(streams: list[_Stream], gbs: int, dispatch: bool) -> list[list]:
    """Each 'process' iterates its DistributedDataset over its own stream object."""
    channels = ThreadChannels(len(streams))

    def run(p: int) -> list:
        layout = ReplicaLayout(len(streams), p, 1, process_index=p, num_processes=len(streams))
        ds = DistributedDataset(streams[p], gbs, layout, channel=channels.channel(p) if dispatch else None)
        return [b.tolist() for b in ds]

    return run_threads(run, len(streams), channels)


def test_one_reader_gives_every_process_the_slices_of_a_full_read():
    full = _as_processes([_Stream(), _Stream(), _Stream()], gbs=4, dispatch=False)
    streams = [_Stream(), _Stream(), _Stream()]
    dispatched = _as_processes(streams, gbs=4, dispatch=True)
    assert dispatched == full
    assert [s.reads for s in streams] == [11, 0, 0]  # each sample read once across processes
    assert sorted(i for batches in dispatched for b in batches for i in b) == list(range(11))


def test_a_stream_of_strings_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match="batches of tensors; this one holds str: give the dataset a shard"):
        _as_processes([_Stream(strings=True), _Stream(strings=True)], gbs=4, dispatch=True)
