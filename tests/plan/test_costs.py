"""Each cost term against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from spread.pipeline import make_schedule, simulate
from spread.plan.costs import (
    Link,
    allreduce_time,
    bucket_sizes,
    data_parallel_memory,
    exposed_communication,
    hierarchical_allreduce_time,
    parameter_server_rate,
    pipeline_bubble,
    pipeline_memory,
    pipeline_slots,
    pipeline_step_time,
    prefetched_exposure,
)

LINK = Link(alpha=1e-3, beta=1e9)  # 1 ms per message, 1 GB/s


def test_link_time_is_alpha_plus_bytes_over_beta():
    assert LINK.time(2e9) == pytest.approx(1e-3 + 2.0)
    assert LINK.time(0) == 0.0


@pytest.mark.parametrize("alpha, beta", [(-1.0, 1e9), (0.0, 0.0), (0.0, math.inf), (math.nan, 1.0)])
def test_link_rejects_impossible_figures(alpha, beta):
    with pytest.raises(ValueError, match=r"alpha|beta"):
        Link(alpha=alpha, beta=beta)


def test_ring_allreduce_moves_2_n_minus_1_over_n_of_the_buffer():
    # 4 ranks, 1 GB: 6 latency terms and 2*3/4 = 1.5 GB on the critical path.
    assert allreduce_time("ring", 1e9, 4, LINK) == pytest.approx(6e-3 + 1.5)
    assert allreduce_time("native", 1e9, 4, LINK) == allreduce_time("ring", 1e9, 4, LINK)


def test_reduce_to_one_serialises_at_the_root():
    # 4 ranks: the root receives 3 buffers and sends 3: 6 messages of 1 GB.
    assert allreduce_time("reduce_to_one", 1e9, 4, LINK) == pytest.approx(6e-3 + 6.0)


def test_shm_costs_two_barriers_and_three_copies_plus_a_slice():
    assert allreduce_time("shm", 1e9, 2, LINK) == pytest.approx(2e-3 + 3.5)


def test_one_rank_or_empty_buffer_costs_nothing():
    assert allreduce_time("ring", 1e9, 1, LINK) == 0.0
    assert allreduce_time("ring", 0, 8, LINK) == 0.0


def test_unknown_algorithm_is_an_error():
    with pytest.raises(ValueError, match="no flat cost formula"):
        allreduce_time("carrier_pigeon", 1e6, 2, LINK)


def test_hierarchical_is_shm_inside_nodes_plus_ring_over_leaders():
    intra, inter = Link(0.0, 1e10), Link(1e-3, 1e9)
    # 2 nodes x 4 ranks, 1 GB: shm (3 + 1/4) * 0.1 s = 0.325 s; ring over 2 leaders 2 ms + 1 s.
    assert hierarchical_allreduce_time(1e9, 2, 4, intra, inter) == pytest.approx(0.325 + 1.002)


def test_buckets_are_full_then_remainder():
    assert bucket_sizes(60, 25) == [25, 25, 10]
    assert bucket_sizes(50, 25) == [25, 25]
    assert bucket_sizes(0, 25) == []


def test_exposed_communication_by_hand():
    # backward 1 s, two buckets of 0.4 s, ready at 0.5 s and 1.0 s.
    # Full overlap: bucket 1 runs 0.5-0.9; bucket 2 starts at 1.0, ends 1.4: 0.4 s exposed.
    assert exposed_communication(1.0, [0.4, 0.4], overlap=1.0) == pytest.approx(0.4)
    # No overlap: nothing progresses before 1.0 s: 0.8 s exposed.
    assert exposed_communication(1.0, [0.4, 0.4], overlap=0.0) == pytest.approx(0.8)
    # Half speed: bucket 1 needs 0.8 s of window, gets 0.5 s (0.25 s of work); 0.15 s left after
    # backward, then bucket 2's 0.4 s: 0.55 s exposed.
    assert exposed_communication(1.0, [0.4, 0.4], overlap=0.5) == pytest.approx(0.55)
    assert exposed_communication(1.0, [], overlap=0.5) == 0.0


def test_pipeline_bubble_is_gpipes_bound():
    assert pipeline_bubble(4, 4) == pytest.approx(3 / 7)
    assert pipeline_bubble(1, 8) == 0.0
    with pytest.raises(ValueError, match="microbatches"):
        pipeline_bubble(2, 0)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 8, 16])
def test_pipeline_slots_replay_the_runtimes_schedules(stages, microbatches):
    """The closed forms equal the makespan of the schedules the runtime executes (forward 1,
    backward 2, so a slot is 3 units)."""
    for schedule in ("gpipe", "1f1b", "zb"):
        sim = simulate([make_schedule(schedule, s, stages, microbatches) for s in range(stages)], 1.0, 2.0)
        assert pipeline_slots(stages, microbatches, schedule) == pytest.approx(sim.makespan / 3), schedule
    assert pipeline_bubble(stages, microbatches, "zb") <= pipeline_bubble(stages, microbatches, "1f1b")


def test_pipeline_step_time_by_hand():
    # 2 stages, 4 micro-batches of 10 ms per stage, free link: (4 + 1) slots of 10 ms.
    free = Link(0.0, 1e18)
    assert pipeline_step_time(0.01, 2, 4, 0.0, free) == pytest.approx(0.05)
    # Sends slower than compute: a 1 MB boundary at 1e8 B/s = 10 ms each way -> slot 20 ms,
    # 5 slots + 2 hops of 10 ms.
    slow = Link(0.0, 1e8)
    assert pipeline_step_time(0.01, 2, 4, 1e6, slow) == pytest.approx(5 * 0.02 + 0.02)


def test_parameter_server_rate_by_hand():
    link = Link(0.0, 1e9)
    # 2 workers, 1 server, 100 MB each way, 0.1 s compute: worker step 0.1 + 0.2 transfer + 0.025
    # apply of its own push (the answer waits for it) = 0.325 s; server busy 0.2 s transfer + 0.025 s
    # apply per step -> 512 / 0.225 = 2275.6 samples/s cap; workers alone would do 2 * 512 / 0.325 =
    # 3151 -> the server caps it.
    step, rate = parameter_server_rate(
        worker_compute_s=0.1,
        batch_per_worker=512,
        workers=2,
        servers=1,
        bytes_per_step=1e8,
        link=link,
        server_apply_bytes_per_s=4e9,
    )
    assert step == pytest.approx(0.325)
    assert rate == pytest.approx(512 / 0.225)
    # Two servers halve their load (0.1125 s each, 4551 samples/s): the workers become the limit,
    # each step 0.1 + 0.2 + 0.0125 s.
    _, rate2 = parameter_server_rate(
        worker_compute_s=0.1,
        batch_per_worker=512,
        workers=2,
        servers=2,
        bytes_per_step=1e8,
        link=link,
        server_apply_bytes_per_s=4e9,
    )
    assert rate2 == pytest.approx(2 * 512 / 0.3125)


def test_memory_terms():
    m = data_parallel_memory(100.0, 200.0, 3.0, 10)
    assert (m.parameters, m.gradients, m.optimizer, m.activations, m.buffers) == (100, 100, 200, 30, 100)
    assert m.total == 530
    gpipe = pipeline_memory(50.0, 100.0, 4.0, 32, stages=2, microbatches=8, schedule="gpipe")
    one_f_one_b = pipeline_memory(50.0, 100.0, 4.0, 32, stages=2, microbatches=8, schedule="1f1b")
    zero_bubble = pipeline_memory(50.0, 100.0, 4.0, 32, stages=2, microbatches=8, schedule="zb")
    assert gpipe.activations == 4.0 * 32  # all 8 micro-batches of 4 samples alive
    assert one_f_one_b.activations == 4.0 * 4 * 2  # at most S = 2 in flight
    assert zero_bubble.activations == 4.0 * 4 * 3  # at most S + 1
    with pytest.raises(ValueError, match="schedule"):
        pipeline_memory(1, 1, 1, 1, 1, 1, "zigzag")


def test_bucket_ready_fractions_follow_the_arrival_curve():
    from spread.plan.costs import bucket_ready_fractions

    # Even pace: 3 equal buckets ready at 1/3, 2/3, 1.
    assert bucket_ready_fractions([1, 1, 1]) == pytest.approx([1 / 3, 2 / 3, 1.0])
    # 90% of the bytes (a big last layer) arrive in the first 10% of backward, the rest evenly:
    # the first bucket (half the bytes) is ready at 10% * 0.5 / 0.9; the second at the end.
    assert bucket_ready_fractions([1, 1], ((0.1, 0.9),)) == pytest.approx([0.1 * 0.5 / 0.9, 1.0])
    # Early buckets hide behind the rest of backward: 0.4 s of work ready at 0.0556 s of a 1 s
    # backward is fully hidden; the last bucket (ready at 1.0) is exposed.
    ready = bucket_ready_fractions([1, 1], ((0.1, 0.9),))
    assert exposed_communication(1.0, [0.4, 0.4], 1.0, ready) == pytest.approx(0.4)
    assert exposed_communication(1.0, [0.4, 0.1], 1.0, ready) == pytest.approx(0.1)


def test_a_prefetched_transfer_hides_only_behind_the_compute_just_before_it():
    # the first is waited for whole; the second hides 4 of its 5 behind a 4 s window; the third fully
    assert prefetched_exposure([2.0, 5.0, 1.0], [4.0, 3.0]) == pytest.approx(2.0 + 1.0)
    # compute that does not overlap hides nothing; half-speed overlap hides half the window
    assert prefetched_exposure([2.0, 5.0, 1.0], [4.0, 3.0], overlap=0.0) == pytest.approx(8.0)
    assert prefetched_exposure([2.0, 5.0, 1.0], [4.0, 3.0], overlap=0.5) == pytest.approx(2.0 + 3.0)
    assert prefetched_exposure([], []) == 0.0 and prefetched_exposure([3.0], []) == 3.0


def test_prefetched_exposure_refuses_missing_windows_and_a_bad_overlap():
    with pytest.raises(ValueError, match="3 transfers need 2 windows"):
        prefetched_exposure([1.0, 1.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="overlap"):
        prefetched_exposure([1.0], [], overlap=1.5)
