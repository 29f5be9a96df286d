"""Sparse access: a batch touching k rows of a 100k-row table moves O(k) bytes, not O(table)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.ps.server import ParameterServer
from spread.testing import chief_of

TOKEN = "sparse-test-token"
ROWS, DIM = 100_000, 16
ROW_BYTES = DIM * 4


@pytest.fixture(params=["zmq", "grpc"])
def job(monkeypatch, request):
    monkeypatch.setenv("SPREAD_JOB_TOKEN", TOKEN)
    servers = [ParameterServer(i, token=TOKEN, transport=request.param).start() for i in range(2)]
    spec = chief_of([s.address for s in servers])
    strategy = spread.ParameterServerStrategy(cluster=spec, transport=request.param)
    yield strategy
    strategy.leave_worker_shutdown_to_coordinator()
    strategy.close()
    for s in servers:
        s.stop()


@pytest.mark.parametrize("sparse_grad", [True, False])
def test_bytes_per_step_grow_with_rows_touched_not_table_size(job, sparse_grad):
    strategy = job
    with strategy.scope():
        torch.manual_seed(0)
        table = nn.Embedding(ROWS, DIM, sparse=sparse_grad)
        head = nn.Linear(DIM, 1)
        optimizer = torch.optim.SGD([*table.parameters(), *head.parameters()], lr=0.1)
    assert len(strategy.placement.shards[strategy._names[id(table.weight)]]) == 2  # split by rows

    def step(k: int) -> int:
        ids = torch.randperm(ROWS)[:k]  # k distinct rows, spread over both servers
        before = strategy.bytes_moved()
        optimizer.zero_grad()
        strategy.run(lambda: head(table(ids)).pow(2).mean().backward())
        optimizer.step()
        return strategy.bytes_moved() - before

    moved = {k: step(k) for k in (10, 100, 1000)}
    for k, n in moved.items():
        # pull k rows + ids, push k rows + ids, plus a fixed overhead (headers, the small dense head)
        assert n <= 2 * k * (ROW_BYTES + 8) + 8192, (k, n)
        assert n < ROWS * ROW_BYTES / 20
    assert moved[1000] > 5 * moved[100] and moved[100] > 2 * moved[10]  # grows with k


def test_sparse_updates_equal_one_device_sgd(job):
    strategy = job
    torch.manual_seed(0)
    ref_table, ref_head = nn.Embedding(1000, 4, sparse=True), nn.Linear(4, 1)
    ref_opt = torch.optim.SGD([*ref_table.parameters(), *ref_head.parameters()], lr=0.5)
    with strategy.scope():
        torch.manual_seed(0)
        table, head = nn.Embedding(1000, 4, sparse=True), nn.Linear(4, 1)
        optimizer = torch.optim.SGD([*table.parameters(), *head.parameters()], lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids, y = torch.randint(0, 1000, (32,), generator=g), torch.randn(32, 1, generator=g)
        for t, h, o, run in ((table, head, optimizer, strategy.run), (ref_table, ref_head, ref_opt, None)):
            o.zero_grad()
            fn = lambda t=t, h=h, ids=ids, y=y: nn.functional.mse_loss(h(t(ids)), y).backward()  # noqa: E731
            run(fn) if run else fn()
            o.step()
    name = strategy._names[id(table.weight)]
    on_servers = strategy.client.pull(strategy.placement, [name])[name]
    assert torch.allclose(on_servers, ref_table.weight.detach(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(head.weight, ref_head.weight, rtol=1e-5, atol=1e-6)
