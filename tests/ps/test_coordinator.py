"""ClusterCoordinator on a real job: every scheduled step applied exactly once when a worker is
SIGKILLed mid-step (P1), a restarted worker rejoins (P2), a dead server is named (P3), and shutdown
leaves no thread or socket (P7)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from torch import nn

import spread
from spread.errors import SpreadError
from spread.testing import run_ps_job

_STATE: dict = {}


def _make_data():
    g = torch.Generator().manual_seed(int(os.environ.get("SPREAD_TEST_SEED", "0")))
    x = torch.randn(64, 4, generator=g)
    return [(x[i : i + 8], x[i : i + 8].sum(1, keepdim=True)) for i in range(0, 64, 8)]


def _train_step(iterator, task: int):
    x, y = next(iterator)
    model, optimizer = _STATE["model"], _STATE["optimizer"]
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()  # pushes this task's gradients under its step id
    _STATE["ran"] = _STATE.get("ran", 0) + 1
    kill_at = os.environ.get("SPREAD_TEST_KILL_AT")
    if kill_at and _STATE["ran"] == int(kill_at):
        open(os.environ["SPREAD_TEST_MARKER"], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)  # after the push, before the chief hears back
    time.sleep(float(os.environ.get("SPREAD_TEST_TASK_SECONDS", "0")))
    stuck_task = os.environ.get("SPREAD_TEST_STUCK_TASK") == str(task)
    if stuck_task or os.environ.get("SPREAD_TEST_STUCK_RUN") == str(_STATE["ran"]):  # pushed, reports late
        time.sleep(float(os.environ["SPREAD_TEST_STUCK_SECONDS"]))
    return {"loss": loss.detach(), "task": task, "pid": os.getpid()}


def _setup(**coordinator_options):
    marker = os.environ.get("SPREAD_TEST_WAIT_FOR")
    if marker:  # a restarted worker: start only once the first one died
        deadline = time.monotonic() + 120
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
    strategy = spread.ParameterServerStrategy(timeout=20)
    with strategy.scope():
        torch.manual_seed(0)
        _STATE["model"] = nn.Linear(4, 1)
        _STATE["optimizer"] = torch.optim.SGD(_STATE["model"].parameters(), lr=0.05)
    coordinator = spread.ClusterCoordinator(strategy, **coordinator_options)
    iterator = iter(coordinator.create_per_worker_dataset(_make_data))
    return strategy, coordinator, iterator


def _exactly_once_job(num_tasks: int, rejoin: bool) -> dict:
    threads_before = {t.ident for t in threading.enumerate()}
    strategy, coordinator, iterator = _setup()
    first = [coordinator.schedule(_train_step, args=(iterator, i)) for i in range(num_tasks)]
    coordinator.join()
    second = []
    rejoin_seconds = float("nan")
    if rejoin:
        deadline = time.monotonic() + 120
        while coordinator.stats()["sessions"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        rejoin_seconds = time.time() - os.path.getmtime(os.environ["SPREAD_TEST_MARKER"])
        second = [coordinator.schedule(_train_step, args=(iterator, num_tasks + i)) for i in range(num_tasks)]
        coordinator.join()
    results = [v.fetch() for v in first + second]
    server_stats = strategy.server_stats(ids=True)
    coordinator_stats = coordinator.stats()
    coordinator.shutdown()
    strategy.close()
    time.sleep(0.2)
    leftover_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
    port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["chief"][0].rsplit(":", 1)[1])
    listening = [c for c in psutil.Process().net_connections("tcp") if c.laddr.port == port]
    return {
        "tasks": sorted(r["task"] for r in results),
        "servers": server_stats,
        "coordinator": coordinator_stats,
        "worker_pids": len({r["pid"] for r in results}),
        "rejoin_seconds": rejoin_seconds,
        "leftover_threads": leftover_threads,
        "chief_sockets": len(listening),
    }


@pytest.mark.parametrize("transport", ["zmq", "grpc"])
@pytest.mark.processes
def test_worker_sigkilled_mid_step_every_step_applied_exactly_once(tmp_path, transport):
    marker = str(tmp_path / "killed")
    n = 24
    env = {"SPREAD_TEST_MARKER": marker, "SPREAD_TEST_TASK_SECONDS": "0.1", "SPREAD_PS_TRANSPORT": transport}
    results = run_ps_job(
        _exactly_once_job,
        3,
        2,
        args=(n, True),
        env=env,
        rank_env_extra={1: {"SPREAD_TEST_KILL_AT": "3"}, 5: {"SPREAD_TEST_WAIT_FOR": marker}},
        extra_workers=1,
    )
    assert results[1].exitcode == -signal.SIGKILL  # worker 0 died mid-step
    for r in results[:1] + results[2:]:
        assert r.ok, r.describe()
    chief = results[0].value
    print(
        f"P1/P2/P7 figures: coordinator {chief['coordinator']}, duplicates per server "
        f"{[s['duplicates'] for s in chief['servers']]}, applied per server "
        f"{[s['applied'] for s in chief['servers']]}, rejoin seconds {chief['rejoin_seconds']:.1f}, "
        f"threads left {chief['leftover_threads']}, chief sockets {chief['chief_sockets']}"
    )
    assert chief["tasks"] == list(range(2 * n))  # nothing lost, each result once
    step_ids = [s["applied_ids"] for s in chief["servers"]]
    for ids in step_ids:
        assert len(ids) == len(set(ids)) == 2 * n  # every step applied exactly once on each server
    assert all(s["duplicates"] >= 1 for s in chief["servers"])  # the killed worker's push, re-run
    stats = chief["coordinator"]
    assert stats["scheduled"] == stats["completed"] == 2 * n
    assert stats["rescheduled"] == 1 and stats["workers_lost"] == 1
    # P2: the restarted worker rejoined and ran tasks (2 original workers + 1 restarted)
    assert stats["sessions"] == 3 and chief["worker_pids"] == 3
    assert chief["leftover_threads"] == [] and chief["chief_sockets"] == 0  # P7


def _dead_server_job() -> dict:
    strategy, coordinator, iterator = _setup()
    for v in [coordinator.schedule(_train_step, args=(iterator, i)) for i in range(4)]:
        v.fetch(timeout=60)
    address = strategy.cluster.cluster["ps"][1]
    port = int(address.rsplit(":", 1)[1])
    (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"}
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    coordinator.schedule(_train_step, args=(iterator, 99))
    try:
        coordinator.join(timeout=60)
        error = None
    except SpreadError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    coordinator.shutdown()
    strategy.close()
    return {"error": error, "seconds": seconds, "address": address}


@pytest.mark.processes
def test_dead_parameter_server_is_named_within_the_timeout():
    results = run_ps_job(_dead_server_job, 2, 2)
    chief = results[0].value
    assert results[0].ok, results[0].describe()
    assert results[3].exitcode == -signal.SIGKILL
    print(f"P3 figures: detected in {chief['seconds']:.2f}s: {chief['error']}")
    assert f"parameter server 1 ({chief['address']})" in chief["error"], chief
    assert chief["seconds"] < 20  # the call timeout


def test_schedule_refuses_functions_workers_cannot_find():
    from spread.ps.coordinator_tasks import function_reference as _function_reference

    with pytest.raises(ValueError, match="module-level Python function"):
        _function_reference(lambda: None)
    for builtin in (exec, print, os.system, nn.Linear):  # never schedulable, even by the chief
        with pytest.raises(ValueError, match="module-level Python function"):
            _function_reference(builtin)
    assert _function_reference(_train_step) == (__name__, "_train_step")


def test_a_worker_resolves_only_functions_of_its_script_modules():
    from spread.ps.coordinator_tasks import resolve_function as _resolve_function

    here = {__name__}
    assert _resolve_function(__name__, "_train_step", modules=here) is _train_step
    refused = [
        ("builtins", "exec"),  # a builtin
        ("os", "system"),  # a module the worker imported, not its script
        (__name__, "time.sleep"),  # reached through an attribute of the script
        (__name__, "run_ps_job"),  # a library function imported into the script
        (__name__, "nn.Linear"),
        (__name__, "_STATE.clear"),
        (__name__, "no_such_function"),
        ("spread.ps.coordinator_tasks", "encode_value"),  # a real function of a module outside the script's
    ]
    for module, qualname in refused:
        with pytest.raises(SpreadError, match="which this worker does not run"):
            _resolve_function(module, qualname, modules=here | {"os"})


def _stuck_worker_job(num_tasks: int, max_attempts: int) -> dict:
    strategy, coordinator, iterator = _setup(task_timeout=2.0, max_task_attempts=max_attempts)
    start = time.monotonic()
    values = [coordinator.schedule(_train_step, args=(iterator, i)) for i in range(num_tasks)]
    try:
        coordinator.join(timeout=90)
        error = None
    except SpreadError as exc:
        error = str(exc)
    seconds = time.monotonic() - start
    done = sorted(v.fetch()["task"] for v in values if v._error is None)
    out = {
        "error": error,
        "seconds": seconds,
        "tasks": done,
        "servers": strategy.server_stats(ids=True),
        "coordinator": coordinator.stats(),
    }
    coordinator.shutdown()
    strategy.close()
    return out


@pytest.mark.processes
def test_a_stuck_worker_times_out_and_its_task_runs_elsewhere_exactly_once():
    stuck = {"SPREAD_TEST_STUCK_RUN": "2", "SPREAD_TEST_STUCK_SECONDS": "8"}  # its second task
    results = run_ps_job(
        _stuck_worker_job,
        3,
        1,
        args=(8, 3),
        env={"SPREAD_TEST_TASK_SECONDS": "0.2"},
        rank_env_extra={1: stuck},
    )
    for r in results:
        assert r.ok, r.describe()  # the dropped worker exits cleanly once its step comes back
    chief = results[0].value
    print(f"stuck worker: {chief['coordinator']}, join took {chief['seconds']:.1f}s")
    assert chief["error"] is None and chief["tasks"] == list(range(8))
    stats = chief["coordinator"]
    assert stats["timed_out"] == 1 and stats["rescheduled"] == 1
    ids = chief["servers"][0]["applied_ids"]
    assert len(ids) == len(set(ids)) == 8  # the stuck attempt's push and the rerun's count once
    assert chief["seconds"] < 8  # the chief did not wait for the stuck worker


@pytest.mark.processes
def test_a_task_that_times_out_on_every_attempt_fails_naming_itself():
    stuck = {"SPREAD_TEST_STUCK_TASK": "3", "SPREAD_TEST_STUCK_SECONDS": "6"}
    results = run_ps_job(_stuck_worker_job, 3, 1, args=(4, 2), env=stuck)
    for r in results:
        assert r.ok, r.describe()
    chief = results[0].value
    assert chief["tasks"] == [0, 1, 2]
    assert "task 3" in chief["error"] and "task_timeout=2s" in chief["error"], chief["error"]
    assert "2 attempt(s)" in chief["error"]
    assert chief["coordinator"]["timed_out"] == 2


def test_bad_task_timeouts_are_refused():
    with pytest.raises(ValueError, match="task_timeout"):
        spread.ClusterCoordinator(None, task_timeout=0)
    with pytest.raises(ValueError, match="max_task_attempts"):
        spread.ClusterCoordinator(None, task_timeout=1.0, max_task_attempts=0)


def _strategy_of(role: str, index: int = 0):
    """What ClusterCoordinator reads of its strategy, for a task of ``role`` (nothing connects)."""
    from types import SimpleNamespace

    from spread.cluster import ClusterSpec

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    rank = {"chief": 0, "worker": 1 + index}.get(role, -1)
    spec = ClusterSpec(
        role=role, task_index=index, rank=rank, world_size=2, cluster=cluster, source="tf_config"
    )
    return SimpleNamespace(
        cluster=spec,
        job_token="t",
        transport="zmq",
        init_timeout=1.0,
        client=SimpleNamespace(timeout=1.0),
        leave_worker_shutdown_to_coordinator=lambda: None,
        rank=rank,
    )


def test_the_chief_side_calls_are_refused_clearly_on_a_worker():
    coordinator = spread.ClusterCoordinator(_strategy_of("worker"))
    assert coordinator.role == "worker" and coordinator.chief_address == "127.0.0.1:1"
    for call in (coordinator.stats, coordinator.done):
        with pytest.raises(
            SpreadError, match=r"ClusterCoordinator\.\w+ runs on the chief, not on a worker task"
        ):
            call()
    coordinator.shutdown()  # nothing to do on a worker: no error


def test_a_task_that_neither_trains_nor_schedules_cannot_coordinate():
    with pytest.raises(SpreadError, match="runs on the chief and worker tasks, not on a ps"):
        spread.ClusterCoordinator(_strategy_of("ps"))
