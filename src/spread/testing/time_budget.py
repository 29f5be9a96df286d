"""Time budgets for tests that scale with how busy the machine is.

A test's hard timeout guards against a hang, not a slow machine: on 2 cores shared with other jobs
(a load average of 11-17) the same multi-process test takes several times as long, and a fixed
budget turns that into a failure. Budgets here are the idle machine's figure times
``SPREAD_TEST_TIME_SCALE``, which the test session sets once from the load it finds at start
(``tests/conftest.py``; a value set by hand wins) and which child processes inherit.
"""

from __future__ import annotations

import os

SCALE_ENV = "SPREAD_TEST_TIME_SCALE"
MAX_SCALE = 20.0  # a budget that must stretch further than this is a hang, not a busy machine


def time_scale() -> float:
    """The factor test budgets are stretched by (``SPREAD_TEST_TIME_SCALE``; 1 when unset)."""
    raw = os.environ.get(SCALE_ENV)
    if raw is None or raw == "":
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV} must be a number >= 1, got {raw!r}") from None
    if not 1.0 <= scale <= MAX_SCALE:
        raise ValueError(f"{SCALE_ENV} must be a number in [1, {MAX_SCALE:g}], got {raw!r}")
    return scale


def budget(seconds: float) -> float:
    """``seconds`` on an idle machine, stretched by :func:`time_scale`."""
    return seconds * time_scale()


def busy_machine_scale(load: float | None = None, cores: int | None = None) -> float:
    """How much slower than idle this machine runs now: runnable processes per core (the 1-minute
    load average over the cores), at least 1, at most ``MAX_SCALE``."""
    load = os.getloadavg()[0] if load is None else load
    cores = (os.cpu_count() or 1) if cores is None else cores
    return min(MAX_SCALE, max(1.0, load / max(1, cores)))
