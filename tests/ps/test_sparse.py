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


class TiedLanguageModel(nn.Module):
    """Token embedding reused as the output layer, as GPT-2 ties them: every row is read each step."""

    def __init__(self, vocab: int = 50, dim: int = 4, tied: bool = True) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.out.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.tokens(ids))


def _tied_steps(model: nn.Module, optimizer: torch.optim.Optimizer, run=None) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(0, 5, (16,), generator=g)  # rows 0-4 looked up; the output reads all 50
        optimizer.zero_grad()

        def step(ids=ids) -> None:
            nn.functional.cross_entropy(model(ids), (ids + 1) % 50).backward()

        run(step) if run else step()
        optimizer.step()


def test_an_embedding_tied_to_a_dense_layer_is_a_dense_variable(job):
    """Read by rows, the 45 rows only the output layer uses would never be pulled and their
    gradients never pushed."""
    strategy = job
    torch.manual_seed(0)
    reference = TiedLanguageModel()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    with strategy.scope():
        torch.manual_seed(0)
        model = TiedLanguageModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    assert strategy._dense_names() == [strategy._names[id(model.tokens.weight)]]
    _tied_steps(reference, ref_opt)
    _tied_steps(model, optimizer, strategy.run)
    torch.testing.assert_close(model.tokens.weight, reference.tokens.weight, rtol=1e-5, atol=1e-6)


def test_tying_after_the_table_was_placed_by_rows_is_refused_by_name(job):
    strategy = job
    with strategy.scope():
        model = TiedLanguageModel(tied=False)  # the table is placed by rows
    assert strategy._names[id(model.tokens.weight)] not in strategy._dense_names()
    model.out.weight = model.tokens.weight  # tied after the scope
    with pytest.raises(spread.errors.SpreadError, match=r"tied weights.*inside strategy.scope"):
        strategy.prepare_model(model)


def test_the_model_leaves_fit_and_checkpoints_with_the_servers_tables(job):
    """A task's table holds the rows it looked up, as they were when it looked: rows it never
    read keep their initial values. ``refresh_weights`` (the end of ``fit``) and
    ``full_state_dict`` (checkpoints, best weights, export) pull tables whole, and the dense
    variables."""
    strategy = job
    with strategy.scope():
        torch.manual_seed(0)
        table, head = nn.Embedding(100, 4), nn.Linear(4, 1)
        optimizer = torch.optim.SGD([*table.parameters(), *head.parameters()], lr=0.5)
    model = nn.Sequential(table, head)
    name = strategy._names[id(table.weight)]
    ids = torch.arange(10)
    optimizer.zero_grad()
    strategy.run(lambda: head(table(ids)).pow(2).mean().backward())
    optimizer.step()  # rows 0-9 changed on the servers; this copy read them before the update
    on_servers = strategy.client.pull(strategy.placement, [name])[name]
    assert not torch.equal(table.weight.detach(), on_servers)
    assert torch.equal(strategy.full_state_dict(model)["0.weight"], on_servers)
    # Dense variables too: in async mode a task's copy is as of its own last step (export, files).
    head_name = strategy._names[id(head.weight)]
    head_on_servers = strategy.client.pull(strategy.placement, [head_name])[head_name]
    head.weight.data.zero_()
    assert torch.equal(strategy.full_state_dict(model)["1.weight"], head_on_servers.view_as(head.weight))
    table.weight.data.zero_()
    strategy.refresh_weights()
    assert torch.equal(table.weight.detach(), on_servers)
