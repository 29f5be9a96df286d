"""A parameter server and its client: exactly-once pushes (P1's mechanism), sync rounds, staleness
bounds, and a dead server reported by name within the timeout (P3)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spread.errors import ParameterServerError
from spread.ps.client import PSClient
from spread.ps.placement import VariableInfo, place
from spread.ps.server import ParameterServer

TOKEN = "server-test-token"
SGD = {"type": "sgd", "lr": 1.0, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False}


@pytest.fixture(params=["zmq", "grpc"])
def cluster(request):
    servers = [ParameterServer(i, token=TOKEN, transport=request.param).start() for i in range(2)]
    client = PSClient([s.address for s in servers], token=TOKEN, timeout=10, transport=request.param)
    variables = [VariableInfo("a", (4,), torch.float32), VariableInfo("b", (3,), torch.float32)]
    placement = place(variables, 2)
    yield servers, client, placement
    client.close()
    for s in servers:
        s.stop()


def _create(client, placement, **config):
    client.create(placement, {"a": torch.zeros(4), "b": torch.zeros(3)}, {"num_workers": 1, **config})


def _push(client, placement, step_id, *, worker=0, step=0, wait=None):
    return client.push(
        placement,
        step_id=step_id,
        worker=worker,
        step=step,
        optimizer=SGD,
        dense={"a": torch.ones(4), "b": torch.ones(3)},
        sparse={},
        pull=["a", "b"],
        wait=wait,
    )


def test_a_step_id_is_applied_exactly_once(cluster):
    _, client, placement = cluster
    _create(client, placement)
    fresh = _push(client, placement, "task-7")
    assert torch.equal(fresh["a"], -torch.ones(4))
    again = _push(client, placement, "task-7")  # a retry or a rescheduled task
    assert torch.equal(again["a"], -torch.ones(4))
    _push(client, placement, "task-8")
    stats = client.stats(ids=True)
    assert [s["applied"] for s in stats] == [2, 2]
    assert [s["duplicates"] for s in stats] == [1, 1]
    assert stats[0]["applied_ids"] == ["task-7", "task-8"]


def test_create_does_not_overwrite_trained_values(cluster):
    _, client, placement = cluster
    _create(client, placement)
    _push(client, placement, "s0")
    _create(client, placement)  # a restarted chief
    assert torch.equal(client.pull(placement, ["a"])["a"], -torch.ones(4))


def test_sync_round_waits_for_every_worker_then_applies_once(cluster):
    _, client, placement = cluster
    _create(client, placement, mode="sync", num_workers=2)
    results = {}

    def worker(w):
        results[w] = client.push(
            placement,
            step_id=f"w{w}",
            worker=w,
            step=0,
            optimizer=SGD,
            dense={"a": torch.full((4,), 0.5 * (w + 1))},
            sparse={},
            pull=["a"],
        )

    threads = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(results[0]["a"], torch.full((4,), -1.5)) and torch.equal(
        results[1]["a"], results[0]["a"]
    )
    assert [s["version"] for s in client.stats()] == [1, 1]


def test_sync_round_missing_a_worker_fails_naming_it(cluster):
    _, client, placement = cluster
    _create(client, placement, mode="sync", num_workers=2)
    with pytest.raises(
        ParameterServerError, match=r"sync step 0: waited 0.5s for the gradients of worker\(s\) \[1\]"
    ):
        _push(client, placement, "x", wait=0.5)


def test_staleness_bound_holds_back_a_fast_worker(cluster):
    _, client, placement = cluster
    _create(client, placement, num_workers=2, max_staleness=1)
    _push(client, placement, "w0s0", worker=0, step=0)  # 1 ahead of worker 1: allowed
    with pytest.raises(
        ParameterServerError, match=r"max_staleness=1: worker 0 at step 2 waited 0.3s for worker\(s\) \[1\]"
    ):
        _push(client, placement, "w0s1", worker=0, step=1, wait=0.3)
    # the held-back push was applied; only its answer (the next step's values) waits
    assert [s["applied"] for s in client.stats()] == [2, 2]
    _push(client, placement, "w1s0", worker=1, step=0)
    _push(client, placement, "w1s1", worker=1, step=1)
    _push(client, placement, "w0s2", worker=0, step=2, wait=5)


def test_a_stale_gradient_is_scaled_by_how_many_updates_overtook_it(cluster):
    """Two workers (W = 2): worker 1's gradient, computed on version 0 after worker 0 pushed 5
    times, is 5 updates old and applied at 2 / (5 + 1) = 1/3; one overtaken by a single update (the
    usual staleness of 2 workers) is applied whole."""
    _, client, placement = cluster
    _create(client, placement, num_workers=2)
    client.pull(placement, ["a", "b"])  # worker 1's copy: version 0
    stale_base = dict(client.versions)
    for step in range(5):  # worker 0, from another client in the real job
        _push(client, placement, f"w0-{step}", step=step)
    client.versions = stale_base
    fresh = _push(client, placement, "w1-0", worker=1)
    torch.testing.assert_close(fresh["a"], torch.full((4,), -5.0 - 1.0 / 3.0))
    worker_1_base = dict(client.versions)  # version 6: what worker 1 received
    _push(client, placement, "w0-5", step=5)
    client.versions = worker_1_base
    usual = _push(client, placement, "w1-1", worker=1, step=1)  # overtaken by one update: whole
    torch.testing.assert_close(usual["a"], torch.full((4,), -7.0 - 1.0 / 3.0))
    stats = client.stats()
    assert [s["damped"] for s in stats] == [1, 1] and [s["max_staleness_seen"] for s in stats] == [5, 5]


def test_stale_gradients_apply_keeps_every_gradient_whole(cluster):
    _, client, placement = cluster
    _create(client, placement, num_workers=2, stale_gradients="apply")
    client.pull(placement, ["a", "b"])
    stale_base = dict(client.versions)
    for step in range(5):
        _push(client, placement, f"w0-{step}", step=step)
    client.versions = stale_base
    assert torch.equal(_push(client, placement, "w1-0", worker=1)["a"], torch.full((4,), -6.0))
    stats = client.stats()
    assert [s["damped"] for s in stats] == [0, 0] and [s["max_staleness_seen"] for s in stats] == [5, 5]


def test_a_dead_server_is_named_within_the_timeout(cluster):
    servers, client, placement = cluster
    _create(client, placement)
    servers[1].stop()
    start = time.monotonic()
    with pytest.raises(
        ParameterServerError, match=rf"parameter server 1 \({servers[1].address}\): push failed"
    ):
        _push(client, placement, "s1")
    assert time.monotonic() - start < client.timeout
