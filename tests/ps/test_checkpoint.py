"""P3's second half: a replaced parameter server gets its shards and optimizer state back from the
last checkpoint, bit for bit, and training goes on."""

from __future__ import annotations

import torch
from torch import nn

import spread
from spread.ps.server import ParameterServer
from spread.testing import chief_of

TOKEN = "checkpoint-test-token"


def _checksums(strategy) -> list[dict[str, float]]:
    state, _ = strategy.client.state()
    return [{k: float(v.double().sum()) for k, v in tensors.items()} for _, tensors in sorted(state.items())]


def test_restore_reproduces_a_replaced_servers_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("SPREAD_JOB_TOKEN", TOKEN)
    servers = [ParameterServer(i, token=TOKEN).start() for i in range(2)]
    spec = chief_of([s.address for s in servers])
    strategy = spread.ParameterServerStrategy(cluster=spec, min_shard_bytes=1024, timeout=10)
    try:
        with strategy.scope():
            torch.manual_seed(0)
            table, head = nn.Embedding(1000, 8), nn.Linear(8, 1)
            optimizer = torch.optim.Adam([*table.parameters(), *head.parameters()], lr=0.01)

        def step():
            optimizer.zero_grad()
            ids = torch.randint(0, 1000, (32,))
            strategy.run(lambda: head(table(ids)).pow(2).mean().backward())
            optimizer.step()

        for _ in range(3):
            step()
        strategy.save_servers(tmp_path)
        saved = _checksums(strategy)
        assert saved[1]  # server 1 holds a row shard and Adam state
        # server 1 dies; a fresh one comes up at the same address with nothing in it
        servers[1].stop()
        servers[1] = ParameterServer(1, token=TOKEN, address=servers[1].address).start()
        assert strategy.restore_servers(tmp_path) == 3
        assert _checksums(strategy) == saved
        step()  # training goes on against the restored server
        assert [s["applied"] for s in strategy.server_stats()] == [4, 1]
    finally:
        strategy.leave_worker_shutdown_to_coordinator()
        strategy.close()
        for s in servers:
            s.stop()
