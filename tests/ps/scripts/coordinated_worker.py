"""A ClusterCoordinator worker task: it hands `step` to schedule() and serves the chief's tasks.

`step` writes a marker file named by its argument into SPREAD_TEST_MARKERS, so a test sees what ran.
"""

import os
from pathlib import Path

import spread


def step(name):
    Path(os.environ["SPREAD_TEST_MARKERS"], name).write_text("ran")
    return name


strategy = spread.ParameterServerStrategy(init_timeout=30)
coordinator = spread.ClusterCoordinator(strategy)
coordinator.schedule(step, args=("scheduled by the worker's own script",))
