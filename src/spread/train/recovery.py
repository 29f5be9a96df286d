"""Recovery without restart inside ``Trainer.fit`` (``spread run --recover``, ``SPREAD_RECOVER=1``).

When a peer is lost mid-step (it died, was preempted, or stayed stopped and was killed by
``spread run``), every survivor's next collective fails. Each survivor then finishes what its own
step already did (a survivor whose optimizer stepped before the failure keeps that step), the
strategy regroups the survivors into a smaller group (:meth:`Strategy.regroup`, membership agreed
through the store), and the state of the survivor that applied the most optimizer steps is broadcast
to the others: model, optimizer, and the loop's position (epoch, batch, running sums, schedule). The
step that was in flight is repeated at the new world size with the same global batch, so the
weights stay those of the uninterrupted run. Nothing is reloaded from disk, no process restarts.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from spread import env
from spread.errors import CollectiveError, PeerFailedError

if TYPE_CHECKING:  # pragma: no cover
    from spread.train.trainer import Trainer

# What a lost peer looks like from a survivor: a collective that failed (connection closed, or no
# answer before the deadline) or a peer that reported its own failure.
PEER_FAILURES = (CollectiveError, PeerFailedError)

# Added to the chief's stop vote (summed with each step's statistics) when machines wait to join:
# every rank then reads both votes from the one sum (stop votes count ranks, far below this).
JOIN_VOTE = float(2**20)


def recovery_requested() -> bool:
    """Whether the launcher asked the ranks to recover from a lost peer (``SPREAD_RECOVER=1``)."""
    return os.environ.get(env.RECOVER, "") == "1"


def recover(
    trainer: Trainer, loop_states: Mapping[int, dict[str, Any]], cause: BaseException | None
) -> dict[str, Any]:
    """Regroup the survivors (and any process waiting to join: ``cause`` is None when that is why)
    and return the position (and loop state) every one of them continues from: that of the survivor
    furthest ahead, whose model and optimizer state all ranks now hold (``loop_states``: this rank's
    loop state by optimizer steps applied, see :func:`share_state`)."""
    strategy = trainer.strategy
    old_rank, old_world = strategy.rank, strategy.num_replicas_in_sync
    started = time.perf_counter()
    strategy.regroup()
    grouped = time.perf_counter()
    agreed = share_state(trainer, loop_states)
    if strategy.is_chief:
        why = (
            "admitting the machine(s) that wait to join"
            if cause is None
            else (f"{type(cause).__name__}: {_first_line(cause)}")
        )
        print(
            f"spread: rank {old_rank} of {old_world}: {why}; regrouped at world size "
            f"{strategy.num_replicas_in_sync} without restart in {time.perf_counter() - started:.2f}s "
            f"(new group {grouped - started:.2f}s, state {time.perf_counter() - grouped:.2f}s); "
            f"continuing at epoch {agreed['epoch'] + 1}, batch {agreed['batch']} (after "
            f"{agreed['global_step']} optimizer steps)",
            file=sys.stderr,
            flush=True,
        )
    return agreed


def share_state(trainer: Trainer, loop_states: Mapping[int, dict[str, Any]]) -> dict[str, Any]:
    """Collective over the (new) group: every rank takes the model, optimizer state and loop state of
    the rank that applied the most optimizer steps (a process that joined a running job has applied
    none, so it takes a survivor's: streamed from a live peer, never read from disk). ``loop_states``
    holds this rank's loop state (position, sums, schedule) by optimizer steps applied, its latest
    and the one before: the strategy may rebuild the model one step back (ShardedStrategy, when the
    loss came before every rank had the copy of the last step), and the loop goes back with it."""
    strategy = trainer.strategy
    progress = torch.tensor([list(strategy.recovery_progress)], dtype=torch.int64, device=strategy.device)
    rows = [tuple(row) for row in strategy.gather_from_every_rank(progress).cpu().tolist()]
    src = max(range(len(rows)), key=lambda r: (rows[r], -r))  # furthest ahead; the first on ties
    strategy.broadcast_training_state(src, trainer.optimizer)
    state = None
    if strategy.rank == src:
        applied = strategy.recovery_progress[0]
        assert applied in loop_states, f"the loop keeps its state after {sorted(loop_states)} steps only"
        state = loop_states[applied]
    return strategy.broadcast_object(state, src)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
