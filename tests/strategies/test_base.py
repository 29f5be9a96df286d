"""What every strategy's shared contract promises, checked on the in-process strategies."""

from __future__ import annotations

import pytest
import torch

import spread


@pytest.mark.parametrize(
    "make",
    [
        lambda: spread.OneDeviceStrategy("cpu"),
        lambda: spread.MirroredStrategy(num_replicas=2, intra_op_threads=1),
        lambda: spread.CentralStorageStrategy(num_replicas=2, intra_op_threads=1),
    ],
    ids=["one_device", "mirrored", "central_storage"],
)
@pytest.mark.parametrize("axis", [None, 0])
def test_reduce_returns_a_value_without_gradient_as_multi_worker_mirrored_does(make, axis):
    """It required grad under OneDevice and Mirrored but not under MultiWorkerMirrored (whose
    all-reduce detaches): a script moved between them must see the same."""
    strategy = make()
    try:
        with strategy.scope():
            w = torch.nn.Parameter(torch.ones(3))
        losses = strategy.run(lambda: (w * 2).sum().reshape(1))
        reduced = strategy.reduce("mean", losses, axis=axis)
        assert not reduced.requires_grad
        assert float(reduced.sum()) == pytest.approx(6.0)
    finally:
        strategy.close()
