"""Stage partitioning: balanced by cost, by user split points, with clear errors for bad arguments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spread.pipeline import as_layers, balanced_bounds, partition
from spread.pipeline.partition import measured_costs, parameter_costs


def brute_force_best(costs, stages):
    import itertools

    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[edges[i] : edges[i + 1]]) for i in range(stages)))
    return best


@pytest.mark.parametrize(
    "costs",
    [[1, 1, 1, 1], [5, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 7], [10, 1, 10, 1, 10], [3, 3, 3, 9]],
)
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_balanced_bounds_minimise_the_slowest_stage(costs, stages):
    bounds = balanced_bounds(costs, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(stages - 1))
    worst = max(sum(costs[a:b]) for a, b in bounds)
    assert worst == pytest.approx(brute_force_best(costs, stages))


def test_parameter_count_fallback_splits_a_deep_mlp_evenly():
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    assert partition(list(model), 2, balance_by="params") == [(0, 4), (4, 8)]
    assert partition(list(model), 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # no sample: parameter counts


def test_measured_costs_leave_no_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(4, 8)
    rng = torch.get_rng_state()
    costs = measured_costs(list(model), sample)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_measured_partition_puts_the_heavy_layer_alone():
    model = nn.Sequential(nn.Linear(4, 512), nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4))
    bounds = partition(list(model), 2, sample=torch.randn(64, 4))
    assert len(bounds) == 2 and bounds[0][0] == 0 and bounds[1][1] == 4


def test_user_split_points():
    layers = list(nn.Sequential(*[nn.ReLU() for _ in range(6)]))
    assert partition(layers, 3, split_points=[2, 5]) == [(0, 2), (2, 5), (5, 6)]


@pytest.mark.parametrize(
    ("stages", "points", "match"),
    [
        (3, [2], "must name stages-1=2"),
        (2, [0], "strictly increasing"),
        (2, [6], "strictly increasing"),
        (3, [3, 3], "strictly increasing"),
        (3, [4, 2], "strictly increasing"),
    ],
)
def test_bad_split_points_are_refused_by_value(stages, points, match):
    layers = [nn.ReLU() for _ in range(6)]
    with pytest.raises(ValueError, match=match):
        partition(layers, stages, split_points=points)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="stages=4 is more than the model's 3 layers"):
        partition([nn.ReLU(), nn.ReLU(), nn.ReLU()], 4)


def test_only_sequences_of_layers_are_split():
    with pytest.raises(TypeError, match=r"nn\.Sequential"):
        as_layers(nn.Linear(2, 2))
    assert len(as_layers([nn.ReLU(), nn.Tanh()])) == 2


def test_parameter_costs_count_parameters():
    assert parameter_costs([nn.Linear(3, 2), nn.ReLU()]) == [9.0, 1.0]
