"""Split a sequence of layers into contiguous pipeline stages of about equal cost.

Why balance: a pipeline runs at the pace of its slowest stage; every other stage idles for the
difference. Costs are measured per layer (forward plus backward time on a sample micro-batch) when a
sample is given, else estimated by parameter count; the split then minimises the most expensive
stage (exact, by dynamic programming over the contiguous splits). Users may name the split points
themselves instead.

A *split point* is the index of the first layer of a stage (stage 0 starts at layer 0): with 6 layers,
``split_points=[2, 4]`` makes stages ``[0, 2)``, ``[2, 4)``, ``[4, 6)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from spread._device import wait_for_device

BALANCE_BY = ("time", "params")


def as_layers(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers of an ``nn.Sequential`` (or a list of modules), in order."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if isinstance(model, (list, tuple, nn.ModuleList)) and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise TypeError(
        "a pipeline splits an nn.Sequential or a list of modules (each layer's output is the next "
        f"layer's input); got {type(model).__name__}. Wrap your blocks in nn.Sequential."
    )


def check_stage_count(num_layers: int, stages: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if stages > num_layers:
        raise ValueError(
            f"stages={stages} is more than the model's {num_layers} layers: every stage needs at least "
            f"one layer (use fewer stages or split the model into more nn.Sequential entries)"
        )


def bounds_from_split_points(
    num_layers: int, stages: int, split_points: Sequence[int]
) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` per stage from user split points, refusing bad ones by value."""
    check_stage_count(num_layers, stages)
    points = list(split_points)
    if len(points) != stages - 1:
        raise ValueError(
            f"split_points must name stages-1={stages - 1} layer indices (where stages 1..{stages - 1} "
            f"start), got {len(points)}: {points!r}"
        )
    if any(not isinstance(p, int) for p in points):
        raise ValueError(f"split_points must be integers, got {points!r}")
    if points != sorted(set(points)) or (points and (points[0] < 1 or points[-1] > num_layers - 1)):
        raise ValueError(
            f"split_points must be strictly increasing layer indices in [1, {num_layers - 1}] so every "
            f"stage gets at least one layer, got {points!r}"
        )
    edges = [0, *points, num_layers]
    return [(edges[i], edges[i + 1]) for i in range(stages)]


def balanced_bounds(costs: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest part's sum
    (ties broken towards the earlier split). Exact: O(stages * layers^2)."""
    n = len(costs)
    check_stage_count(n, stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + max(float(c), 0.0))
    inf = float("inf")
    # best[k][i]: the smallest possible largest-stage cost for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    edges = [n]
    for k in range(stages, 0, -1):
        edges.append(cut[k][edges[-1]])
    edges.reverse()
    return [(edges[i], edges[i + 1]) for i in range(stages)]


def parameter_costs(layers: Sequence[nn.Module]) -> list[float]:
    """Parameter count per layer (plus one, so parameter-free layers still weigh something)."""
    return [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]


def measured_costs(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5) -> list[float]:
    """Seconds of forward plus backward per layer on ``sample``: the fastest of ``repeats`` runs after
    one warm-up (on a shared machine, interference only ever adds time, so the minimum is the
    steadiest estimate of the layer's own cost).

    The layers run in sequence, each on the previous one's output. The measurement leaves no trace:
    ``.grad`` fields, buffers (batch-norm statistics) and the random number generator are restored.
    """
    saved = {id(p): p.grad for layer in layers for p in layer.parameters()}
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    costs: list[float] = []
    x = sample
    rng = torch.random.fork_rng(devices=[])
    rng.__enter__()
    try:
        for layer in layers:
            times = []
            out = None
            for r in range(repeats + 1):
                inp = x.detach().requires_grad_(x.is_floating_point())
                wait_for_device()
                started = time.perf_counter()
                out = layer(inp)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.backward(torch.ones_like(out))
                wait_for_device()
                if r:
                    times.append(time.perf_counter() - started)
            costs.append(min(times))
            if not isinstance(out, torch.Tensor):
                raise TypeError(
                    f"layer {len(costs) - 1} ({type(layer).__name__}) returned {type(out).__name__}; "
                    "pipeline stages pass one tensor from layer to layer"
                )
            x = out.detach()
    finally:
        rng.__exit__(None, None, None)
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for layer in layers:
            for p in layer.parameters():
                p.grad = saved[id(p)]
    return costs


def partition(
    layers: Sequence[nn.Module],
    stages: int,
    *,
    split_points: Sequence[int] | None = None,
    sample: torch.Tensor | None = None,
    balance_by: str = "time",
) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: each stage's layer range.

    ``split_points`` wins when given. Otherwise ``balance_by="time"`` measures each layer on
    ``sample`` (falling back to parameter count when there is no sample), ``"params"`` uses parameter
    counts. Raises ``ValueError`` for more stages than layers or bad split points.
    """
    if balance_by not in BALANCE_BY:
        raise ValueError(f"balance_by must be one of {BALANCE_BY}, got {balance_by!r}")
    if split_points is not None:
        return bounds_from_split_points(len(layers), stages, split_points)
    check_stage_count(len(layers), stages)
    if balance_by == "time" and sample is not None:
        with torch.enable_grad():
            costs = measured_costs(layers, sample)
    else:
        costs = parameter_costs(layers)
    return balanced_bounds(costs, stages)
