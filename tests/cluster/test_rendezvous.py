"""Rendezvous: the job token, missing ranks and mismatched world sizes give clear errors, no hangs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous
from spread.errors import JobTokenError, RendezvousError
from spread.testing import launch_ranks
from spread.testing.time_budget import budget


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
        # within the init timeout, which the harness scales on a busy machine (3 s on an idle one)
        missing = r"rank\(s\) \[2\] of 3 did not join within \d+(\.\d+)?s"
        assert r.error and re.search(missing, r.error), r.describe()
        assert r.seconds < budget(30)


@pytest.mark.processes
def test_ranks_disagreeing_on_world_size_fail_clearly():
    results = launch_ranks(_join_and_report, 2, rank_env={1: {"WORLD_SIZE": "3"}}, init_timeout=3, timeout=60)
    assert not any(r.ok for r in results)
    messages = " ".join(r.error or "" for r in results)
    assert "did not join" in messages or "disagree on WORLD_SIZE" in messages


# Another process of the same user, without the job token: it connects to the job's store as a client
# (any local user can), and either writes the handshake's predictable key names ("predictable"),
# lists the keys to forge the arrival of a rank that has not joined yet ("early-arrival"), or
# overwrites every key the job wrote ("overwrite").
_ATTACKER = """
import json, sys, time
from datetime import timedelta
import torch.distributed as dist

attack, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = dist.TCPStore(host, port, None, False, timedelta(seconds=10))
if attack == "predictable":
    try:  # the names rank 0 used to write: wait for them so that the forgery lands after rank 0's
        store.wait(["spread/0/proof"], timedelta(seconds=2))
    except RuntimeError:
        pass
    for key in ("spread/0/nonce", "spread/0/proof", "spread/0/token-check"):
        store.set(key, "forged")
    sys.exit(0)
deadline = time.monotonic() + 30
while not (arrivals := [k for k in store.list_keys() if k.endswith("/arrived/0")]):
    if time.monotonic() > deadline:
        sys.exit("rank 0 never arrived")
    time.sleep(0.02)
if attack == "early-arrival":
    forged = {"world_size": 3, "pid": 1, "host": "forger"}
    store.set(arrivals[0][: -len("0")] + "1", json.dumps(forged))
else:
    for key in store.list_keys():
        if key.startswith("spread/"):
            store.set(key, "forged")
"""


def _join_after_an_attack(attack: str) -> dict:
    """Rank 1 runs the attacker to its end before it joins; rank 0 is already in its rendezvous."""
    if os.environ["RANK"] == "1":
        env = {k: v for k, v in os.environ.items() if k != "SPREAD_JOB_TOKEN"}
        argv = [sys.executable, "-c", _ATTACKER, attack, os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]]
        subprocess.run(argv, env=env, check=True, timeout=60, capture_output=True)
        time.sleep(0.5)  # before the fix, rank 0 read the forgery in this time
    return _join_and_report()


@pytest.mark.processes
def test_the_old_predictable_handshake_keys_written_by_another_process_do_not_stop_the_job():
    # Before: rank 1 read the forged nonce and proof and failed with "this process's SPREAD_JOB_TOKEN
    # does not match the job's" although its token was right.
    results = launch_ranks(_join_after_an_attack, 2, args=("predictable",), init_timeout=20, timeout=90)
    assert all(r.ok for r in results), [r.describe() for r in results]


@pytest.mark.processes
def test_an_arrival_forged_by_another_process_is_ignored_and_the_job_starts():
    # Before: rank 0 read the forged arrival and failed with "ranks disagree on WORLD_SIZE: {0: 2, 1: 3}".
    results = launch_ranks(_join_after_an_attack, 2, args=("early-arrival",), init_timeout=20, timeout=90)
    assert all(r.ok for r in results), [r.describe() for r in results]


@pytest.mark.processes
def test_handshake_content_overwritten_by_another_process_is_reported_as_not_written_by_the_job():
    results = launch_ranks(_join_after_an_attack, 2, args=("overwrite",), init_timeout=6, timeout=90)
    for r in results:
        assert r.error and r.error.startswith(RendezvousError.__name__), r.describe()
        assert "was not written by this job" in r.error, r.describe()
        assert "another process on this host, or another job using the same MASTER_ADDR" in r.error
        assert "does not match" not in r.error and "disagree on WORLD_SIZE" not in r.error
    assert not results[1].error.startswith(JobTokenError.__name__)  # the token is not in question
    assert "the job handshake" in results[1].error
    assert "rank(s) [1] of 2 did not join" in results[0].error  # rank 0 names the tampering too
    assert "the job handshake and the arrival of rank(s) [0]" in results[0].error


def test_a_value_not_sealed_with_the_token_reads_as_absent_and_is_named_forged():
    from spread.cluster.rendezvous import _SealedKeys

    store = dist.HashStore()
    job, other_token = _SealedKeys(store, "job-token", "spread/0"), _SealedKeys(store, "other", "spread/0")
    job.set("arrived/0", "payload")
    assert job.read("arrived/0") == "payload" and not job.forged
    other_token.set("arrived/0", "payload")  # a valid-looking seal, made without the job's token
    assert job.read("arrived/0") is None and job.forged == {"arrived/0"}
    store.set("arrived/1", job.store.get("arrived/0"))  # a sealed value moved to another key
    assert job.read("arrived/1") is None and "arrived/1" in job.forged
    assert job.read("never-written") is None and "never-written" not in job.forged


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


def test_a_regroup_admits_every_waiting_joiner_once_after_the_survivors():
    """Growing back (``spread run --recover``): processes that took a number from the store's joiner
    counter are named ``"+n"`` after the survivors' old ranks, and a later regroup admits only newer
    ones; ``joiners_waiting`` is what the chief reads each step."""
    from spread.cluster.rendezvous import _JOINERS, Rendezvous, _agree_on_members, _SealedKeys
    from spread.cluster.spec import ClusterSpec

    store = dist.HashStore()
    keys = _SealedKeys(store, "token", "spread/0")
    spec = ClusterSpec(role="chief", task_index=0, rank=0, world_size=2)
    job = Rendezvous(spec=spec, store=store, backend="gloo", _keys=keys, _job_store=store)
    assert not job.joiners_waiting()
    store.add(_JOINERS, 1)
    store.add(_JOINERS, 1)
    assert job.joiners_waiting()
    keys.set("regroup/1/alive/1", "1")  # rank 1 posted; rank 0 posts in the call
    members = _agree_on_members(keys, "regroup/1", 0, 2, lambda: [], timeout=5.0, admitted=0)
    assert members == [0, 1, "+1", "+2"]
    assert not Rendezvous(
        spec=spec, store=store, backend="gloo", _job_store=store, admitted=2
    ).joiners_waiting()
    members = _agree_on_members(keys, "regroup/2", 0, 4, lambda: [1, 2, 3], timeout=5.0, admitted=2)
    assert members == [0]  # the others are gone, nobody new waits
