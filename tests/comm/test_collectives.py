"""Collectives fail loudly: a dead or silent peer produces an error naming rank, op and sequence."""

from __future__ import annotations

import os
import time

import pytest
import torch

import spread
from spread.errors import CollectiveError, CollectiveTimeout, PeerLostError
from spread.testing import launch_ranks, run_ranks

pytestmark = pytest.mark.processes


def _basic_collectives() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        c = strategy.collectives
        rank = c.rank
        t = torch.full((5,), float(rank + 1))
        c.all_reduce(t)
        gathered = c.all_gather_uneven(torch.arange(rank + 1))
        b = torch.tensor([float(rank)])
        c.broadcast(b, src=1)
        return {"sum": t.tolist(), "gathered": [g.tolist() for g in gathered], "bcast": b.item()}
    finally:
        strategy.close()


def test_all_reduce_gather_broadcast():
    out = run_ranks(_basic_collectives, 2, timeout=60)
    for result in out:
        assert result["sum"] == [3.0] * 5
        assert result["gathered"] == [[0], [0, 1]]
        assert result["bcast"] == 1.0


def _reduce_scatter_rows() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        c = strategy.collectives
        n, rank = c.world_size, c.rank
        whole = torch.arange(n * 4, dtype=torch.float32) * (rank + 1)  # rank r's row: 4 values
        row = torch.empty(4)
        c.reduce_scatter(row, whole.clone())
        pending_row = torch.full((4,), -1.0)
        pending = c.reduce_scatter_async(pending_row, whole.clone())
        pending.wait()
        gathered = torch.empty(n * 4)
        c.all_gather_into(gathered, row)
        return {
            "row": row.tolist(),
            "async": pending_row.tolist(),
            "gathered": gathered.tolist(),
            "rank": rank,
        }
    finally:
        strategy.close()


def test_reduce_scatter_gives_each_rank_the_sum_of_its_row_sync_and_async():
    """On gloo both run as an all-reduce in place and a copy of the rank's row (gloo's own
    reduce-scatter copies the whole input); the result is the reduce-scatter's."""
    n = 3
    scale = sum(r + 1 for r in range(n))
    for result in run_ranks(_reduce_scatter_rows, n, timeout=60):
        r = result["rank"]
        expected = [float(v * scale) for v in range(r * 4, (r + 1) * 4)]
        assert result["row"] == expected
        assert result["async"] == expected
        assert result["gathered"] == [float(v * scale) for v in range(n * 4)]


def _broadcast_in_runs() -> list[list[float]]:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        c = strategy.collectives
        g = torch.Generator().manual_seed(c.rank)  # each rank its own values; rank 1's must win
        tensors = [
            torch.randn(3, generator=g),
            torch.randn(40, generator=g),  # 160 bytes: over the cap, broadcast in place alone
            torch.randn(4, 4, generator=g).t(),  # not contiguous: through a flat copy
            torch.randn(2, generator=g).double(),  # another dtype, another group
            torch.randn(5, generator=g),
        ]
        c.broadcast_tensors(tensors, src=1, max_bytes=64)
        return [t.reshape(-1).tolist() for t in tensors]
    finally:
        strategy.close()


def test_broadcast_tensors_in_capped_runs_gives_every_rank_the_sources_values():
    rank0, rank1 = run_ranks(_broadcast_in_runs, 2, timeout=60)
    assert rank0 == rank1


def _one_rank_misbehaves(mode: str) -> float:
    strategy = spread.MultiWorkerMirroredStrategy()
    c = strategy.collectives
    c.barrier()
    if c.rank == 1:
        if mode == "exit":
            os._exit(7)
        time.sleep(60)  # skips the collective
    start = time.monotonic()
    try:
        c.all_reduce(torch.ones(4), name="grad_all_reduce")
    except CollectiveError as exc:
        exc.elapsed = time.monotonic() - start  # type: ignore[attr-defined]
        raise
    return time.monotonic() - start


def test_dead_peer_is_detected_and_named():
    results = launch_ranks(_one_rank_misbehaves, 2, args=("exit",), collective_timeout=5, timeout=60)
    survivor = results[0]
    assert results[1].exitcode == 7
    assert survivor.error is not None, survivor.describe()
    assert survivor.error.split(":")[0] in (PeerLostError.__name__, CollectiveTimeout.__name__)
    assert "rank 0: grad_all_reduce #" in survivor.error
    assert survivor.seconds < 40


def test_rank_that_skips_a_collective_times_out_with_a_named_error():
    results = launch_ranks(
        _one_rank_misbehaves, 2, args=("skip",), collective_timeout=3, timeout=60, fail_fast_grace=1
    )
    survivor = results[0]
    assert survivor.error is not None and survivor.error.startswith(CollectiveTimeout.__name__), (
        survivor.describe()
    )
    assert "rank 0: grad_all_reduce #" in survivor.error
    assert results[1].timed_out or results[1].exitcode is not None
