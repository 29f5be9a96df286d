"""Background prefetch: same items in the same order, errors surface, abandoned iterators stop."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spread.data import DistributedDataset, ReplicaLayout
from spread.data.prefetch import WaitClock, prefetch


def test_items_and_order_are_unchanged():
    clock = WaitClock()
    assert list(prefetch(iter(range(50)), 3, clock)) == list(range(50))
    assert clock.batches == 51  # every item plus the end marker


def test_errors_from_the_producer_reach_the_consumer():
    def broken():
        yield 1
        raise KeyError("sample 7 is corrupt")

    with pytest.raises(KeyError, match="sample 7"):
        list(prefetch(broken(), 2))


def test_abandoning_the_iterator_stops_the_thread():
    def endless():
        i = 0
        while True:
            yield i
            i += 1

    it = prefetch(endless(), 2)
    assert next(it) == 0
    it.close()
    deadline = time.monotonic() + 5
    while any(t.name == "spread-prefetch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "spread-prefetch" for t in threading.enumerate())


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_distributed_dataset_is_identical_with_and_without_prefetch(depth):
    data = (torch.arange(30).float(), torch.arange(30))
    layout = ReplicaLayout(2, 1, 1, process_index=1, num_processes=2)
    reference = [b[1].tolist() for b in DistributedDataset(data, 8, layout, seed=3, prefetch=0)]
    ds = DistributedDataset(data, 8, layout, seed=3, prefetch=depth)
    assert [b[1].tolist() for b in ds] == reference
    assert ds.wait_clock.batches >= len(reference)


def test_bad_prefetch_value():
    with pytest.raises(ValueError, match="prefetch"):
        DistributedDataset((torch.zeros(4),), 2, ReplicaLayout(1, 0, 1), prefetch=-1)


class _Squares(torch.utils.data.Dataset):
    """A map-style dataset whose samples are computed per item, as a user's Dataset reads files."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor(i * i)


def _reading_thread_while_iterating(data) -> bool:
    ds = DistributedDataset(data, 4, ReplicaLayout(1, 0, 1), shuffle=False, prefetch=2)
    seen = []
    for _ in ds:
        seen.append(any(t.name == "spread-prefetch" for t in threading.enumerate()))
    return any(seen)


def test_tensors_in_memory_for_cpu_replicas_are_read_without_a_thread():
    """Their gather takes a fraction of a millisecond; on a second thread it runs a second OpenMP
    team beside the step's (a one-device ResNet step on 2 cores: 64 ms with it, 47 without)."""
    assert not _reading_thread_while_iterating((torch.arange(12.0), torch.arange(12)))
    assert not _reading_thread_while_iterating({"x": torch.arange(12.0), "y": torch.arange(12)})
    assert _reading_thread_while_iterating(_Squares())
