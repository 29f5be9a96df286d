"""A stream without shard() is read by process 0 only; every process gets its slice of each global
batch, the same slices as when every process read the whole stream (threads stand in for processes)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import IterableDataset

from spread.data import DistributedDataset, ReplicaLayout


class _Stream(IterableDataset):
    def __init__(self, n: int = 11, strings: bool = False) -> None:
        self.n, self.strings, self.reads = n, strings, 0

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield ({"x": torch.tensor([float(i)]), "name": f"s{i}"} if self.strings else torch.tensor(i))


class _Channel:
    """A DataChannel over threads: the one collective a test needs (the other is not called)."""

    def __init__(self, collective) -> None:
        self.sum_over_processes = self.broadcast_from_first_process = collective


def _as_processes(streams: list[_Stream], gbs: int, dispatch: bool) -> list[list]:
    """Each 'process' iterates its DistributedDataset over its own stream object."""
    processes = len(streams)
    barrier = threading.Barrier(processes)
    shared: list[list[torch.Tensor]] = [[]]
    out: list = [None] * processes
    errors: list[BaseException] = []

    def run(p: int) -> None:
        def from_first(tensors: list[torch.Tensor]) -> None:
            if p == 0:
                shared[0] = [t.clone() for t in tensors]
            barrier.wait(timeout=10)
            if p != 0:
                for t, sent in zip(tensors, shared[0], strict=True):
                    t.copy_(sent)
            barrier.wait(timeout=10)

        try:
            layout = ReplicaLayout(processes, p, 1, process_index=p, num_processes=processes)
            ds = DistributedDataset(
                streams[p], gbs, layout, channel=_Channel(from_first) if dispatch else None
            )
            out[p] = [b.tolist() for b in ds]
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(p,)) for p in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    if errors:
        raise errors[0]
    return out


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
