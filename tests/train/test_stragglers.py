"""The rank that lags is named (issue 37 item 2): a rank 50 ms slower per forward within 20 steps,
with its phase; balanced runs name nobody; the figures reach the epoch's logs."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from spread.testing import run_ranks
from spread.train.stragglers import StragglerWatch


class _FakeStrategy:
    """Every rank's per-step figures as the test sets them; this process is rank 0."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.rows: list[list[float]] = []
        self.exchange_seconds = 0.0

    def gather_from_every_rank(self, mine: torch.Tensor) -> torch.Tensor:
        return torch.tensor([mine[0].tolist(), *self.rows[1:]], dtype=torch.float64)


def _watch(strategy, lines):
    return StragglerWatch(strategy, lines.append, window=2, consecutive=2)  # type: ignore[arg-type]


def _windows(watch, strategy, others, count, mine=(0.010, 0.0)):
    """``count`` windows of 2 steps: this rank computes mine[0] s and waits mine[1] s for data per
    step; the other ranks' rows are ``others`` ([compute, exchange, data] seconds per step)."""
    strategy.rows = [[0, 0, 0], *others]
    for _ in range(2 * count):
        watch.after_step(mine[0], mine[1])


def test_a_rank_slower_in_two_windows_in_a_row_is_named_once_with_its_phase():
    strategy, lines = _FakeStrategy(), []
    watch = _watch(strategy, lines)
    _windows(watch, strategy, [[0.060, 0, 0], [0.011, 0, 0]], 1)
    assert lines == []  # one slow window is noise
    _windows(watch, strategy, [[0.060, 0, 0], [0.011, 0, 0]], 3)
    assert lines == [
        "spread: rank 1 is a straggler: forward and backward 60.0 ms/step against 10.5 ms on the other "
        "ranks (the last 4 steps); the others wait for it in every exchange"
    ]
    assert watch.figures["timing/slowest_rank"] == 1.0 and watch.figures["timing/slowest_compute_ms"] == 60.0
    _windows(watch, strategy, [[0.010, 0, 0], [0.011, 0, 0]], 1)  # recovered ...
    _windows(watch, strategy, [[0.060, 0, 0], [0.011, 0, 0]], 2)  # ... and slow again: named again
    assert len(lines) == 2
    assert watch.summary() == (
        "spread: stragglers in this fit: rank 1 (forward and backward: 60.0 ms/step against 10.5 ms); "
        "rank 1 (forward and backward: 60.0 ms/step against 10.5 ms)"
    )


def test_a_rank_waiting_for_its_data_is_named_for_that():
    strategy, lines = _FakeStrategy(), []
    watch = _watch(strategy, lines)
    _windows(watch, strategy, [[0.010, 0, 0.002]], 2, mine=(0.010, 0.040))
    assert lines and lines[0].startswith("spread: rank 0 is a straggler: waiting for data 40.0 ms/step")


def test_small_or_proportionally_small_differences_name_nobody():
    strategy, lines = _FakeStrategy(), []
    watch = _watch(strategy, lines)
    _windows(watch, strategy, [[0.002, 0, 0], [0.0021, 0, 0]], 5, mine=(0.006, 0.0))  # 3x, but 4 ms
    _windows(watch, strategy, [[0.100, 0, 0], [0.100, 0, 0]], 5, mine=(0.120, 0.0))  # 20 ms, but 1.2x
    assert lines == [] and watch.summary() is None


class _SlowOnRank(nn.Module):
    def __init__(self, slow_rank: int, rank: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        self.sleep = 0.05 if rank == slow_rank else 0.0

    def forward(self, x):
        if self.sleep:
            time.sleep(self.sleep)
        return self.layers(x)


def _fit(slow_rank: int, fits: int, steps: int) -> dict:
    import spread

    strategy = spread.MultiWorkerMirroredStrategy()
    lines: list[str] = []
    episodes, figures = [], []
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32 * steps, 32, generator=g), torch.randint(0, 4, (32 * steps,), generator=g)
    for _ in range(fits):
        with strategy.scope():
            model = _SlowOnRank(slow_rank, strategy.rank)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
        if strategy.is_chief:
            trainer._report = lines.append  # type: ignore[method-assign]  # what the chief prints
        history = trainer.fit((x, y), epochs=1, global_batch_size=32, shuffle=False, verbose=0)
        episodes.extend(trainer.stragglers.episodes)
        figures.append({k: v[-1] for k, v in history.history.items() if k.startswith("timing/")})
    return {"episodes": episodes, "lines": lines, "figures": figures}


@pytest.mark.processes
def test_a_rank_50_ms_slower_per_forward_is_named_within_20_steps():
    chief, other = run_ranks(_fit, 2, args=(1, 1, 20), timeout=180)
    assert [(rank, what) for rank, what, _, _ in chief["episodes"]] == [(1, "forward and backward")]
    assert chief["lines"][0].startswith("spread: rank 1 is a straggler: forward and backward")
    assert chief["episodes"] == other["episodes"]  # every rank knows; the chief prints
    assert chief["figures"][0]["timing/slowest_rank"] == 1.0
    assert chief["figures"][0]["timing/slowest_compute_ms"] > 40


@pytest.mark.processes
def test_balanced_runs_name_nobody_in_20_fits():
    chief, _ = run_ranks(_fit, 2, args=(-1, 20, 30), timeout=300)
    assert chief["episodes"] == [], chief["lines"]
