"""A window of training steps traced with ``torch.profiler``, one Chrome trace per rank.

``Trainer(profile=...)``, or ``spread run --trace DIR`` for every ``fit`` of a job, records steps
``first_step`` to ``first_step + steps - 1`` (the first steps warm up caches and allocators, so they
are skipped) and writes ``DIR/rank-<r>.json``. spread names its own spans ``spread.*`` (each step,
forward, backward, the gradient exchange, each collective, data waits, pipeline actions per
micro-batch), so the merged timeline (:mod:`spread.train.timeline`) reads without knowing torch's
operators.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from spread import env

TRACE_DIR_ENV = env.TRACE_DIR


@dataclass(frozen=True)
class TraceWindow:
    """Where to write traces, and which steps of a ``fit`` to record."""

    directory: Path
    first_step: int = 2
    steps: int = 3

    def __post_init__(self) -> None:
        if self.first_step < 0 or self.steps < 1:
            raise ValueError(f"a trace window needs first_step >= 0 and steps >= 1, got {self}")

    @classmethod
    def of(cls, profile_arg: str | os.PathLike[str] | TraceWindow | None) -> TraceWindow | None:
        """``Trainer(profile=...)``: a window, a directory (the default window), or None: the
        directory ``spread run --trace`` gives the ranks, if any."""
        if isinstance(profile_arg, TraceWindow):
            return profile_arg
        if profile_arg is not None:
            return cls(Path(profile_arg))
        from_launcher = os.environ.get(TRACE_DIR_ENV)
        return cls(Path(from_launcher)) if from_launcher else None


class StepTracer:
    """Drives ``torch.profiler`` over a fit's steps; the trace is written when the window closes."""

    def __init__(self, window: TraceWindow, rank: int, device: torch.device) -> None:
        self.window, self.rank = window, rank
        self.path = window.directory / f"rank-{rank}.json"
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        warmup = 1 if window.first_step > 0 else 0
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=window.first_step - warmup, warmup=warmup, active=window.steps, repeat=1),
            on_trace_ready=self._write,
        )
        self.written = False
        self._running = False

    def start(self) -> None:
        self.window.directory.mkdir(parents=True, exist_ok=True)
        self._profiler.start()
        self._running = True

    def step(self) -> None:
        self._profiler.step()

    def stop(self) -> None:
        """End the window (idempotent); a window still open is written with the steps it has."""
        if self._running:
            self._running = False
            self._profiler.stop()

    def _write(self, profiler: profile) -> None:
        partial = self.path.with_name(f".{self.path.name}.partial")
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, self.path)  # a reader never sees half a trace
        self.written = True
