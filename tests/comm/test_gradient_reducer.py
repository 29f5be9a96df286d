"""Gradient exchange semantics: weighted sums, unused parameters, accumulation and no_sync."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.testing import run_ranks

pytestmark = pytest.mark.processes


class TwoHeads(nn.Module):
    """``head_b`` is used only when asked: the unused-parameter case."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head_a = nn.Linear(4, 1)
        self.head_b = nn.Linear(4, 1)
        self.never = nn.Linear(4, 1)

    def forward(self, x, use_b):
        h = self.body(x)
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def _reducer_semantics() -> dict:
    strategy = spread.MultiWorkerMirroredStrategy(bucket_cap_mb=0.0001)  # tiny buckets: several of them
    try:
        rank = strategy.rank
        torch.manual_seed(0)
        with strategy.scope():
            model = TwoHeads()
        x = torch.full((2, 4), float(rank + 1))

        # 1. head_b used only on rank 0: both ranks get its (weighted) gradient; `never` stays None.
        model(x, use_b=(rank == 0)).sum().backward()
        grads_1 = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}

        # 2. a second backward without zero_grad accumulates on top of the exchanged gradient.
        model(x, use_b=False).sum().backward()
        grads_2 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        # 3. no_sync: local accumulation, then one exchange of everything accumulated.
        model.zero_grad(set_to_none=True)
        before = strategy._reducer.reductions
        with strategy.no_sync():
            model(x, use_b=False).sum().backward()
        after_local = strategy._reducer.reductions
        model(x, use_b=False).sum().backward()
        grads_3 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return {
            "g1": grads_1,
            "g2": grads_2,
            "g3": grads_3,
            "exchanges": (before, after_local, strategy._reducer.reductions),
        }
    finally:
        strategy.close()


def _local_grads(use_b: bool, rank: int, repeats: int = 1) -> dict:
    torch.manual_seed(0)
    model = TwoHeads()
    x = torch.full((2, 4), float(rank + 1))
    for _ in range(repeats):
        model(x, use_b=use_b).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_weighted_sum_unused_parameters_accumulation_and_no_sync():
    out = run_ranks(_reducer_semantics, 2, timeout=90)
    local = {r: _local_grads(use_b=(r == 0), rank=r) for r in (0, 1)}
    plain = {r: _local_grads(use_b=False, rank=r) for r in (0, 1)}
    plain2 = {r: _local_grads(use_b=False, rank=r, repeats=2) for r in (0, 1)}
    for rank in (0, 1):
        g1 = out[rank]["g1"]
        assert g1["never.weight"] is None and g1["never.bias"] is None
        for name in ("body.weight", "head_a.weight", "head_b.weight"):
            expected = 0.5 * (local[0][name] + (local[1][name] if local[1][name] is not None else 0))
            torch.testing.assert_close(g1[name], expected)
        # head_b: only rank 0 produced a gradient, so both ranks hold half of it.
        torch.testing.assert_close(g1["head_b.weight"], 0.5 * local[0]["head_b.weight"])
        for name in ("body.weight", "head_a.bias"):
            expected = g1[name] + 0.5 * (plain[0][name] + plain[1][name])
            torch.testing.assert_close(out[rank]["g2"][name], expected)
        assert out[rank]["exchanges"][1] == out[rank]["exchanges"][0]  # no exchange under no_sync
        assert out[rank]["exchanges"][2] == out[rank]["exchanges"][0] + 1
        for name in ("body.weight", "head_a.weight"):
            expected = 0.5 * (plain2[0][name] + plain2[1][name])
            torch.testing.assert_close(out[rank]["g3"][name], expected)


def _bucket_placement(compression: str | None) -> dict:
    strategy = spread.MultiWorkerMirroredStrategy("shm", bucket_cap_mb=0.0001, compression=compression)
    try:
        with strategy.scope():
            model = TwoHeads()  # kept: the scope manages only the modules still alive at its exit
        reducer, algorithm = strategy._reducer, strategy.algorithm
        exchanged = [b.wire if b.wire is not None else b.buffer for b in reducer.buckets]
        return {
            "buckets": len(exchanged),
            "in_shared_memory": [algorithm._registered(buf) is not None for buf in exchanged],
            "wire_dtypes": sorted({str(buf.dtype) for buf in exchanged}),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    finally:
        strategy.close()


def test_shm_buckets_live_in_shared_memory_so_the_exchange_copies_nothing():
    for compression, dtype in ((None, "torch.float32"), ("bf16", "torch.bfloat16")):
        out = run_ranks(_bucket_placement, 2, args=(compression,), timeout=90)[0]
        assert out["buckets"] > 1 and all(out["in_shared_memory"]), out
        assert out["wire_dtypes"] == [dtype]
