"""Rendezvous: the job token, missing ranks and mismatched world sizes give clear errors, no hangs."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous
from spread.errors import JobTokenError, RendezvousError
from spread.testing import launch_ranks


def _join_and_report() -> dict:
    rdzv = rendezvous(resolve_cluster())
    try:
        keys_seen = rdzv.store.num_keys()
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "keys": keys_seen}
    finally:
        rdzv.close()


@pytest.mark.processes
def test_ranks_join_and_listen_on_loopback_only():
    results = launch_ranks(_join_and_report, 2, timeout=60)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert [r.value["rank"] for r in results] == [0, 1]


@pytest.mark.processes
def test_wrong_token_is_refused_and_writes_nothing():
    results = launch_ranks(
        _join_and_report,
        2,
        rank_env={1: {"SPREAD_JOB_TOKEN": "not-the-job-token"}},
        init_timeout=4,
        timeout=60,
    )
    intruder, chief = results[1], results[0]
    assert intruder.error and intruder.error.startswith(JobTokenError.__name__)
    assert "does not match" in intruder.error and "not-the-job-token" not in intruder.error
    # The chief never saw rank 1 arrive: the intruder wrote nothing into the job's namespace.
    assert chief.error and chief.error.startswith(RendezvousError.__name__)
    assert "rank(s) [1] of 2 did not join" in chief.error


@pytest.mark.processes
def test_missing_rank_is_named_within_the_deadline():
    results = launch_ranks(_join_and_report, 2, env={"WORLD_SIZE": "3"}, init_timeout=3, timeout=60)
    for r in results:
        assert r.error and "rank(s) [2] of 3 did not join within 3s" in r.error, r.describe()
        assert r.seconds < 30


@pytest.mark.processes
def test_ranks_disagreeing_on_world_size_fail_clearly():
    results = launch_ranks(_join_and_report, 2, rank_env={1: {"WORLD_SIZE": "3"}}, init_timeout=3, timeout=60)
    assert not any(r.ok for r in results)
    messages = " ".join(r.error or "" for r in results)
    assert "did not join" in messages or "disagree on WORLD_SIZE" in messages


def test_unreachable_store_names_the_address(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")  # discard port: nothing listens there
    with pytest.raises(RendezvousError, match=r"could not reach the rendezvous store at 127\.0\.0\.1:9"):
        rendezvous(resolve_cluster(), init_timeout=1)
    assert not dist.is_initialized()


def _store_host_dies_after_rendezvous(what: str) -> dict:
    """H4: rank 0 (which hosts the TCPStore) is SIGKILLed after joining; rank 1 carries on.

    ``store`` / ``collective``: rank 0 dies once both ranks are through rendezvous (a barrier first),
    then rank 1 reads the store or runs a collective. ``racing``: rank 0 dies the moment its own
    rendezvous returns, so rank 1 may still be inside rendezvous (the gloo setup on the store).
    """
    import os
    import signal
    import time

    import torch

    from spread.comm.ops import Collectives

    rank = int(os.environ["RANK"])
    rdzv = None
    start = time.monotonic()
    try:
        rdzv = rendezvous(resolve_cluster())
        if what != "racing":
            Collectives().barrier(name="everyone_joined")
        if rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        start = time.monotonic()
        if what == "store":
            rdzv.store.get("a-key-nobody-sets")
        else:
            Collectives().all_reduce(torch.ones(4), name="after_chief_death")
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    detected = time.monotonic() - start
    close_start = time.monotonic()
    if rdzv is not None:
        rdzv.close()  # shutting down must not block on the dead store either
    return {"outcome": outcome, "detected_s": detected, "close_s": time.monotonic() - close_start}


@pytest.mark.parametrize("what", ["store", "collective", "racing"])
@pytest.mark.processes
def test_h4_store_host_dies_after_rendezvous_workers_fail_within_the_deadline(what):
    results = launch_ranks(
        _store_host_dies_after_rendezvous,
        2,
        args=(what,),
        init_timeout=10,
        collective_timeout=10,
        fail_fast_grace=40,
        timeout=90,
        store_host="rank0",  # the store dies with rank 0, as in a job started without a launcher
    )
    assert results[0].exitcode == -9, results[0].describe()
    worker = results[1]
    assert worker.ok, worker.describe()
    value = worker.value
    outcome = value["outcome"]
    if what == "store":
        assert outcome.startswith("DistNetworkError") and "Connection was likely closed" in outcome
    elif what == "collective":
        assert outcome.startswith(("PeerLostError", "CollectiveTimeout")), outcome
        assert "rank 1: after_chief_death #0" in outcome
    else:
        assert outcome.startswith(("RendezvousError", "PeerLostError", "CollectiveTimeout")), outcome
        assert "rank 1" in outcome
    assert value["detected_s"] < 10 + 15  # the configured deadline plus a margin for a loaded machine
    assert value["close_s"] < 15
    print("FIGURES H4", what, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in value.items()})
