"""Whether other processes were using the cores while ``spread plan`` measured the model.

The planner times the user's model on this machine; cores that other processes keep busy make every
measured time, and so every prediction, slower (about 3x on a 2-core machine with both cores taken),
and nothing in the numbers shows it. So the load is sampled before and after measuring, and a busy
machine is named in the report.
"""

from __future__ import annotations

import os

import psutil

# Other processes' busy cores (a fraction of all) above which the measurement is called into question.
BUSY_SHARE = 0.15
BUSY_CORES = 0.3


def busy_cores_elsewhere(seconds: float = 0.5) -> float:
    """Cores kept busy by other processes over ``seconds`` (this process sleeps meanwhile)."""
    own = psutil.Process()
    before = own.cpu_times()
    busy_percent = psutil.cpu_percent(interval=seconds)  # all cores, 0-100
    after = own.cpu_times()
    cores = os.cpu_count() or 1
    own_cores = ((after.user - before.user) + (after.system - before.system)) / seconds
    return max(0.0, busy_percent / 100.0 * cores - own_cores)


def load_warning(busy_elsewhere: float, cores: int) -> str | None:
    """A sentence for the report when other processes' load makes the measured times too slow."""
    if busy_elsewhere < max(BUSY_CORES, BUSY_SHARE * cores):
        return None
    return (
        f"other processes kept {busy_elsewhere:.1f} of {cores} cores busy while the model was measured: "
        f"the predicted step times are too slow by up to {cores / max(cores - busy_elsewhere, 0.5):.1f}x "
        f"(and the recommendation may change); rerun `spread plan` on a quiet machine"
    )
