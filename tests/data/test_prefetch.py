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
