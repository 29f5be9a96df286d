"""GPipe and 1F1B as action lists: complete, ordered, deadlock-free, with the expected bubble and memory."""

from __future__ import annotations

import pytest

from spread.pipeline import Action, Op, gpipe, gpipe_bubble_bound, make_schedule, one_f_one_b, simulate
from spread.pipeline.schedules import ScheduleDeadlock, peak_live_microbatches

CASES = [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 3, 4, 8)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), CASES)
def test_every_microbatch_goes_forward_then_backward_once(name, stages, microbatches):
    for stage in range(stages):
        actions = make_schedule(name, stage, stages, microbatches)
        for op in (Op.FORWARD, Op.BACKWARD):
            assert sorted(a.microbatch for a in actions if a.op is op) == list(range(microbatches))
        for i in range(microbatches):
            order = [a.op for a in actions if a.microbatch == i]
            expected = [Op.FORWARD, Op.BACKWARD]
            if stage > 0:
                expected = [Op.RECV_ACT, Op.FORWARD, Op.BACKWARD, Op.SEND_GRAD]
            if stage < stages - 1:
                expected.insert(expected.index(Op.FORWARD) + 1, Op.SEND_ACT)
                expected.insert(expected.index(Op.BACKWARD), Op.RECV_GRAD)
            assert order == expected, (stage, i, order)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), CASES)
def test_schedules_never_deadlock_and_meet_the_gpipe_bubble(name, stages, microbatches):
    sim = simulate([make_schedule(name, s, stages, microbatches) for s in range(stages)])
    bound = gpipe_bubble_bound(stages, microbatches)
    for s in range(stages):
        # Equal forward and backward times: the makespan is 2(M+S-1), every stage busy 2M.
        assert sim.idle_fraction(s) == pytest.approx(bound)


def test_gpipe_order_two_stages():
    assert gpipe(0, 2, 2) == [
        Action(Op.FORWARD, 0),
        Action(Op.SEND_ACT, 0),
        Action(Op.FORWARD, 1),
        Action(Op.SEND_ACT, 1),
        Action(Op.RECV_GRAD, 0),
        Action(Op.BACKWARD, 0),
        Action(Op.RECV_GRAD, 1),
        Action(Op.BACKWARD, 1),
    ]


def test_1f1b_alternates_after_warmup():
    ops = [(a.op.value, a.microbatch) for a in one_f_one_b(0, 3, 4) if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert ops == [
        ("forward", 0),
        ("forward", 1),
        ("forward", 2),
        ("backward", 0),
        ("forward", 3),
        ("backward", 1),
        ("backward", 2),
        ("backward", 3),
    ]


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (4, 8), (4, 16)])
def test_1f1b_keeps_fewer_activations_alive(stages, microbatches):
    for s in range(stages):
        assert peak_live_microbatches(gpipe(s, stages, microbatches)) == microbatches
        assert peak_live_microbatches(one_f_one_b(s, stages, microbatches)) == min(stages - s, microbatches)


def test_simulate_finds_a_deadlock():
    # Both stages wait to receive before they send: a deadlock the simulator must report.
    bad = [
        [Action(Op.RECV_GRAD, 0), Action(Op.FORWARD, 0), Action(Op.SEND_ACT, 0)],
        [Action(Op.RECV_ACT, 0), Action(Op.FORWARD, 0), Action(Op.SEND_GRAD, 0)],
    ]
    with pytest.raises(ScheduleDeadlock, match="stuck"):
        simulate(bad)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 0, "stages": 2, "microbatches": 0}, "M >= 1"),
        ({"stage": 2, "stages": 2, "microbatches": 1}, "stage must be in"),
        ({"stage": 0, "stages": 0, "microbatches": 1}, "stages must be"),
    ],
)
def test_bad_schedule_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gpipe(**kwargs)


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_schedule("interleaved", 0, 2, 2)
