"""Naming the rank that lags: each rank times its steps' phases, the ranks compare every few steps.

In a synchronous job every rank's step takes as long as the slowest one's, because the others wait
for it in the gradient exchange: wall time per step is the same everywhere and hides the culprit.
What differs is how each rank spends it. So each rank splits its steps into computing (the step's
time less its waits in exchanges, :attr:`~spread.strategies.Strategy.exchange_seconds`), waiting in
exchanges, and waiting for data; every ``window`` steps the ranks gather their per-step means (one
small all-gather), and a rank whose computing or data wait exceeds the median of the others by
``ratio`` and by ``floor_ms`` in ``consecutive`` windows in a row is named once, by the chief, with
the phase. The figures go into the epoch's logs under ``timing/``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from spread.strategies import Strategy

WINDOW = 10  # steps per comparison
RATIO = 1.3  # slower than the others' median by this factor ...
FLOOR_MS = 5.0  # ... and by this much per step
CONSECUTIVE = 2  # in this many windows in a row
_PHASES = {0: "forward and backward", 2: "waiting for data"}  # columns: compute, exchange, data


class StragglerWatch:
    """Times one rank's steps and, with the other ranks, names a consistent straggler (collective
    every ``window`` steps: every rank must report every step)."""

    def __init__(
        self,
        strategy: Strategy,
        report: Callable[[str], None],
        *,
        window: int = WINDOW,
        ratio: float = RATIO,
        floor_ms: float = FLOOR_MS,
        consecutive: int = CONSECUTIVE,
    ) -> None:
        self._strategy, self._report = strategy, report
        self._window, self._ratio, self._consecutive = window, ratio, consecutive
        self._floor = floor_ms / 1000
        self._sums = [0.0, 0.0, 0.0]  # this window's compute, exchange and data seconds
        self._steps = 0
        self._last_exchange = strategy.exchange_seconds or 0.0
        self._streaks: dict[tuple[int, int], int] = {}  # (rank, phase) -> flagged windows in a row
        self._named: set[tuple[int, int]] = set()  # reported and not recovered since
        self.episodes: list[tuple[int, str, float, float]] = []  # (rank, phase, ms/step, others' ms/step)
        self.figures: dict[str, float] = {}  # the last window's, for the logs

    def after_step(self, step_seconds: float, data_seconds: float) -> None:
        exchange_now = self._strategy.exchange_seconds or 0.0
        exchange = max(0.0, exchange_now - self._last_exchange)
        self._last_exchange = exchange_now
        self._sums[0] += max(0.0, step_seconds - exchange)
        self._sums[1] += exchange
        self._sums[2] += data_seconds
        self._steps += 1
        if self._steps == self._window:
            self._compare()

    def epoch_figures(self) -> dict[str, float]:
        """The last window's figures for the epoch's logs; an epoch shorter than a window compares
        what it has (collective then, on every rank alike), naming nobody on so few steps."""
        if not self.figures and self._steps:
            self._compare(naming=False)
        return dict(self.figures)

    def _compare(self, *, naming: bool = True) -> None:
        mine = torch.tensor([[s / self._steps for s in self._sums]], dtype=torch.float64)
        rows = self._strategy.gather_from_every_rank(mine.to(self._strategy.device)).cpu().tolist()
        self._sums, self._steps = [0.0, 0.0, 0.0], 0
        compute = [row[0] for row in rows]
        slowest = max(range(len(rows)), key=lambda r: compute[r])
        self.figures = {
            "timing/compute_ms": 1000 * statistics.median(compute),
            "timing/slowest_compute_ms": 1000 * compute[slowest],
            "timing/slowest_rank": float(slowest),
            "timing/exchange_ms": 1000 * statistics.median(row[1] for row in rows),
            "timing/data_wait_ms": 1000 * max(row[2] for row in rows),
        }
        if len(rows) < 2 or not naming:
            return
        for rank in range(len(rows)):
            for phase, what in _PHASES.items():
                others = statistics.median(row[phase] for r, row in enumerate(rows) if r != rank)
                value = rows[rank][phase]
                slow = value > self._ratio * others and value - others > self._floor
                key = (rank, phase)
                self._streaks[key] = self._streaks.get(key, 0) + 1 if slow else 0
                if not slow:
                    self._named.discard(key)
                elif self._streaks[key] >= self._consecutive and key not in self._named:
                    self._named.add(key)
                    self.episodes.append((rank, what, 1000 * value, 1000 * others))
                    steps = self._consecutive * self._window
                    self._report(
                        f"spread: rank {rank} is a straggler: {what} {1000 * value:.1f} ms/step against "
                        f"{1000 * others:.1f} ms on the other ranks (the last {steps} steps); the others "
                        f"wait for it in every exchange"
                    )

    def summary(self) -> str | None:
        """One line for the end of ``fit`` naming every straggler seen, or None."""
        if not self.episodes:
            return None
        named = "; ".join(
            f"rank {rank} ({what}: {value:.1f} ms/step against {others:.1f} ms)"
            for rank, what, value, others in self.episodes
        )
        return f"spread: stragglers in this fit: {named}"
