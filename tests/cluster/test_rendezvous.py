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


def test_ranks_join_and_listen_on_loopback_only():
    results = launch_ranks(_join_and_report, 2, timeout=60)
    assert all(r.ok for r in results), [r.describe() for r in results]
    assert [r.value["rank"] for r in results] == [0, 1]


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


def test_missing_rank_is_named_within_the_deadline():
    results = launch_ranks(_join_and_report, 2, env={"WORLD_SIZE": "3"}, init_timeout=3, timeout=60)
    for r in results:
        assert r.error and "rank(s) [2] of 3 did not join within 3s" in r.error, r.describe()
        assert r.seconds < 30


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
