"""MultiWorkerMirrored on file-sharded input whose shards differ in size: the epoch ends on every
process together (a finished shard takes part with empty batches), every sample is trained on once,
and the logged loss is the mean over every sample (not a process's share counted twice)."""

from __future__ import annotations

import pytest
import torch
from _uneven_cases import Files
from torch import nn
from torch.utils.data import IterableDataset

from spread.testing import run_ranks

pytestmark = pytest.mark.processes


class _IdModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.steps: list[list[int]] = []  # the sample ids of each forward (one per step)

    def forward(self, x):
        self.steps.append([int(i) for i in x[:, 0].tolist()])
        return self.net(x[:, 1:])


def _train() -> dict:
    import spread

    strategy = spread.MultiWorkerMirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = _IdModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    history = trainer.fit(Files(), epochs=2, global_batch_size=6, verbose=0)
    weights = [p.detach().clone() for p in model.parameters()]
    strategy.close()
    return {
        "steps_ids": model.steps,
        "loss": history.history["loss"],
        "weights": weights,
        "steps": trainer.global_step,
    }


def _one_device(global_batches: list[list[int]]) -> tuple[list[torch.Tensor], list[float]]:
    """The same global batches (the union of the ranks' local batches at each step) on one device."""
    samples = {int(x[0]): (x, y) for x, y in Files()}
    torch.manual_seed(0)
    model = _IdModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    epoch_losses, total, count = [], 0.0, 0
    for step, ids in enumerate(global_batches):
        x = torch.stack([samples[i][0] for i in ids])
        y = torch.tensor([samples[i][1] for i in ids])
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(ids), count + len(ids)
        if step % 6 == 5:
            epoch_losses.append(total / count)
            total, count = 0.0, 0
    return [p.detach() for p in model.parameters()], epoch_losses


def test_uneven_file_shards_train_every_sample_once_and_end_together():
    rank0, rank1 = run_ranks(_train, 2, timeout=180)
    assert rank0["steps"] == rank1["steps"] == 12  # the longer shard's 6 steps per epoch, on both
    per_step = [a + b for a, b in zip(rank0["steps_ids"], rank1["steps_ids"], strict=True)]
    assert sorted(i for ids in per_step for i in ids) == sorted(list(range(24)) * 2)  # once per epoch
    assert [len(ids) for ids in rank0["steps_ids"][:6]] == [3, 3, 2, 0, 0, 0]  # its shard ran out
    assert rank0["loss"] == rank1["loss"]
    weights, losses = _one_device(per_step)  # each step's samples weighted by the exact global count
    for got, want in zip(rank0["weights"], weights, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert rank0["loss"] == pytest.approx(losses, rel=1e-5)


class _Stream(IterableDataset):
    """A plain stream (no shard method): MultiWorkerMirrored reads it on process 0 only."""

    def __iter__(self):
        g = torch.Generator().manual_seed(1)
        features, labels = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
        reads = []
        for i in range(30):
            reads.append(i)
            _Stream.read = reads
            yield features[i], labels[i]


def _train_stream(strategy_name: str) -> dict:
    import spread

    strategy = spread.OneDeviceStrategy() if strategy_name == "one" else spread.MultiWorkerMirroredStrategy()
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _Stream.read = []
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    history = trainer.fit(_Stream(), epochs=2, global_batch_size=8, verbose=0)
    strategy.close()
    weights = [p.detach().clone() for p in model.parameters()]
    return {"reads": len(_Stream.read), "loss": history.history["loss"], "weights": weights}


def test_a_stream_without_shard_is_read_once_across_ranks_and_equals_one_device():
    (one,) = run_ranks(_train_stream, 1, args=("one",), timeout=120)
    rank0, rank1 = run_ranks(_train_stream, 2, args=("mwms",), timeout=180)
    assert (rank0["reads"], rank1["reads"]) == (30, 0)  # the last epoch's reads: rank 0's only
    for got, want in zip(rank0["weights"], one["weights"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert rank0["loss"] == pytest.approx(one["loss"], rel=1e-5) and rank1["loss"] == rank0["loss"]
