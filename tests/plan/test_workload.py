"""Model profiling: exact byte counts where they are knowable, sane timings, the user's model untouched."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from _profiles import toy_profile
from torch import nn

from spread.plan.workload import measure_model


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def test_byte_counts_of_an_mlp_with_adam():
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    profile = measure_model(model, nn.CrossEntropyLoss(), x, y, optimizer=optimizer, repeats=1)
    n_params = 32 * 64 + 64 + 64 * 10 + 10
    assert profile.param_bytes == 4 * n_params
    # Adam keeps exp_avg and exp_avg_sq per parameter (plus a scalar step each).
    assert 2 * 4 * n_params <= profile.optimizer_bytes <= 2 * 4 * n_params + 64
    # Autograd saves at least the input (32), the hidden pre- and post-activation (64 + 64) per sample.
    assert profile.activation_bytes_per_sample >= 4 * (32 + 64)
    assert [layer.name for layer in profile.layers] == ["0", "1", "2"]
    assert sum(layer.time_share for layer in profile.layers) == pytest.approx(1.0)
    assert profile.layers[0].output_bytes_per_sample == 4 * 64
    assert profile.compute_seconds(16, 1) > 0
    assert not optimizer.state  # the user's optimizer never stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_checkpointing_keeps_block_outputs_and_one_block():
    profile = measure_model(
        _mlp(), nn.CrossEntropyLoss(), torch.randn(8, 32), torch.randint(0, 10, (8,)), repeats=1
    )
    kept = sum(layer.output_bytes_per_sample for layer in profile.layers)
    largest = max(layer.activation_bytes_per_sample for layer in profile.layers)
    assert profile.checkpointed_activation_bytes_per_sample() == kept + largest


class _Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(1000, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids).mean(1)).squeeze(1)


def test_embedding_rows_touched_are_counted():
    ids = torch.arange(40).reshape(10, 4)  # 10 samples, 4 distinct rows each, 40 distinct in all
    profile = measure_model(_Recommender(), nn.MSELoss(), ids, torch.zeros(10), repeats=1)
    assert profile.sparse_bytes == 1000 * 8 * 4
    assert profile.sparse_row_bytes == 8 * 4
    assert profile.sparse_rows_per_sample == pytest.approx(4.0)
    assert profile.dense_bytes == profile.param_bytes - profile.sparse_bytes


def test_a_batch_of_one_is_refused():
    with pytest.raises(ValueError, match="at least 2 samples"):
        measure_model(_mlp(), nn.CrossEntropyLoss(), torch.randn(1, 32), torch.zeros(1, dtype=torch.long))


def test_optimizers_whose_defaults_hold_extra_keys_are_copied():
    # torch's AdamW keeps "decoupled_weight_decay" in its defaults but does not take it as an argument.
    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    profile = measure_model(model, nn.CrossEntropyLoss(), x, y, optimizer=optimizer, repeats=1)
    assert profile.optimizer_bytes >= 2 * profile.param_bytes


class _MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def test_block_time_shares_count_backward_where_an_embedding_spends_it():
    # Forward, the embedding is a gather of 8 rows per sample; backward, it builds a dense gradient of
    # the whole 32 MB table. A pipeline cut placed by forward time alone would be far off.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(500_000, 16), _MeanPool(), nn.Linear(16, 2))
    ids, y = torch.randint(0, 500_000, (32, 8)), torch.randint(0, 2, (32,))
    profile = measure_model(model, nn.CrossEntropyLoss(), ids, y, repeats=1)
    shares = {layer.name: layer.time_share for layer in profile.layers}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["0"] > 0.8, shares
    assert all(p.grad is None for p in model.parameters())  # the user's model untouched


def test_compute_follows_the_measured_curve_where_small_batches_cost_more_per_sample():
    profile = toy_profile(
        compute={1: (0.01, 0.0003125), 2: (0.0, 1e-4)},
        batch=512,
        compute_curve={1: ((32.0, 0.02), (128.0, 0.05), (512.0, 0.17))},
    )
    assert profile.compute_seconds(64, 1) == pytest.approx(0.03)  # between two measured batches
    assert profile.compute_seconds(256, 1) == pytest.approx(0.09)
    assert profile.compute_seconds(1024, 1) == pytest.approx(0.33)  # the line through the last two
    assert profile.compute_seconds(16, 1) == pytest.approx(0.015)  # the line through the first two
    assert profile.compute_seconds(0, 1) == 0.0
    assert profile.compute_seconds(100, 2) == pytest.approx(0.01)  # no curve: the straight line
    steep = replace(profile, compute_curve={1: ((10.0, 0.001), (20.0, 0.01))})
    assert steep.compute_seconds(5, 1) == pytest.approx(0.0005)  # never below proportional


def test_compute_is_measured_at_every_halving_down_to_a_sixteenth_per_thread_count():
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    profile = measure_model(_mlp(), nn.CrossEntropyLoss(), x, y, threads=(1, 2), repeats=1)
    for threads in (1, 2):
        assert [b for b, _ in profile.compute_curve[threads]] == [4.0, 8.0, 16.0, 32.0, 64.0]
        assert all(seconds > 0 for _, seconds in profile.compute_curve[threads])


def test_block_costs_are_measured_per_micro_batch_and_thread_count():
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    torch.set_num_threads(2)
    profile = measure_model(_mlp(), nn.CrossEntropyLoss(), x, y, threads=(1, 2), repeats=1)
    assert torch.get_num_threads() == 2  # left as it was
    assert set(profile.layer_seconds) == {1, 2}
    for by_batch in profile.layer_seconds.values():
        assert sorted(by_batch) == [4, 8, 16, 32]  # micro-batches: below the full batch
        assert all(len(costs) == 3 and all(c > 0 for c in costs) for costs in by_batch.values())
    assert profile.layer_costs(20, 1) == list(profile.layer_seconds[1][16])  # nearest on a log scale
    assert profile.layer_costs(3, 2) == list(profile.layer_seconds[2][4])
    assert profile.layer_costs(30, 8) == list(profile.layer_seconds[2][32])  # nearest thread count
    not_a_chain = measure_model(nn.Linear(32, 10), nn.CrossEntropyLoss(), x, y, repeats=1)
    assert not_a_chain.layer_seconds == {} and not_a_chain.layer_costs(16, 1) == []


def test_compute_rounds_span_min_seconds():
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    started = time.perf_counter()
    measure_model(_mlp(), nn.CrossEntropyLoss(), x, y, threads=(1,), repeats=1, min_seconds=0.5)
    assert time.perf_counter() - started >= 0.5  # a lower bound the rounds guarantee, not a speed
