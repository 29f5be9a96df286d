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

Sends are non-blocking in the runtime (``isend``), receives block; with that rule both schedules are
deadlock-free (checked by :func:`simulate` in the tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

SCHEDULES = ("gpipe", "1f1b")


class Op(StrEnum):
    RECV_ACT = "recv_act"  # receive micro-batch i's input activation from stage s-1
    FORWARD = "forward"
    SEND_ACT = "send_act"  # send micro-batch i's output activation to stage s+1
    RECV_GRAD = "recv_grad"  # receive the gradient of micro-batch i's output from stage s+1
    BACKWARD = "backward"
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


def make_schedule(name: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    if name == "gpipe":
        return gpipe(stage, stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, microbatches)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")


def peak_live_microbatches(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once (forward done, backward not)."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
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
    instantly, sends never block, receives wait for the matching send. Raises ScheduleDeadlock."""
    stages = len(schedules)
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
                    cost = forward_time if a.op is Op.FORWARD else backward_time
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
