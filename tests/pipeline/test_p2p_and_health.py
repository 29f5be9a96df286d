"""Activation headers round-trip; the dead-stage diagnosis reads heartbeats and reports correctly."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from spread.pipeline import Heartbeat
from spread.pipeline.p2p import HEADER_LEN, decode_header, encode_header


@pytest.mark.parametrize(
    ("shape", "dtype", "requires_grad"),
    [
        ((4, 8), torch.float32, True),
        ((2, 3, 5), torch.bfloat16, False),
        ((7,), torch.int64, False),
        ((), torch.float64, True),
    ],
)
def test_header_round_trip(shape, dtype, requires_grad):
    header = encode_header(torch.zeros(shape, dtype=dtype), requires_grad)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    assert decode_header(header) == (dtype, requires_grad, shape)


def test_bad_headers_and_tensors_are_refused():
    with pytest.raises(ValueError, match="malformed activation header"):
        decode_header(torch.tensor([99, 0, 1, 4, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="malformed activation header"):
        decode_header(torch.tensor([0, 0, 2, -4, 3, 0, 0, 0]))
    with pytest.raises(ValueError, match="at most 5 dimensions"):
        encode_header(torch.zeros((1,) * 6), False)
    with pytest.raises(TypeError, match=r"cannot send a torch\.complex64"):
        encode_header(torch.zeros(2, dtype=torch.complex64), False)


def _beat(store: dist.Store, rank: int, stop: threading.Event) -> None:
    while not stop.wait(0.01):
        store.add(Heartbeat._beat_key(rank), 1)


def test_diagnosis_names_the_rank_whose_heartbeat_stopped():
    store = dist.HashStore()
    me = Heartbeat(store, 0, 4, interval=0.05)
    stop = threading.Event()
    alive = threading.Thread(target=_beat, args=(store, 2, stop))  # rank 2 beats; rank 1 never does
    alive.start()
    try:
        store.add(Heartbeat._beat_key(1), 1)
        Heartbeat(None, 3, 4).report([])  # a heartbeat without a store does nothing
        store.set(Heartbeat._report_key(3), "-")  # rank 3 left on purpose: not dead
        assert me.diagnose(suspects=[3]) == [1]
    finally:
        stop.set()
        alive.join()
        me.close()


def test_diagnosis_follows_the_report_of_a_rank_that_gave_up():
    store = dist.HashStore()
    me = Heartbeat(store, 0, 3, interval=0.05)
    try:
        # Rank 1 exited after finding rank 2 dead; neither beats any more.
        store.set(Heartbeat._report_key(1), "2")
        assert me.diagnose(suspects=[1]) == [2]
        me.report([2])
        assert store.get(Heartbeat._report_key(0)) == b"2"
    finally:
        me.close()


def test_without_a_store_the_suspect_is_named():
    assert Heartbeat(None, 0, 3).diagnose(suspects=[1]) == [1]
