"""Pipeline schedules as explicit per-stage action lists: what each stage does, in order.

A schedule is data, not code: ``gpipe(stage, stages, microbatches)`` returns the list of
:class:`Action` s one stage performs for one mini-batch (receive an activation, run a forward, send it
on, ..., run a backward, send the input gradient back). The runtime executes the list; tests check
the lists without processes, and :func:`simulate` replays all stages together to find deadlocks and
to compute the idle time ("bubble") a schedule implies.

* **GPipe**: every forward, then every backward. Stage ``s`` holds the activations of all ``M``
  micro-batches at once. Idle fraction with equal stage times: ``(S-1)/(M+S-1)``.
* **1F1B** (PipeDream-flush): after ``S-s-1`` warm-up forwards, stage ``s`` alternates one forward
  and one backward, so it holds at most ``S-s`` micro-batches' activations; same bubble, same math.
* **Zero bubble** (``"zb"``, after Qi et al. 2023, ZB-H1): each backward is split into the input
  gradient (``backward_input``, which the previous stage waits for) and the weight gradients
  (``backward_weight``, which nobody waits for, see :mod:`spread.pipeline.split_backward`); the
  weight parts are moved into the time a stage would otherwise wait. The first stage sends no
  gradient back, so its whole backward is such deferrable work. Same math, one update per mini-batch.

Sends are non-blocking in the runtime (``isend``), receives block; with that rule both schedules are
deadlock-free (checked by :func:`simulate` in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

SCHEDULES = ("gpipe", "1f1b", "zb")


class Op(StrEnum):
    RECV_ACT = "recv_act"  # receive micro-batch i's input activation from stage s-1
    FORWARD = "forward"
    SEND_ACT = "send_act"  # send micro-batch i's output activation to stage s+1
    RECV_GRAD = "recv_grad"  # receive the gradient of micro-batch i's output from stage s+1
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"  # zero bubble: only the gradient of the stage's input
    BACKWARD_WEIGHT = "backward_weight"  # zero bubble: the weight gradients, later
    SEND_GRAD = "send_grad"  # send the gradient of micro-batch i's input to stage s-1


@dataclass(frozen=True, slots=True)
class Action:
    op: Op
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.op.value}({self.microbatch})"


def check_schedule_args(stage: int, stages: int, microbatches: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer (M >= 1), got {microbatches!r}")
    if not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage!r}")


def _forward(stage: int, stages: int, i: int) -> list[Action]:
    out = [] if stage == 0 else [Action(Op.RECV_ACT, i)]
    out.append(Action(Op.FORWARD, i))
    if stage < stages - 1:
        out.append(Action(Op.SEND_ACT, i))
    return out


def _backward(stage: int, stages: int, i: int) -> list[Action]:
    out = [] if stage == stages - 1 else [Action(Op.RECV_GRAD, i)]
    out.append(Action(Op.BACKWARD, i))
    if stage > 0:
        out.append(Action(Op.SEND_GRAD, i))
    return out


def gpipe(stage: int, stages: int, microbatches: int) -> list[Action]:
    """All forwards in micro-batch order, then all backwards in the same order."""
    check_schedule_args(stage, stages, microbatches)
    actions: list[Action] = []
    for i in range(microbatches):
        actions += _forward(stage, stages, i)
    for i in range(microbatches):
        actions += _backward(stage, stages, i)
    return actions


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Action]:
    """Warm-up forwards, then one forward / one backward in turn, then the remaining backwards."""
    check_schedule_args(stage, stages, microbatches)
    warmup = min(stages - stage - 1, microbatches)
    actions: list[Action] = []
    fwd = bwd = 0
    for _ in range(warmup):
        actions += _forward(stage, stages, fwd)
        fwd += 1
    while fwd < microbatches:
        actions += _forward(stage, stages, fwd)
        fwd += 1
        actions += _backward(stage, stages, bwd)
        bwd += 1
    while bwd < microbatches:
        actions += _backward(stage, stages, bwd)
        bwd += 1
    return actions


def zero_bubble(stage: int, stages: int, microbatches: int) -> list[Action]:
    """ZB-H1-style: 1F1B whose weight gradients are computed when the stage would otherwise wait.

    The order comes from list-scheduling all stages together with equal costs (forward = input
    gradient = weight gradient = 1; the first stage's whole backward = 2): whenever a stage is free
    it runs, by priority, an input gradient (someone upstream waits for it), else a forward (someone
    downstream does), else a deferred weight gradient. A stage holds at most ``S - s + 1``
    micro-batches whose weight gradients are not done (one more than 1F1B's ``S - s``, still at most
    GPipe's ``M``); at the limit it must finish a weight gradient before the next forward.
    """
    check_schedule_args(stage, stages, microbatches)
    if stages == 1:
        return one_f_one_b(stage, stages, microbatches)
    return list(_list_schedule(stages, microbatches)[stage])


@lru_cache(maxsize=64)
def _list_schedule(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every stage's order at once (cached: the strategy asks for its stage's list every step)."""
    S, M = stages, microbatches
    limit = [min(M, S - s + 1) for s in range(S)]
    free = [0.0] * S
    act_at: dict[tuple[int, int], float] = {(0, i): 0.0 for i in range(M)}  # (stage, mb) -> input ready
    grad_at: dict[tuple[int, int], float] = {}  # (stage, mb) -> output gradient ready
    fwd, bwd = [0] * S, [0] * S  # next forward / input-gradient micro-batch per stage
    pending: list[list[int]] = [[] for _ in range(S)]  # input gradient done, weight gradient not
    order: list[list[Action]] = [[] for _ in range(S)]

    def options(s: int) -> list[tuple[float, int, str]]:
        """(ready time, priority, kind) of what stage s could run next."""
        out = []
        live = fwd[s] - (bwd[s] - len(pending[s]))  # forwards whose weight gradient is not done
        if bwd[s] < fwd[s] and (s, bwd[s]) in grad_at:
            out.append((grad_at[(s, bwd[s])], 0 if s > 0 else 2, "B"))
        if fwd[s] < M and live < limit[s] and (s, fwd[s]) in act_at:
            out.append((act_at[(s, fwd[s])], 1, "F"))
        if pending[s]:
            out.append((0.0, 2, "W"))
        return out

    while any(bwd[s] < M or pending[s] for s in range(S)):
        best = None
        for s in range(S):
            opts = options(s)
            if not opts:
                continue
            ready_now = [o for o in opts if o[0] <= free[s]]
            pick = min(ready_now, key=lambda o: o[1]) if ready_now else min(opts)
            start = max(free[s], pick[0])
            if best is None or (start, s) < (best[0], best[1]):
                best = (start, s, pick[2])
        assert best is not None, "zero-bubble list scheduling got stuck"
        start, s, kind = best
        if kind == "F":
            i = fwd[s]
            fwd[s] += 1
            free[s] = start + 1
            order[s] += _forward(s, S, i)
            if s < S - 1:
                act_at[(s + 1, i)] = free[s]
            else:
                grad_at[(s, i)] = free[s]
        elif kind == "B" and s == 0:  # the first stage: its whole backward, deferrable
            i = bwd[s]
            bwd[s] += 1
            free[s] = start + 2
            order[s] += [Action(Op.RECV_GRAD, i), Action(Op.BACKWARD, i)]
        elif kind == "B":
            i = bwd[s]
            bwd[s] += 1
            pending[s].append(i)
            free[s] = start + 1
            order[s] += [
                *([] if s == S - 1 else [Action(Op.RECV_GRAD, i)]),
                Action(Op.BACKWARD_INPUT, i),
                Action(Op.SEND_GRAD, i),
            ]
            grad_at[(s - 1, i)] = free[s]
        else:
            i = pending[s].pop(0)
            free[s] = start + 1
            order[s].append(Action(Op.BACKWARD_WEIGHT, i))
    return tuple(tuple(stage_order) for stage_order in order)


def make_schedule(name: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    if name == "gpipe":
        return gpipe(stage, stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, microbatches)
    if name == "zb":
        return zero_bubble(stage, stages, microbatches)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")


def peak_live_microbatches(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD or a.op is Op.BACKWARD_WEIGHT:
            live -= 1
    return peak


@dataclass(frozen=True, slots=True)
class Simulation:
    """What :func:`simulate` found: when each stage finished and how long it sat idle."""

    makespan: float
    busy: tuple[float, ...]
    finish: tuple[float, ...]

    def idle_fraction(self, stage: int) -> float:
        return 1.0 - self.busy[stage] / self.makespan if self.makespan > 0 else 0.0


class ScheduleDeadlock(RuntimeError):
    """Replaying the schedules got stuck: every unfinished stage waits for a message never sent."""


def simulate(
    schedules: list[list[Action]], forward_time: float = 1.0, backward_time: float = 1.0
) -> Simulation:
    """Replay every stage's actions with ideal timing: compute takes the given time, messages arrive
    instantly, sends never block, receives wait for the matching send. Raises ScheduleDeadlock.

    A split backward costs half of ``backward_time`` for each part (input, weight)."""
    stages = len(schedules)
    costs = {
        Op.FORWARD: forward_time,
        Op.BACKWARD: backward_time,
        Op.BACKWARD_INPUT: backward_time / 2,
        Op.BACKWARD_WEIGHT: backward_time / 2,
    }
    clock = [0.0] * stages
    busy = [0.0] * stages
    pos = [0] * stages
    sent: dict[tuple[str, int, int], float] = {}  # (kind, receiving stage, micro-batch) -> time sent
    while any(pos[s] < len(schedules[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pos[s] < len(schedules[s]):
                a = schedules[s][pos[s]]
                if a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD:
                    key = ("act" if a.op is Op.RECV_ACT else "grad", s, a.microbatch)
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent.pop(key))
                elif a.op is Op.SEND_ACT:
                    sent[("act", s + 1, a.microbatch)] = clock[s]
                elif a.op is Op.SEND_GRAD:
                    sent[("grad", s - 1, a.microbatch)] = clock[s]
                else:
                    cost = costs[a.op]
                    clock[s] += cost
                    busy[s] += cost
                pos[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: schedules[s][pos[s]] for s in range(stages) if pos[s] < len(schedules[s])}
            raise ScheduleDeadlock(f"stages stuck waiting: {waiting}")
    return Simulation(makespan=max(clock), busy=tuple(busy), finish=tuple(clock))


def gpipe_bubble_bound(stages: int, microbatches: int) -> float:
    """The idle fraction of GPipe (and 1F1B) with equal stage times: ``(S-1)/(M+S-1)``."""
    return (stages - 1) / (microbatches + stages - 1)
