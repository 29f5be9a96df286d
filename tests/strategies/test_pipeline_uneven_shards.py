"""PipelineStrategy on uneven file shards and on a stream without ``shard()``.

Hybrid (pipeline replicas): the replicas' data processes talk over each stage's replica group, so
shards of different sizes end the epoch together (a finished replica steps with empty batches,
weighted zero) and a stream is read by replica 0 alone and broadcast; both equal one device on the
same global batches. One pipeline: every stage reads the whole data (stage 0 needs the inputs, the
last stage the targets), one shard of one, so both inputs equal one device as they are."""

from __future__ import annotations

import pytest
import torch
from _uneven_cases import Files, sample
from torch import nn
from torch.utils.data import IterableDataset

from spread.testing import run_ranks

pytestmark = pytest.mark.processes


class _Stream(IterableDataset):
    """The same 24 samples as a plain stream (no shard method); counts what this process read."""

    reads = 0

    def __iter__(self):
        _Stream.reads = 0
        for i in range(24):
            _Stream.reads += 1
            yield sample(i)


class _Ids(nn.Module):
    """Records the sample ids of each training forward, and drops the id column."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []

    def forward(self, x):
        if torch.is_grad_enabled():
            self.steps.append([int(i) for i in x[:, 0].tolist()])
        return x[:, 1:]


def _model() -> tuple[nn.Sequential, _Ids]:
    torch.manual_seed(0)
    ids = _Ids()
    return nn.Sequential(ids, nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), ids


def _train(replicas: int, data: str) -> dict:
    import spread

    strategy = spread.PipelineStrategy(stages=2, replicas=replicas, microbatches=1, split_points=[2])
    with strategy.scope():
        model, ids = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    dataset = Files() if data == "files" else _Stream()
    history = trainer.fit(dataset, epochs=2, global_batch_size=6, verbose=0)
    evaluated = trainer.evaluate(Files() if data == "files" else _Stream(), global_batch_size=6)["loss"]
    state = {k: v.clone() for k, v in strategy.gather_state_dict(model).items()}
    strategy.close()
    return {
        "steps_ids": ids.steps,
        "loss": history.history["loss"],
        "state": state,
        "steps": trainer.global_step,
        "reads": _Stream.reads,
        "evaluated": evaluated,
    }


def _one_device(global_batches: list[list[int]], steps_per_epoch: int) -> tuple[nn.Module, list[float]]:
    """The same global batches on one device: its final model and its per-epoch mean losses."""
    model, _ = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    epoch_losses, total, count = [], 0.0, 0
    for step, batch in enumerate(global_batches):
        samples = [sample(i) for i in batch]
        x, y = torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        total, count = total + loss.item() * len(batch), count + len(batch)
        if step % steps_per_epoch == steps_per_epoch - 1:
            epoch_losses.append(total / count)
            total, count = 0.0, 0
    return model, epoch_losses


def _assert_equals_one_device(rank: dict, global_batches: list[list[int]], steps_per_epoch: int) -> None:
    model, losses = _one_device(global_batches, steps_per_epoch)
    for key, want in model.state_dict().items():
        torch.testing.assert_close(rank["state"][key], want, rtol=1e-5, atol=1e-6)
    assert rank["loss"] == pytest.approx(losses, rel=1e-5)
    samples = [sample(i) for i in range(24)]  # evaluate: the mean over every sample, each once
    with torch.no_grad():
        x, y = torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples])
        assert rank["evaluated"] == pytest.approx(float(nn.CrossEntropyLoss()(model(x), y)), rel=1e-5)


def test_hybrid_uneven_file_shards_end_together_and_equal_one_device():
    ranks = run_ranks(_train, 4, args=(2, "files"), timeout=240)  # rank = replica * 2 + stage
    assert [r["steps"] for r in ranks] == [12] * 4  # the longer shard's 6 steps per epoch, everywhere
    replica0, replica1 = ranks[0]["steps_ids"], ranks[2]["steps_ids"]  # stage 0 of each replica
    # Replica 0's shard of 8 ran out after 3 steps an epoch: it stepped on empty batches (no forward).
    assert [len(ids) for ids in replica0] == [3, 3, 2] * 2 and len(replica1) == 12
    padded = replica0[:3] + [[]] * 3 + replica0[3:] + [[]] * 3
    per_step = [a + b for a, b in zip(padded, replica1, strict=True)]
    assert sorted(i for ids in per_step for i in ids) == sorted(list(range(24)) * 2)  # once per epoch
    assert all(r["loss"] == ranks[0]["loss"] for r in ranks)
    _assert_equals_one_device(ranks[0], per_step, 6)


def test_hybrid_stream_without_shard_is_read_by_replica_zero_and_equals_one_device():
    ranks = run_ranks(_train, 4, args=(2, "stream"), timeout=240)
    assert [r["reads"] for r in ranks] == [24, 24, 0, 0]  # replica 0's stages read; replica 1's none
    per_step = [a + b for a, b in zip(ranks[0]["steps_ids"], ranks[2]["steps_ids"], strict=True)]
    assert per_step == [list(range(b, b + 6)) for b in range(0, 24, 6)] * 2  # each global batch once
    _assert_equals_one_device(ranks[0], per_step, 4)


@pytest.mark.parametrize("data", ["files", "stream"])
def test_one_pipeline_reads_each_input_whole_on_every_stage_and_equals_one_device(data):
    ranks = run_ranks(_train, 2, args=(1, data), timeout=180)
    order = [i for file in Files().files for i in file]
    batches = [order[b : b + 6] for b in range(0, 24, 6)] * 2
    assert ranks[0]["steps_ids"] == batches and ranks[1]["steps"] == 8
    _assert_equals_one_device(ranks[0], batches, 4)
