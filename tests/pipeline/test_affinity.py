"""CPU binding of pipeline stage processes: the split of a node's CPUs, when it stays out of the way,
that every thread (also ones started earlier) is bound, and that restore undoes it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from spread.pipeline.affinity import _parse_cpu_list, bind_local_cpus, plan_binding
from spread.testing import run_ranks

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux with at least 2 usable CPUs",
)


def test_parse_cpu_list() -> None:
    assert _parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert _parse_cpu_list("5") == {5}


def test_plan_splits_the_mask_into_equal_contiguous_parts() -> None:
    cpus = set(range(8))
    assert plan_binding(0, 2, cpus, cpus) == (0, 1, 2, 3)
    assert plan_binding(1, 2, cpus, cpus) == (4, 5, 6, 7)
    assert plan_binding(2, 3, cpus, None) == (4, 5)  # 8 // 3 = 2 each; CPUs 6-7 stay free
    assert plan_binding(1, 2, {3, 9}, {3, 9}) == (9,)


def test_plan_leaves_the_process_alone() -> None:
    assert plan_binding(0, 4, {0, 1}, {0, 1}) is None  # more local processes than CPUs
    assert plan_binding(1, 2, {2, 3}, set(range(4))) is None  # already narrowed by a launcher
    assert plan_binding(2, 2, {0, 1}, None) is None  # not a valid local rank


def _bind_worker() -> dict:
    os.environ.pop("OMP_NUM_THREADS", None)  # the harness sets it; binding then leaves threads alone
    torch.set_num_threads(2)
    stop = threading.Event()
    early = threading.Thread(target=stop.wait)  # started before binding: must be bound too
    early.start()
    try:
        before = os.sched_getaffinity(0)
        binding = bind_local_cpus(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]))
        assert binding is not None
        bound = {
            "main": os.sched_getaffinity(0),
            "early": os.sched_getaffinity(early.native_id),
            "threads": torch.get_num_threads(),
        }
        binding.restore()
        return {
            "cpus": set(binding.cpus),
            "bound": bound,
            "restored": os.sched_getaffinity(0) == before,
            "early_restored": os.sched_getaffinity(early.native_id) == before,
            "threads_restored": torch.get_num_threads(),
        }
    finally:
        stop.set()
        early.join()


@needs_two_cpus
@pytest.mark.processes
def test_each_local_process_gets_its_own_cpus_and_restore_undoes_it() -> None:
    out = run_ranks(_bind_worker, 2, timeout=60)
    assert out[0]["cpus"] and out[1]["cpus"] and not out[0]["cpus"] & out[1]["cpus"]
    for r in out:
        assert r["bound"]["main"] == r["cpus"] == r["bound"]["early"]
        assert r["bound"]["threads"] == min(2, len(r["cpus"]))
        assert r["restored"] and r["early_restored"] and r["threads_restored"] == 2


def _strategy_worker(bind: bool) -> dict:
    import spread

    before = os.sched_getaffinity(0)
    strategy = spread.PipelineStrategy(stages=2, microbatches=2, bind_cpus=bind)
    try:
        binding = strategy.cpu_binding
        during = os.sched_getaffinity(0)
    finally:
        strategy.close()
    return {
        "cpus": set(binding.cpus) if binding is not None else None,
        "during": during,
        "unchanged_after": os.sched_getaffinity(0) == before,
        "before": before,
    }


@needs_two_cpus
@pytest.mark.processes
def test_pipeline_strategy_binds_stages_apart_and_close_restores() -> None:
    out = run_ranks(_strategy_worker, 2, args=(True,), timeout=120)
    assert not out[0]["cpus"] & out[1]["cpus"]
    assert all(r["during"] == r["cpus"] and r["unchanged_after"] for r in out)
    off = run_ranks(_strategy_worker, 2, args=(False,), timeout=120)
    assert all(r["cpus"] is None and r["during"] == r["before"] for r in off)
