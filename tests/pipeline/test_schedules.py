"""GPipe, 1F1B and zero bubble as action lists: complete, ordered, deadlock-free, with the expected
bubble and memory."""

from __future__ import annotations

import pytest

from spread.pipeline import Action, Op, gpipe, gpipe_bubble_bound, make_schedule, one_f_one_b, simulate
from spread.pipeline.schedules import ScheduleDeadlock, peak_live_microbatches, zero_bubble

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


@pytest.mark.parametrize(("stages", "microbatches"), CASES)
def test_zero_bubble_runs_each_part_once_in_order(stages, microbatches):
    for stage in range(stages):
        actions = zero_bubble(stage, stages, microbatches)
        split = stages > 1 and stage > 0  # the first stage (or a lone one) runs whole backwards
        parts = [Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT] if split else [Op.FORWARD, Op.BACKWARD]
        for op in {*Op} - {Op.RECV_ACT, Op.SEND_ACT, Op.RECV_GRAD, Op.SEND_GRAD}:
            expected = list(range(microbatches)) if op in parts else []
            assert sorted(a.microbatch for a in actions if a.op is op) == expected, (stage, op)
        for i in range(microbatches):
            order = [a.op for a in actions if a.microbatch == i and a.op in parts]
            assert order == parts, (stage, i, order)
            if split:  # the input gradient goes back as soon as it is computed
                ops = [a.op for a in actions if a.microbatch == i]
                assert ops[ops.index(Op.BACKWARD_INPUT) + 1] is Op.SEND_GRAD
        # At most one micro-batch more alive than 1F1B (still never more than GPipe's M).
        assert peak_live_microbatches(actions) <= min(stages - stage + 1, microbatches)


@pytest.mark.parametrize(("stages", "microbatches"), [c for c in CASES if c[0] > 1])
def test_zero_bubble_is_faster_than_1f1b_and_never_deadlocks(stages, microbatches):
    # Equal costs: forward 1, backward 2 (input part 1, weight part 1).
    zb = simulate([zero_bubble(s, stages, microbatches) for s in range(stages)], 1.0, 2.0)
    one = simulate([one_f_one_b(s, stages, microbatches) for s in range(stages)], 1.0, 2.0)
    assert one.makespan == 3 * (microbatches + stages - 1)
    assert zb.makespan < one.makespan
    # 1F1B idles 3(S-1) units per stage; what zero bubble leaves is the last stage's wait for the
    # first forward (S-1) plus at most one input gradient per hop on the way back.
    assert zb.makespan <= 3 * microbatches + 2 * (stages - 1)


def test_zero_bubble_two_stages_order():
    ops = [
        (a.op.value, a.microbatch) for a in zero_bubble(1, 2, 3) if a.op not in (Op.RECV_ACT, Op.SEND_GRAD)
    ]
    assert ops == [
        ("forward", 0),
        ("backward_input", 0),
        ("forward", 1),
        ("backward_input", 1),
        ("backward_weight", 0),
        ("forward", 2),
        ("backward_input", 2),
        ("backward_weight", 1),
        ("backward_weight", 2),
    ]


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
