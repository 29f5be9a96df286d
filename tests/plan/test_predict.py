"""Predictions and advice from a hand-made profile, checked against hand-computed values."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import spread
from spread.plan.advisor import PlanError, make_plan
from spread.plan.cluster import DEFAULT_INTRA, ClusterModel
from spread.plan.costs import Link, sharded_memory
from spread.plan.predict import Candidate, Options, candidates, predict
from spread.plan.workload import LayerProfile, ModelProfile, measure_model

MB = 1e6


def _profile(**changes) -> ModelProfile:
    layers = tuple(
        LayerProfile(
            name=str(i),
            time_share=0.25,
            param_bytes=2.5 * MB,
            activation_bytes_per_sample=1000.0,
            output_bytes_per_sample=100.0,
        )
        for i in range(4)
    )
    fields = dict(
        name="toy",
        param_bytes=10 * MB,
        sparse_bytes=0.0,
        sparse_row_bytes=0.0,
        sparse_rows_per_sample=0.0,
        optimizer_bytes=20 * MB,
        activation_bytes_per_sample=4000.0,
        compute={1: (0.0, 1e-3), 2: (0.0, 0.6e-3)},  # 1 ms per sample on 1 thread, 0.6 ms on 2
        backward_fraction=0.5,
        optimizer_seconds=0.01,
        batch=64,
        layers=layers,
    )
    fields.update(changes)
    return ModelProfile(**fields)


def _cluster(**changes) -> ClusterModel:
    intra = dict(DEFAULT_INTRA)
    intra["shm"] = Link(0.0, 1e9)
    intra["native"] = Link(0.0, 1e8)
    fields = dict(nodes=1, devices_per_node=2, cores_per_node=2, intra=intra, overlap=1.0)
    fields.update(changes)
    return ClusterModel(**fields)


def test_one_device_uses_every_core():
    p = predict(Candidate("one_device", 1), _profile(), _cluster(), Options(global_batch=100))
    assert p.step_seconds == pytest.approx(100 * 0.6e-3 + 0.01)
    assert p.samples_per_second == pytest.approx(100 / 0.07)


def test_multi_worker_mirrored_shm_by_hand():
    # 2 processes x 1 thread, 50 samples each: compute 50 ms, backward 25 ms. 10 MB of gradients in one
    # bucket: shm (3 + 1/2) * 10 MB / 1 GB/s = 35 ms, ready at 25 ms -> 35 ms exposed. Plus 10 ms update.
    c = Candidate("multi_worker_mirrored", 2, (("communication", "shm"),))
    p = predict(c, _profile(), _cluster(), Options(global_batch=100))
    assert p.parts["communication"] == pytest.approx(0.035)
    assert p.parts["exposed"] == pytest.approx(0.035)
    assert p.step_seconds == pytest.approx(0.05 + 0.035 + 0.01)
    # Efficiency against 2 x one process with 1 thread (100 samples in 110 ms each).
    assert p.scaling_efficiency == pytest.approx((100 / 0.095) / (2 * 100 / 0.11))
    # Memory: parameters, gradients, flat gradient buffer, Adam state, 50 samples of activations.
    assert p.memory.total == pytest.approx(10 * MB * 3 + 20 * MB + 50 * 4000)


def test_replicas_slowing_each_other_scale_compute_but_not_the_baseline():
    # Measured contention 1.5 at 2 replicas: each 50-sample step takes 75 ms instead of 50 ms; the
    # all-reduce (35 ms, ready when backward ends) and the update (10 ms) are unchanged.
    crowded = _profile(contention={2: 1.5})
    c = Candidate("multi_worker_mirrored", 2, (("communication", "shm"),))
    p = predict(c, crowded, _cluster(), Options(global_batch=100))
    assert p.parts["compute"] == pytest.approx(0.075)
    assert p.step_seconds == pytest.approx(0.075 + 0.035 + 0.01)
    # The efficiency baseline is one process alone: no contention in it.
    assert p.scaling_efficiency == pytest.approx((100 / 0.12) / (2 * 100 / 0.11))
    mirrored = predict(Candidate("mirrored", 2), crowded, _cluster(), Options(global_batch=100))
    assert mirrored.step_seconds == pytest.approx(0.075 + 0.01)
    alone = predict(Candidate("one_device", 1), crowded, _cluster(), Options(global_batch=100))
    assert alone.step_seconds == pytest.approx(100 * 0.6e-3 + 0.01)
    # Accelerators (no shared cores) do not contend: the factor is a CPU effect.
    gpus = predict(c, crowded, _cluster(cores_per_node=None), Options(global_batch=100))
    assert gpus.parts["compute"] == pytest.approx(
        predict(c, _profile(), _cluster(cores_per_node=None), Options(global_batch=100)).parts["compute"]
    )


def test_synchronous_processes_wait_for_the_slowest_replica():
    # Each of 2 replicas 1.1x slower than alone, the slower of the two 1.3x: MultiWorkerMirrored's
    # and ShardedStrategy's ranks meet every step, so their compute is 50 ms * 1.3; Mirrored's thread
    # replicas keep the typical factor (their in-process factor is measured against it); a
    # parameter server's workers never wait for each other.
    p = _profile(contention={2: 1.1}, slowest_contention={2: 1.3})
    options = Options(global_batch=100)
    mwm = predict(Candidate("multi_worker_mirrored", 2, (("communication", "shm"),)), p, _cluster(), options)
    assert mwm.parts["compute"] == pytest.approx(0.05 * 1.3)
    sharded = predict(Candidate("sharded", 2, (("shard", "optimizer"),)), p, _cluster(), options)
    assert sharded.parts["compute"] == pytest.approx(0.05 * 1.3)
    mirrored = predict(Candidate("mirrored", 2), p, _cluster(), options)
    assert mirrored.parts["compute"] == pytest.approx(0.05 * 1.1)
    # A profile written before the slowest was measured: the typical factor for all of them.
    older = replace(p, slowest_contention={})
    assert older.slowest_contention_factor(2) == 1.1
    mwm_older = predict(
        Candidate("multi_worker_mirrored", 2, (("communication", "shm"),)), older, _cluster(), options
    )
    assert mwm_older.parts["compute"] == pytest.approx(0.05 * 1.1)


def test_each_process_applies_its_own_update_at_its_share_of_the_cores():
    # Update: 20 ms on 1 thread, 10 ms on 2; two processes updating at once each take 1.5x longer;
    # thread replicas of one process compute 1.4x slower than separate processes would.
    p = _profile(optimizer_by_threads={1: 0.02, 2: 0.01}, optimizer_contention={2: 1.5}, in_process={2: 1.4})
    options = Options(global_batch=100)
    alone = predict(Candidate("one_device", 1), p, _cluster(), options)
    assert alone.step_seconds == pytest.approx(100 * 0.6e-3 + 0.01)  # one process, both cores
    shm = Candidate("multi_worker_mirrored", 2, (("communication", "shm"),))
    mwms = predict(shm, p, _cluster(), options)
    assert mwms.parts["optimizer"] == pytest.approx(1.5 * 0.02)  # 1 thread each, both at once
    assert mwms.parts["compute"] == pytest.approx(0.05)  # separate processes: no in-process factor
    assert mwms.step_seconds == pytest.approx(0.05 + 0.035 + 0.03)
    # The efficiency baseline: one process with its share (1 thread) of the cores, 100 ms + 20 ms.
    assert mwms.scaling_efficiency == pytest.approx((100 / 0.115) / (2 * 100 / 0.12))
    mirrored = predict(Candidate("mirrored", 2), p, _cluster(), options)
    assert mirrored.parts["compute"] == pytest.approx(1.4 * 0.05)
    # One update while the other replica waits, at the thread count MirroredStrategy gives the
    # process: its replicas' share of the cores (1 thread each here), so 20 ms, not 2 threads' 10 ms.
    assert mirrored.parts["optimizer"] == pytest.approx(0.02)
    one_replica = predict(Candidate("mirrored", 1), p, _cluster(), options)
    assert one_replica.parts["optimizer"] == pytest.approx(0.01)  # one replica keeps both cores
    # Four processes on two cores: 1 thread each, time-sliced 2x, and the factor measured at 2.
    four = predict(
        Candidate("multi_worker_mirrored", 4, (("communication", "shm"),)),
        p,
        _cluster(devices_per_node=4),
        options,
    )
    assert four.parts["optimizer"] == pytest.approx(2 * 1.5 * 0.02)
    # Accelerators: the update as measured, no CPU sharing.
    gpus = predict(shm, p, _cluster(cores_per_node=None), options)
    assert gpus.parts["optimizer"] == pytest.approx(0.01)


def test_slow_native_loses_to_shm_and_accumulation_divides_activations():
    opts = Options(global_batch=100, accumulation_steps=2)
    native = predict(
        Candidate("multi_worker_mirrored", 2, (("communication", "native"),)), _profile(), _cluster(), opts
    )
    shm = predict(
        Candidate("multi_worker_mirrored", 2, (("communication", "shm"),)), _profile(), _cluster(), opts
    )
    assert native.step_seconds > shm.step_seconds
    assert shm.memory.activations == 25 * 4000


def test_pipeline_cuts_on_the_blocks_costs_at_its_micro_batch_and_threads():
    """A stage runs micro-batches at its process's threads; the blocks' shares there, not at the
    profiled batch, decide the cut and the slowest stage (as PipelineStrategy measures its cut)."""
    c = Candidate("pipeline", 2, (("stages", 2), ("microbatches", 4), ("schedule", "1f1b")))
    # At the profiled batch (2 threads) block 1 is 70% of the time; at 25 samples on 1 thread, 40%.
    skewed = tuple(
        replace(la, time_share=s) for la, s in zip(_profile().layers, (0.1, 0.7, 0.1, 0.1), strict=True)
    )
    per_batch = {
        1: {8: (1.0, 1.0, 1.0, 1.0), 32: (0.1, 0.4, 0.3, 0.2)},  # 25 samples: nearest measured is 32
        2: {8: (0.1, 0.7, 0.1, 0.1), 32: (0.1, 0.7, 0.1, 0.1)},
    }
    measured = predict(
        c, _profile(layers=skewed, layer_seconds=per_batch), _cluster(), Options(global_batch=100)
    )
    # stages [0, 1] | [2, 3]: 50% each; 25 ms per micro-batch on 1 thread -> 12.5 ms per slot
    assert "slowest stage 50%" in measured.note
    assert measured.parts["compute"] == pytest.approx(4 * 0.0125)
    # without per-batch figures (older profiles): the shares at the profiled batch, [0, 1] | [2, 3] = 80%
    old = predict(c, _profile(layers=skewed), _cluster(), Options(global_batch=100))
    assert "slowest stage 80%" in old.note
    assert old.parts["compute"] == pytest.approx(4 * 0.025 * 0.8)
    # more stages than blocks: the strategy's own error
    with pytest.raises(ValueError, match="stages"):
        predict(
            Candidate("pipeline", 5, (("stages", 5), ("microbatches", 4), ("schedule", "1f1b"))),
            _profile(),
            _cluster(),
            Options(global_batch=100),
        )


def test_pipeline_by_hand():
    # S=2, M=4, 100 samples: micro-batch 25 (25 ms on 1 thread), a stage is half the model: 12.5 ms
    # per slot; 100 B x 25 = 2.5 KB per hop at 1e8 B/s = 25 us. (4 + 1) slots + 2 hops + half the update.
    c = Candidate("pipeline", 2, (("stages", 2), ("microbatches", 4), ("schedule", "1f1b")))
    p = predict(c, _profile(), _cluster(), Options(global_batch=100))
    hop = 2500 / 1e8
    assert p.step_seconds == pytest.approx(5 * 0.0125 + 2 * hop + 0.005)
    # 1F1B keeps 2 micro-batches of 25 samples of the stage's 2 blocks' activations.
    assert p.memory.activations == pytest.approx(2 * 25 * 2000)


def test_a_crowded_pipeline_waits_for_a_core_once_per_micro_batch():
    """4 stage processes on 2 cores: a stage woken by its neighbour waits for a core (the
    calibration's busy_handoff), once per micro-batch; with a core each it wakes at once."""
    c = Candidate("pipeline", 4, (("stages", 4), ("microbatches", 8), ("schedule", "1f1b")))
    options = Options(global_batch=128)
    crowded = _cluster(devices_per_node=4)
    calm = predict(c, _profile(), crowded, options)
    waiting = predict(c, _profile(), replace(crowded, busy_handoff=0.003), options)
    assert calm.parts["wakeups"] == 0.0
    assert waiting.parts["wakeups"] == pytest.approx(8 * 0.003)
    assert waiting.step_seconds == pytest.approx(calm.step_seconds + 8 * 0.003)
    twice = predict(
        c, _profile(), replace(crowded, busy_handoff=0.003), replace(options, accumulation_steps=2)
    )
    assert twice.parts["wakeups"] == pytest.approx(2 * 8 * 0.003)  # every accumulation step's pipeline
    for roomy in (
        _cluster(devices_per_node=4, cores_per_node=4, busy_handoff=0.003),  # a core per stage
        _cluster(devices_per_node=4, cores_per_node=None, busy_handoff=0.003),  # accelerators
    ):
        assert predict(c, _profile(), roomy, options).parts["wakeups"] == 0.0
    with pytest.raises(ValueError, match="busy_handoff"):
        _cluster(busy_handoff=-1.0)


def test_an_unbalanced_pipeline_keeps_fewer_cores_busy_than_it_has_processes():
    # Blocks of 70% / 10% / 10% / 10% of the time: stages [0] and [1, 2, 3] (70% and 30%). Two
    # replicas of two stages are 4 processes on 2 cores (1 thread each), but while a 70% stage
    # computes its 30% partner computes 3/7 of the time: 2 x (1 + 3/7) = 2.86 processes busy, so
    # time-slicing slows the stages by 2.86 / 2 = 1.43x, not 4 / 2 = 2x.
    layers = tuple(
        LayerProfile(
            name=str(i),
            time_share=share,
            param_bytes=2.5 * MB,
            activation_bytes_per_sample=1000.0,
            output_bytes_per_sample=0.0,
        )
        for i, share in enumerate((0.7, 0.1, 0.1, 0.1))
    )
    p = _profile(layers=layers, optimizer_by_threads={1: 0.02, 2: 0.01}, optimizer_contention={2: 1.5})
    c = Candidate("pipeline", 4, (("stages", 2), ("microbatches", 2), ("schedule", "1f1b")))
    no_link = _cluster(devices_per_node=4, intra={**DEFAULT_INTRA, "native": Link(0.0, 1e30)})
    got = predict(c, p, no_link, Options(global_batch=100))
    busy = 2 * (1 + 0.3 / 0.7)
    slot = busy / 2 * 25e-3 * 0.7  # 25 samples per micro-batch on 1 thread, the 70% stage
    assert got.parts["compute"] == pytest.approx(2 * slot)
    # The update of the stage with the most parameters (three blocks: 75%) ends the step; its 2
    # replicas update together (1.5x), on 1 thread each, time-sliced by the same busy count.
    update = busy / 2 * 1.5 * 0.02 * 0.75
    assert got.step_seconds == pytest.approx(3 * slot + update)


def test_parameter_server_moves_only_touched_rows():
    sparse = _profile(
        param_bytes=400 * MB + 1 * MB,
        sparse_bytes=400 * MB,
        sparse_row_bytes=256.0,
        sparse_rows_per_sample=10.0,
    )
    c = Candidate("parameter_server", 2, (("servers", 1),))
    p = predict(c, sparse, _cluster(), Options(global_batch=100))
    # One worker with 100 samples touches 1000 rows: 1 MB dense + 256 KB sparse each way.
    assert "1.26 MB pulled and pushed" in p.note


def test_a_parameter_server_that_mostly_waits_does_not_time_slice_the_workers():
    # Chief + worker + server on a 2-core node (1 thread each, 50 samples per worker step = 50 ms
    # alone). A server of touched rows (1 KB per step) is busy ~0% of the time: 2 busy processes on
    # 2 cores, no time-slicing. A server applying 10 MB of dense weights per worker step at 0.1 GB/s
    # (100 ms; no optimizer profiled, so the cluster's generic rate) is busy all the time: 3 busy
    # processes on 2 cores, 1.5x.
    c = Candidate("parameter_server", 3, (("servers", 1),))
    rows = _profile(
        param_bytes=400 * MB, sparse_bytes=400 * MB, sparse_row_bytes=100.0, sparse_rows_per_sample=0.2
    )
    idle_server = predict(c, rows, _cluster(devices_per_node=3), Options(global_batch=100))
    assert idle_server.parts["compute"] == pytest.approx(0.05, rel=1e-3)
    dense = _cluster(devices_per_node=3, server_apply_bytes_per_s=1e8)
    busy_server = predict(c, _profile(optimizer_seconds=0.0), dense, Options(global_batch=100))
    assert busy_server.parts["compute"] == pytest.approx(1.5 * 0.05)
    # The two workers are separate replicas computing at once: a measured contention of 1.2 at 2
    # replicas slows each one's 50 ms to 60 ms.
    crowded = predict(c, replace(rows, contention={2: 1.2}), _cluster(devices_per_node=3), Options(100))
    assert crowded.parts["compute"] == pytest.approx(0.06, rel=1e-3)


def test_a_parameter_server_applies_at_the_rate_of_the_models_own_optimizer():
    # The profile timed this model's optimizer over its 10 MB at 200 ms on 1 thread (a dense AdamW
    # is far slower than a memory copy), so a server applies 10 MB per push in 200 ms whatever the
    # cluster's generic rate. Chief + worker + server, 2 cores, 1 thread each, 50 samples per worker:
    # while the server applies, the pushing worker waits: 2 busy processes, no time-slicing.
    # Server per push: 2 x 10 MB / 1.2 GB/s = 16.67 ms transfer + 200 ms apply = 216.67 ms;
    # a worker's cycle 50 + 16.67 + 200 ms: 2 workers keep the server busy (utilisation 1) ->
    # 3 busy processes on 2 cores, compute 1.5 x 50 = 75 ms. Worker step: 75 ms + 2 x (0.1 ms +
    # 8.33 ms) + 200 ms = 291.87 ms; the server caps the job at 50 / 0.21667 = 230.8 samples/s.
    profile = _profile(optimizer_by_threads={1: 0.2, 2: 0.15})
    c = Candidate("parameter_server", 3, (("servers", 1),))
    for generic in (1e8, 1e12):
        p = predict(c, profile, _cluster(devices_per_node=3, server_apply_bytes_per_s=generic), Options(100))
        assert p.parts["compute"] == pytest.approx(0.075)
        assert p.step_seconds == pytest.approx(0.075 + 2 * (1e-4 + 10 * MB / 1.2e9) + 0.2)
        assert p.samples_per_second == pytest.approx(50 / (2 * 10 * MB / 1.2e9 + 0.2))
    # Chief + 2 workers + server, 150 samples (50 per worker): 3 workers on 2 cores, 1.5x (75 ms);
    # while the server applies, 2 workers compute beside it: 3 busy, its 200 ms update takes 300 ms.
    # Busy all the time -> 4 busy processes, compute 2 x 50 = 100 ms.
    # Worker step 100 ms + 2 x (0.1 + 8.33) ms + 300 ms.
    four = predict(
        Candidate("parameter_server", 4, (("servers", 1),)),
        profile,
        _cluster(devices_per_node=4),
        Options(global_batch=150),
    )
    assert four.parts["compute"] == pytest.approx(0.1)
    assert four.step_seconds == pytest.approx(0.1 + 2 * (1e-4 + 10 * MB / 1.2e9) + 0.3)


def test_candidates_respect_the_cluster():
    one_node = {c.label for c in candidates(_profile(), _cluster(), Options(global_batch=64))}
    assert "multi_worker_mirrored[shm]" in one_node and "mirrored" in one_node
    two_nodes = {c.label for c in candidates(_profile(), _cluster(nodes=2), Options(global_batch=64))}
    assert "multi_worker_mirrored[hierarchical]" in two_nodes
    assert not {"multi_worker_mirrored[shm]", "mirrored", "central_storage"} & two_nodes
    assert "pipeline[S=4 M=8 1f1b]" in two_nodes


def test_unknown_strategy_is_named():
    with pytest.raises(PlanError, match="unknown strategy 'horovod'"):
        make_plan(_profile(), _cluster(), Options(global_batch=64), ("horovod",))


def test_a_batch_smaller_than_the_cluster_is_impossible():
    with pytest.raises(PlanError, match="cannot be split over 4 devices"):
        make_plan(_profile(), _cluster(devices_per_node=4), Options(global_batch=3))


def test_recommendation_is_the_fastest_that_fits():
    plan = make_plan(_profile(), _cluster(), Options(global_batch=100))
    assert plan.recommended is plan.predictions[0]
    assert "ahead of" in plan.reason
    # With near-free shared memory, data parallelism is fastest; a memory limit that only pipeline
    # stages meet (half the parameters each) makes the pipeline the answer, and the reason says so.
    fast = dict(DEFAULT_INTRA, shm=Link(0.0, 1e11))
    profile = _profile(optimizer_seconds=0.0)
    assert make_plan(
        profile, _cluster(intra=fast), Options(global_batch=100)
    ).recommended.candidate.label in ("mirrored", "multi_worker_mirrored[shm]")
    tight = _cluster(intra=fast, memory_per_device=36 * MB)
    plan = make_plan(profile, tight, Options(global_batch=100))
    assert plan.recommended.candidate.strategy == "pipeline"
    assert "does not fit in memory" in plan.reason


def test_a_model_that_fits_nowhere_says_what_would_make_it_fit():
    with pytest.raises(PlanError) as info:
        make_plan(_profile(), _cluster(memory_per_device=1 * MB), Options(global_batch=100))
    message = str(info.value)
    assert "fits on no strategy" in message
    assert "a device with at least" in message
    assert "activation checkpointing" in message and "accumulation_steps=2" in message


def test_central_storage_costs_what_mirrored_costs():
    # Both run thread replicas over one copy of the parameters, autograd summing into it: no copy,
    # no communication term (CentralStorage used to be charged a reduce-to-one over memory).
    options = Options(global_batch=100)
    mirrored = predict(Candidate("mirrored", 2), _profile(), _cluster(), options)
    central = predict(Candidate("central_storage", 2), _profile(), _cluster(), options)
    assert central.parts["communication"] == 0.0 and mirrored.parts["communication"] == 0.0
    assert central.step_seconds == pytest.approx(mirrored.step_seconds)
    # two replicas of 50 samples on 1 thread each, then one update with both cores
    assert central.step_seconds == pytest.approx(50 * 1e-3 + 0.01)


def test_sharded_by_hand():
    # 2 processes, 4 units of 2.5 MB on a 100 MB/s link: a reduce-scatter or all-gather of one unit
    # moves half of it, 12.5 ms. "parameters": 4 reductions + 2 x 4 gathers = 150 ms of traffic.
    options = Options(global_batch=100)
    p = predict(Candidate("sharded", 2, (("shard", "parameters"),)), _profile(), _cluster(), options)
    assert p.parts["communication"] == pytest.approx(12 * 0.0125)
    assert p.parts["optimizer"] == pytest.approx(0.01 / 2)  # each rank updates half the state
    # Shards of parameters, gradients and Adam state; buffers: the unit computing, the next one
    # prefetched, one unit's packed gradients.
    assert (p.memory.parameters, p.memory.gradients, p.memory.optimizer) == (5 * MB, 5 * MB, 10 * MB)
    assert p.memory.buffers == pytest.approx(3 * 2.5 * MB)
    gradients = predict(Candidate("sharded", 2, (("shard", "gradients"),)), _profile(), _cluster(), options)
    # Below "parameters" the full parameters stay, the optimizer's shards are views of them.
    assert (gradients.memory.parameters, gradients.memory.gradients) == (10 * MB, 5 * MB)
    assert gradients.parts["communication"] == pytest.approx(8 * 0.0125)  # one gather after the step
    optimizer = predict(Candidate("sharded", 2, (("shard", "optimizer"),)), _profile(), _cluster(), options)
    # The all-reduced gradients stay whole (the shards' gradients are views of them); in flight: one
    # block's packed gradients (the whole 10 MB model is one block under the 25 MB bucket cap).
    assert (optimizer.memory.parameters, optimizer.memory.gradients) == (10 * MB, 10 * MB)
    assert optimizer.memory.buffers == pytest.approx(10 * MB)


def test_sharded_collectives_run_on_their_own_calibrated_link():
    """gloo's reduce-scatter and all-gather are not its all-reduce: a measured "shard" link is used
    (here half the all-reduce's bandwidth: twice the traffic time); without one, the all-reduce's."""
    options = Options(global_batch=100)
    candidate = Candidate("sharded", 2, (("shard", "parameters"),))
    intra = {**_cluster().intra, "shard": Link(0.0, 0.5e8)}
    p = predict(candidate, _profile(), _cluster(intra=intra), options)
    assert p.parts["communication"] == pytest.approx(12 * 0.025)
    assert _cluster().shard_link() == _cluster().intra["native"]


def _exposed_gathers(gathers: list[float], fwd: list[float], bwd: list[float]) -> float:
    """By hand: the first gather of each pass waited for whole, each next one less its window."""
    first = gathers[0] + sum(max(0.0, g - w) for g, w in zip(gathers[1:], fwd, strict=True))
    back = gathers[::-1]
    return first + back[0] + sum(max(0.0, g - w) for g, w in zip(back[1:], bwd, strict=True))


def test_a_units_gather_hides_only_behind_the_layers_just_before_it():
    """At "parameters" each unit is gathered before its forward and again before its backward, the
    next one prefetched: it hides behind the compute between the two units, not the whole step's.
    Four 2.5 MB units (12.5 ms a gather on the toy link); with the compute piled into the first
    layer, forward's later gathers and backward's all find almost nothing to hide behind."""
    options = Options(global_batch=100)
    c = Candidate("sharded", 2, (("shard", "parameters"),))
    even = predict(c, _profile(), _cluster(), options)
    shares = (0.97, 0.01, 0.01, 0.01)
    front = _profile(
        layers=tuple(replace(la, time_share=s) for la, s in zip(_profile().layers, shares, strict=True))
    )
    piled = predict(c, front, _cluster(), options)
    half = even.parts["compute"] / 2  # forward or backward, backward_fraction 0.5
    g = [0.0125] * 4
    by_hand_even = _exposed_gathers(g, [half / 4] * 3, [half / 4] * 3)
    by_hand_piled = _exposed_gathers(g, [half * s for s in shares[:3]], [half * s for s in shares[:0:-1]])
    assert piled.step_seconds - even.step_seconds == pytest.approx(by_hand_piled - by_hand_even)
    assert by_hand_piled > by_hand_even


def test_sharded_gather_waits_cost_a_wake_up_each_with_more_processes_than_cores():
    """4 processes on 2 cores: each of the 2 x 4 gather waits a step makes at "parameters" costs the
    calibration's busy_handoff; at "gradients" (one gather of every block after the step) and with a
    core each, nothing."""
    options = Options(global_batch=100)
    crowded = _cluster(devices_per_node=4)
    for shard, waits in (("parameters", 8), ("gradients", 0)):
        c = Candidate("sharded", 4, (("shard", shard),))
        quick = predict(c, _profile(), crowded, options)
        slow = predict(c, _profile(), replace(crowded, busy_handoff=0.003), options)
        assert slow.step_seconds - quick.step_seconds == pytest.approx(waits * 0.003)
    c = Candidate("sharded", 4, (("shard", "parameters"),))
    roomy = _cluster(devices_per_node=4, cores_per_node=4)
    assert predict(c, _profile(), replace(roomy, busy_handoff=0.003), options).step_seconds == pytest.approx(
        predict(c, _profile(), roomy, options).step_seconds
    )


def test_each_parameters_unit_costs_the_calibrated_unit_seconds_beyond_its_bytes():
    """A unit's two gathers and reduction, as ShardedStrategy runs them, cost the calibration's
    shard_unit_seconds a step (allocation, packing, three meetings): 4 units, 4 x 2 ms; nothing
    below "parameters", whose blocks are gathered once after the step."""
    options = Options(global_batch=100)
    for shard, units in (("parameters", 4), ("gradients", 0), ("optimizer", 0)):
        c = Candidate("sharded", 2, (("shard", shard),))
        bare = predict(c, _profile(), _cluster(), options)
        costed = predict(c, _profile(), _cluster(shard_unit_seconds=0.002), options)
        assert costed.step_seconds - bare.step_seconds == pytest.approx(units * 0.002)
    with pytest.raises(ValueError, match="shard_unit_seconds"):
        _cluster(shard_unit_seconds=-1.0)


def test_below_parameters_the_blocks_are_the_strategys_buckets_not_the_layers():
    """At "gradients" ShardedStrategy packs parameters into blocks of up to bucket_cap_mb, one
    reduction and one gather each: the toy's four 2.5 MB layers are one 10 MB block by default (two
    1 ms message latencies a step), four at 2.5 MB buckets (eight)."""
    c = Candidate("sharded", 2, (("shard", "gradients"),))
    intra = {**_cluster().intra, "shard": Link(1e-3, 1e8)}
    one = predict(c, _profile(), _cluster(intra=intra), Options(global_batch=100))
    four = predict(c, _profile(), _cluster(intra=intra), Options(global_batch=100, bucket_bytes=2.5 * MB))
    assert one.parts["communication"] == pytest.approx(2 * 1e-3 + 0.1)
    assert four.parts["communication"] == pytest.approx(8 * 1e-3 + 0.1)


def test_collectives_are_time_sliced_with_more_processes_than_cores():
    """4 processes on 2 cores: gloo's exchange is CPU work and waits for a core like compute does."""
    c = Candidate("multi_worker_mirrored", 4, (("communication", "shm"),))
    two_cores = predict(c, _profile(), _cluster(devices_per_node=4), Options(global_batch=100))
    four_cores = predict(
        c, _profile(), _cluster(devices_per_node=4, cores_per_node=4), Options(global_batch=100)
    )
    assert two_cores.parts["communication"] == pytest.approx(2 * four_cores.parts["communication"])
    s = Candidate("sharded", 4, (("shard", "parameters"),))
    two = predict(s, _profile(), _cluster(devices_per_node=4), Options(global_batch=100))
    four = predict(s, _profile(), _cluster(devices_per_node=4, cores_per_node=4), Options(global_batch=100))
    assert two.parts["communication"] == pytest.approx(2 * four.parts["communication"])


def test_the_exchange_costs_what_the_calibration_measured_inside_a_step():
    """The calibration found the exchange of a real step slower than the same all-reduce alone
    (collective_in_step): data parallelism's and sharding's collectives are charged that much."""
    options = Options(global_batch=100)
    for c in (
        Candidate("multi_worker_mirrored", 2, (("communication", "shm"),)),
        Candidate("sharded", 2, (("shard", "parameters"),)),
    ):
        alone = predict(c, _profile(), _cluster(), options)
        in_step = predict(c, _profile(), _cluster(collective_in_step=2.0), options)
        assert in_step.parts["communication"] == pytest.approx(2 * alone.parts["communication"])


def test_a_synchronous_step_pays_the_calibrated_meeting_and_the_buffer_average():
    """Where the ranks meet (the gradient exchange), a step loses the calibration's sync_wait beyond
    the bytes, time-sliced past a process per core; a model with buffers pays a second meeting and
    the all-reduce of its buffers after the update. Thread replicas and one process meet nobody."""
    options = Options(global_batch=100)
    waiting = _cluster(sync_wait=0.004)
    for c in (
        Candidate("multi_worker_mirrored", 2, (("communication", "shm"),)),
        Candidate("sharded", 2, (("shard", "parameters"),)),
    ):
        base = predict(c, _profile(), _cluster(), options)
        met = predict(c, _profile(), waiting, options)
        assert met.step_seconds == pytest.approx(base.step_seconds + 0.004)
        assert met.parts["exposed"] == pytest.approx(base.parts["exposed"] + 0.004)
        # 1 MB of BatchNorm statistics: a second meeting and 1 MB on the native link (100 MB/s, 2 ranks:
        # 2 x 1/2 of the bytes = 10 ms)
        buffered = predict(c, _profile(buffer_bytes=1 * MB), waiting, options)
        assert buffered.step_seconds == pytest.approx(base.step_seconds + 2 * 0.004 + 0.01)
        crowded = _cluster(devices_per_node=4, sync_wait=0.004)
        four = Candidate(c.strategy, 4, c.settings)
        sliced = predict(four, _profile(), crowded, options).step_seconds
        assert sliced == pytest.approx(
            predict(four, _profile(), _cluster(devices_per_node=4), options).step_seconds + 2 * 0.004
        )
    for c in (Candidate("mirrored", 2), Candidate("one_device", 1)):
        buffered = _profile(buffer_bytes=1 * MB)
        assert predict(c, buffered, waiting, options).step_seconds == pytest.approx(
            predict(c, _profile(), _cluster(), options).step_seconds
        )
    with pytest.raises(ValueError, match="sync_wait"):
        _cluster(sync_wait=-0.001)


def test_the_profile_counts_the_models_buffers_and_takes_batchnorm_at_a_small_batch():
    """16 samples: the smallest timed batch (1/16 of it) is still 2, which BatchNorm trains on."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    profile = measure_model(model, nn.CrossEntropyLoss(), x, y, threads=[1], repeats=1)
    # running mean and variance (16 floats each) and the batch counter (one int64)
    assert profile.buffer_bytes == 16 * 4 * 2 + 8
    plain = measure_model(nn.Linear(8, 2), nn.CrossEntropyLoss(), x, y, threads=[1], repeats=1)
    assert plain.buffer_bytes == 0.0


def test_zero_bubble_pays_its_measured_split_backward():
    """A zero-bubble stage runs an input pass and a weight pass per module: the profile's measured
    slowdown at the nearest micro-batch size scales its compute; 1F1B does not pay it."""
    profile = _profile(split_backward={4: 1.5, 25: 1.2})
    options = Options(global_batch=100)
    settings = (("stages", 2), ("microbatches", 4))
    zb = predict(Candidate("pipeline", 2, (*settings, ("schedule", "zb"))), profile, _cluster(), options)
    plain = predict(
        Candidate("pipeline", 2, (*settings, ("schedule", "zb"))), _profile(), _cluster(), options
    )
    one_f = predict(Candidate("pipeline", 2, (*settings, ("schedule", "1f1b"))), profile, _cluster(), options)
    assert zb.parts["compute"] == pytest.approx(1.2 * plain.parts["compute"])  # micro-batch of 25
    assert one_f.parts["compute"] == pytest.approx(plain.parts["compute"])
    assert profile.split_backward_factor(3.0) == 1.5 and _profile().split_backward_factor(25) == 1.0


def test_the_profile_measures_the_split_backward_of_a_chain():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
    profile = measure_model(model, nn.CrossEntropyLoss(), x, y, threads=[1], repeats=1)
    assert set(profile.split_backward) == {4, 16}  # the compute curve's small sizes
    assert all(f >= 1.0 for f in profile.split_backward.values())
    unchained = measure_model(nn.Linear(8, 4), nn.CrossEntropyLoss(), x, y, threads=[1], repeats=1)
    assert unchained.split_backward == {}


def test_sharded_memory_terms_are_what_memory_report_measured_on_w2():
    # benchmarks/sharded_memory.py 2 and 4 (docs/architecture.md): W2, AdamW, model-state bytes of
    # rank 0 after the last of 3 steps. P = 21,157,888 parameter bytes, AdamW state 2P.
    P = 21_157_888
    measured = {
        (2, "optimizer"): 63_474_080,
        (2, "gradients"): 52_895_136,
        (2, "parameters"): 42_316_400,
        (4, "optimizer"): 52_895_136,
        (4, "gradients"): 37_026_720,
        (4, "parameters"): 21_158_512,
    }
    for (n, shard), got in measured.items():
        m = sharded_memory(P, 2 * P, 0.0, 1, n=n, shard=shard, largest_unit_bytes=0.0)
        assert m.parameters + m.gradients + m.optimizer == pytest.approx(got, rel=1e-4), (n, shard)


def test_sharding_is_recommended_when_only_it_fits():
    # 8 units of 1.25 MB. Data parallelism needs 50.2 MB per process (parameters, gradients, flat
    # buffer, Adam, activations), sharded optimizer state 40.2 MB, sharded gradients 35.2 MB (one
    # 10 MB block in flight), sharded parameters 23.95 MB: with 25 MB only the last fits, and the
    # reason says what would be faster.
    layers = tuple(
        replace(layer, name=f"{i}", time_share=0.125, param_bytes=1.25 * MB)
        for i, layer in enumerate(_profile().layers * 2)
    )
    profile = _profile(layers=layers)
    strategies = ("multi_worker_mirrored", "sharded")
    roomy = make_plan(profile, _cluster(), Options(global_batch=100), strategies)
    assert roomy.recommended.candidate.strategy == "multi_worker_mirrored"
    plan = make_plan(profile, _cluster(memory_per_device=25 * MB), Options(global_batch=100), strategies)
    assert plan.recommended.candidate.label == "sharded[parameters]"
    assert plan.recommended.memory.total == pytest.approx(23.95 * MB)
    assert "does not fit in memory" in plan.reason


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(64, 32)
        self.pos = nn.Embedding(16, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, 128, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(2)
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for layer in self.layers:
            h = layer(h, src_mask=self.mask, is_causal=True)
        return h @ self.tok.weight.T


@pytest.mark.parametrize("workload", ["mlp", "decoder"])
def test_predicted_activation_bytes_are_what_measure_activations_measures(workload):
    # The planner profiles at batch 16 and predicts 2 replicas of 8; one replica measured at 8 must
    # hold those bytes. Tolerance 0.1%: tensors that do not grow with the batch (the loss's scalar
    # weight, the decoder's position indices: 4 and 128 bytes at any batch) are spread per sample.
    torch.manual_seed(0)
    if workload == "mlp":
        make = lambda: nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))  # noqa: E731
        loss_fn: Any = nn.CrossEntropyLoss()
        x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    else:
        make, loss_fn = _TinyDecoder, _lm_loss
        x, y = torch.randint(0, 64, (16, 16)), torch.randint(0, 64, (16, 16))
    profile = measure_model(make(), loss_fn, x, y, repeats=1)
    strategy = spread.OneDeviceStrategy("cpu")
    with strategy.scope():
        model = make()
    with strategy.measure_activations():
        strategy.run(lambda: loss_fn(model(x[:8]), y[:8]).backward())
    measured = strategy.memory_report().activation_bytes
    for candidate in (
        Candidate("multi_worker_mirrored", 2),
        Candidate("sharded", 2, (("shard", "parameters"),)),
    ):
        predicted = predict(candidate, profile, _cluster(), Options(global_batch=16)).memory.activations
        assert predicted == pytest.approx(measured, rel=1e-3), candidate.label


def test_sharded_predicts_a_model_without_parameters_at_every_stage():
    """Nothing to shard: no block, no collective time, and no crash on an empty block list."""
    layers = tuple(replace(la, param_bytes=0.0) for la in _profile().layers)
    bare = _profile(param_bytes=0.0, optimizer_bytes=0.0, layers=layers)
    for shard in ("optimizer", "gradients", "parameters"):
        p = predict(Candidate("sharded", 2, (("shard", shard),)), bare, _cluster(), Options(global_batch=100))
        assert p.parts["communication"] == 0.0 and p.step_seconds > 0


def test_offloaded_shards_leave_the_device_and_cost_their_transfers_on_a_cpu():
    # 2 processes: shards of 5 MB of parameters and gradients and 10 MB of Adam state. Beside a CPU the
    # state is a memory-mapped file read and written once a step over the default 1 GB/s, 100 us path:
    # 2 x 10.1 ms. "parameters" also moves the 5 MB parameter shard in before both gathers and the
    # gradient shard out and back in: 4 x 5.1 ms more.
    options = Options(global_batch=100)
    plain = predict(Candidate("sharded", 2, (("shard", "parameters"),)), _profile(), _cluster(), options)
    state = predict(
        Candidate("sharded", 2, (("shard", "parameters"), ("offload", "optimizer"))),
        _profile(),
        _cluster(),
        options,
    )
    assert state.candidate.label == "sharded[parameters offload=optimizer]"
    assert (state.memory.parameters, state.memory.gradients, state.memory.optimizer) == (5 * MB, 5 * MB, 0.0)
    assert state.memory.offloaded == 10 * MB
    assert state.memory.total == pytest.approx(plain.memory.total - 10 * MB)
    assert state.parts["offload"] == pytest.approx(2 * 0.0101)
    assert state.step_seconds == pytest.approx(plain.step_seconds + 2 * 0.0101)
    everything = predict(
        Candidate("sharded", 2, (("shard", "parameters"), ("offload", "parameters"))),
        _profile(),
        _cluster(),
        options,
    )
    assert (everything.memory.parameters, everything.memory.gradients) == (0.0, 0.0)
    assert everything.memory.offloaded == 20 * MB
    assert everything.parts["offload"] == pytest.approx(2 * 0.0101 + 4 * 0.0051)


def test_offload_beside_an_accelerator_updates_on_the_host():
    # The update touches 2 x (5 + 5 + 10) MB of host memory at 4 GB/s (10 ms) instead of the device's
    # 5 ms; the gradient shard goes out and the parameter shard comes back over 16 GB/s.
    options = Options(global_batch=100)
    gpu = _cluster(cores_per_node=None)
    p = predict(
        Candidate("sharded", 2, (("shard", "parameters"), ("offload", "optimizer"))), _profile(), gpu, options
    )
    assert p.parts["optimizer"] == pytest.approx(2 * 20 * MB / 4e9)
    assert p.parts["offload"] == pytest.approx(2 * (1e-5 + 5 * MB / 16e9))


def test_offload_is_recommended_when_only_it_fits():
    # Per process: sharded parameters 27.7 MB (5 + 5 + 10 of state, 0.2 of activations, 7.5 of
    # gathered units); the optimizer's shard offloaded 17.7 MB; everything offloaded 7.7 MB.
    plan = make_plan(_profile(), _cluster(memory_per_device=20 * MB), Options(global_batch=100), ("sharded",))
    assert plan.recommended.candidate.label == "sharded[parameters offload=optimizer]"
    assert plan.recommended.memory.total == pytest.approx(17.7 * MB)
    assert "does not fit in memory" in plan.reason
    tighter = make_plan(
        _profile(), _cluster(memory_per_device=10 * MB), Options(global_batch=100), ("sharded",)
    )
    assert tighter.recommended.candidate.label == "sharded[parameters offload=parameters]"


def test_hybrid_sharding_gathers_inside_a_node_and_reduces_across():
    # 2 nodes x 2 processes, a network 10x slower than the node's link. Full sharding over 4: every
    # gather and reduce-scatter crosses the network (3/4 of a 2.5 MB unit at 10 MB/s: 187.5 ms, 12 of
    # them). Groups of 2: inside the node (12.5 ms each), plus an all-reduce of each unit's reduced
    # half across the 2 groups (1.25 MB at 10 MB/s: 125 ms, 4 of them).
    cluster = _cluster(nodes=2, inter=Link(0.0, 1e7))
    options = Options(global_batch=100)
    full = predict(Candidate("sharded", 4, (("shard", "parameters"),)), _profile(), cluster, options)
    hybrid = predict(
        Candidate("sharded", 4, (("shard", "parameters"), ("shard_group_size", 2))),
        _profile(),
        cluster,
        options,
    )
    assert full.parts["communication"] == pytest.approx(12 * 0.1875)
    assert hybrid.parts["communication"] == pytest.approx(12 * 0.0125 + 4 * 0.125)
    # a group of 2 holds half of everything, where 4 hold a quarter
    assert (hybrid.memory.parameters, hybrid.memory.optimizer) == (5 * MB, 10 * MB)
    assert (full.memory.parameters, full.memory.optimizer) == (2.5 * MB, 5 * MB)
    assert make_plan(_profile(), cluster, options, ("sharded",)).recommended.candidate.label == (
        "sharded[parameters shard_group_size=2]"
    )


def test_hybrid_groups_predicted_are_proper_divisors_within_a_node():
    def groups(cluster: ClusterModel) -> list[int]:
        found = candidates(_profile(), cluster, Options(global_batch=96), ("sharded",))
        return [c.get("shard_group_size") for c in found if c.get("shard_group_size") is not None]

    assert groups(_cluster(devices_per_node=8, cores_per_node=8)) == [2, 4]
    assert groups(_cluster(devices_per_node=2)) == []
    assert groups(_cluster(nodes=3, devices_per_node=4, cores_per_node=4)) == [2, 4]


def test_bad_hybrid_and_offload_settings_are_refused_by_name():
    with pytest.raises(
        ValueError, match="shard_group_size must divide the 4 processes, got shard_group_size=3"
    ):
        predict(
            Candidate("sharded", 4, (("shard", "parameters"), ("shard_group_size", 3))),
            _profile(),
            _cluster(),
            Options(8),
        )
    with pytest.raises(ValueError, match="offload must be None, 'optimizer' or 'parameters', got 'disk'"):
        sharded_memory(1.0, 1.0, 0.0, 1, n=2, shard="parameters", largest_unit_bytes=0.0, offload="disk")
    with pytest.raises(ValueError, match='offload="parameters" needs shard="parameters"'):
        sharded_memory(1.0, 1.0, 0.0, 1, n=2, shard="optimizer", largest_unit_bytes=0.0, offload="parameters")
