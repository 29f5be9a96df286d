"""ParameterServerStrategy as a user sees it: sync equals one device (P5), async digits trains,
Trainer.fit and custom loops work, wrong settings are refused by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _equivalence_cases import max_relative_difference, train_custom_loop
from torch import nn

import spread
from spread.cluster import ClusterSpec
from spread.errors import SpreadError
from spread.testing import run_ps_job

TOLERANCE = 1e-5
OPTIMIZERS = ["sgd_momentum", "adamw"]


def _rank() -> int:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return 0 if task["type"] == "chief" else task["index"] + 1


def _sync_worker(optimizer_name: str) -> dict:
    strategy = spread.ParameterServerStrategy(mode="sync")
    try:
        # Non-chief workers start from other weights: the chief's initial values must win.
        return train_custom_loop(strategy, optimizer_name, init_seed=_rank() * 101)
    finally:
        strategy.close()


@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
@pytest.mark.processes
def test_sync_mode_equals_one_device(optimizer_name):
    reference = train_custom_loop(spread.OneDeviceStrategy("cpu"), optimizer_name)
    results = _run(_sync_worker, 2, 2, optimizer_name)
    for rank in (0, 1):
        diff = max_relative_difference(results[rank].value, reference)
        print(f"P5 figures: {optimizer_name}, rank {rank}: max relative difference {diff:.2e}")
        assert diff <= TOLERANCE, f"rank {rank}: max relative difference {diff:.2e}"


def _run(fn, workers: int, servers: int, *args):
    results = run_ps_job(fn, workers, servers, args=args)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    return results


def _digits_worker() -> dict:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    train, val = (x[:1400], y[:1400]), (x[1400:], y[1400:])
    strategy = spread.ParameterServerStrategy()  # async
    try:
        with strategy.scope():
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        trainer = spread.Trainer(
            model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"]
        )
        history = trainer.fit(
            torch.utils.data.TensorDataset(*train), epochs=10, global_batch_size=64, verbose=0
        )
        if not strategy.is_chief:
            return {"steps": strategy.local_step}
        strategy.wait_for_workers()  # every worker's last push is in; the local copy is the final model
        with torch.no_grad():
            accuracy = float((model(val[0]).argmax(1) == val[1]).float().mean())
        stats = strategy.server_stats()
        return {
            "accuracy": accuracy,
            "loss": history.history["loss"],
            "stats": stats,
            "steps": strategy.local_step,
        }
    finally:
        strategy.close()


@pytest.mark.processes
def test_async_digits_two_workers_two_servers_reaches_93_percent():
    results = _run(_digits_worker, 2, 2)
    chief = results[0].value
    assert chief["accuracy"] >= 0.93, chief
    assert chief["loss"][-1] < chief["loss"][0]
    steps = results[0].value["steps"] + results[1].value["steps"]
    # every push reached every server exactly once
    assert [s["applied"] for s in chief["stats"]] == [steps, steps]
    assert [s["duplicates"] for s in chief["stats"]] == [0, 0]
    assert results[2].value == results[3].value == "exited 0"  # the servers were told to stop


def _spec(role: str = "chief", ps=("127.0.0.1:1",)) -> ClusterSpec:
    cluster = {"chief": ["127.0.0.1:2"], "ps": list(ps)} if ps else {"chief": ["127.0.0.1:2"]}
    return ClusterSpec(role=role, task_index=0, rank=0, world_size=1, cluster=cluster, source="tf_config")


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="mode must be one of"):
        spread.ParameterServerStrategy(mode="eventually", cluster=_spec())
    with pytest.raises(ValueError, match="max_staleness"):
        spread.ParameterServerStrategy(max_staleness=-1, cluster=_spec())
    with pytest.raises(ValueError, match="async"):
        spread.ParameterServerStrategy(mode="sync", max_staleness=2, cluster=_spec())
    with pytest.raises(SpreadError, match="needs parameter-server tasks"):
        spread.ParameterServerStrategy(cluster=_spec(ps=()))


def test_remote_servers_without_a_job_token_are_refused(monkeypatch):
    monkeypatch.delenv("SPREAD_JOB_TOKEN", raising=False)
    with pytest.raises(SpreadError, match=r"10\.0\.0\.5:2222.*need SPREAD_JOB_TOKEN"):
        spread.ParameterServerStrategy(cluster=_spec(ps=("10.0.0.5:2222",)))


def test_the_start_up_deadline_comes_from_spread_init_timeout_like_every_strategy(monkeypatch):
    monkeypatch.setenv("SPREAD_INIT_TIMEOUT", "40")
    from_env = spread.ParameterServerStrategy(cluster=_spec())
    given = spread.ParameterServerStrategy(cluster=_spec(), init_timeout=7)
    try:
        assert (from_env.init_timeout, given.init_timeout) == (40.0, 7.0)
    finally:
        from_env.close()  # no server listens: closing reports nothing and ends at once
        given.close()


def test_registered_by_name():
    from spread.strategies import STRATEGIES

    assert STRATEGIES["parameter_server"] is spread.ParameterServerStrategy
