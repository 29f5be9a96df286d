"""Pipeline parallelism pieces below the strategy: partitioning, schedules, transfers, the stage runner.

* :mod:`~spread.pipeline.partition`: split an ``nn.Sequential`` into balanced contiguous stages;
* :mod:`~spread.pipeline.graph_split`: split any module before named submodules (``torch.export``);
* :mod:`~spread.pipeline.ownership`: tied parameters' gradients summed over their stages, and
  ``state_dict()`` refused while a rank's copy of other stages' layers is out of date;
* :mod:`~spread.pipeline.schedules`: GPipe and 1F1B as per-stage action lists, and a replay
  simulator (deadlocks, bubble);
* :mod:`~spread.pipeline.p2p`: activations and gradients between neighbouring stages;
* :mod:`~spread.pipeline.runtime`: execute one stage's actions with autograd across stages;
* :mod:`~spread.pipeline.health`: name the stage that died when a transfer fails.

:class:`spread.PipelineStrategy` composes them.
"""

from spread.pipeline.health import Heartbeat
from spread.pipeline.p2p import StageLink
from spread.pipeline.partition import BALANCE_BY, as_layers, balanced_bounds, measured_costs, partition
from spread.pipeline.runtime import StageRunner, StepTimes
from spread.pipeline.schedules import (
    SCHEDULES,
    Action,
    Op,
    gpipe,
    gpipe_bubble_bound,
    make_schedule,
    one_f_one_b,
    simulate,
)

__all__ = [
    "BALANCE_BY",
    "SCHEDULES",
    "Action",
    "Heartbeat",
    "Op",
    "StageLink",
    "StageRunner",
    "StepTimes",
    "as_layers",
    "balanced_bounds",
    "gpipe",
    "gpipe_bubble_bound",
    "make_schedule",
    "measured_costs",
    "one_f_one_b",
    "partition",
    "simulate",
]
