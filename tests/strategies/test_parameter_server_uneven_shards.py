"""ParameterServerStrategy on uneven file shards and on a stream without ``shard()``.

Async: each task steps alone, so shards of different sizes need no agreement: every sample is
trained once per epoch and every push applied once. Sync: the tasks share no channel to end an
epoch together (they talk only to the servers), so data each task reads on its own is refused up
front (before, the servers waited for the finished task's share and the job failed after the call
timeout). Both modes refuse a stream without ``shard()``: every task would read it in full."""

from __future__ import annotations

import pytest
import torch
from _uneven_cases import Files
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import spread
from spread.errors import SpreadError
from spread.testing import run_ps_job

pytestmark = pytest.mark.processes


class _Stream(IterableDataset):
    def __iter__(self):
        yield from ((torch.full((5,), float(i)), i % 3) for i in range(24))


class _Ids(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[int]] = []

    def forward(self, x):
        self.steps.append([int(i) for i in x[:, 0].tolist()])
        return x[:, 1:]


def _refusal(strategy: spread.ParameterServerStrategy, data, **options) -> str:
    try:
        strategy.distribute_dataset(data, 6, **options)
    except SpreadError as exc:
        return str(exc)
    return "accepted"


def _async_task() -> dict:
    strategy = spread.ParameterServerStrategy()
    try:
        refused = _refusal(strategy, _Stream())
        with strategy.scope():
            torch.manual_seed(0)
            ids = _Ids()
            model = nn.Sequential(ids, nn.Linear(4, 3))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
        trainer.fit(Files(), epochs=2, global_batch_size=6, verbose=0)
        stats = None
        if strategy.is_chief:
            strategy.wait_for_workers()  # every task's last push is in
            stats = strategy.server_stats()
        return {"refused": refused, "ids": ids.steps, "steps": strategy.local_step, "stats": stats}
    finally:
        strategy.close()


def test_async_tasks_train_uneven_shards_each_sample_once_and_refuse_a_stream():
    results = run_ps_job(_async_task, 2, 1, timeout=180)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    chief, worker = results[0].value, results[1].value
    assert (chief["steps"], worker["steps"]) == (6, 12)  # shards of 8 and 16 in steps of 3, 2 epochs
    trained = [i for task in (chief, worker) for ids in task["ids"] for i in ids]
    assert sorted(trained) == sorted(list(range(24)) * 2)  # every sample once per epoch, none dropped
    assert chief["stats"][0]["applied"] == 18 and chief["stats"][0]["duplicates"] == 0
    for task in (chief, worker):
        assert "ParameterServerStrategy" in task["refused"] and "_Stream" in task["refused"]
        assert "shard(num_shards, index)" in task["refused"] and "map-style" in task["refused"]


def _sync_task() -> dict:
    strategy = spread.ParameterServerStrategy(mode="sync", shutdown_timeout=60)
    try:
        with strategy.scope():
            model = nn.Linear(4, 3)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        map_style = TensorDataset(torch.randn(24, 4), torch.arange(24) % 3)
        trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
        trainer.fit(map_style, epochs=1, global_batch_size=6, verbose=0)  # the accepted input trains
        return {
            "files": _refusal(strategy, Files()),
            "off": _refusal(strategy, map_style, shard_policy="off"),
            "stream": _refusal(strategy, _Stream()),
            "map": _refusal(strategy, map_style),
            "steps": strategy.local_step,
        }
    finally:
        strategy.close()


def test_sync_refuses_per_task_shards_and_streams_up_front():
    results = run_ps_job(_sync_task, 2, 1, timeout=180)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    for result in results[:2]:
        got = result.value
        assert "mode='sync'" in got["files"] and "Files" in got["files"] and "'file'" in got["files"]
        assert "'off'" in got["off"] and "map-style" in got["off"] and "mode='async'" in got["off"]
        assert "_Stream" in got["stream"] and "read it in full" in got["stream"]
        assert got["map"] == "accepted" and result.value["steps"] == 4
