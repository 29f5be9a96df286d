"""Recovery without restart for ShardedStrategy (``spread run --recover``): each rank keeps a buddy copy
of its ring neighbour's shard at every step boundary, so when one rank of 3 is SIGKILLed (before a
step, or mid-backward while its peers reduce gradients) the two survivors rebuild the whole model
and Adam state from their shards and the lost rank's copy, cut it again for 2 ranks, repeat the step
in flight with the same global batch, and end with the weights of the uninterrupted 3-rank run (and
after a second loss, on one rank). Two ring neighbours lost together took the only copies of a
shard: the job fails naming both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spread.errors import SpreadError
from spread.strategies.sharded_buddy import (
    Entry,
    agreed_version,
    check_recoverable_loss,
    entries_from_plain,
    entries_to_plain,
)
from spread.testing.processes import spread_run

SCRIPT = Path(__file__).parent / "scripts" / "recover_sharded_train.py"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # the same sums, split and added in another order


def _results(log: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line]


_UNINTERRUPTED: dict[tuple[int, str], dict] = {}


def _uninterrupted_at(world: int, shard: str) -> dict:
    if (world, shard) not in _UNINTERRUPTED:
        run = spread_run(SCRIPT, world, "-1", "0", "kill", shard)
        assert run.returncode == 0, run.log
        results = _results(run.log)
        assert len(results) == world and {r["world_size"] for r in results} == {world}
        assert not any(r["buddy_copy"] for r in results)  # never without --recover: no cost there
        assert {r["recovery_copy_bytes"] for r in results} == {0}
        _UNINTERRUPTED[(world, shard)] = results[0]
    return _UNINTERRUPTED[(world, shard)]


def _uninterrupted(shard: str) -> dict:
    return _uninterrupted_at(3, shard)


@pytest.mark.processes
@pytest.mark.parametrize(
    ("shard", "victim", "mode"),
    [("parameters", 2, "backward"), ("parameters", 0, "kill"), ("optimizer", 1, "backward")],
)
def test_sharded_survivors_of_a_lost_rank_finish_with_the_uninterrupted_weights(shard, victim, mode):
    expected = _uninterrupted(shard)
    run = spread_run(SCRIPT, 3, str(victim), "5", mode, shard, flags=("--recover",))
    assert run.returncode == 0, run.log
    assert f"rank {victim} was lost; --recover: the job continues without it at world size 2" in run.log
    assert "regrouped at world size 2 without restart" in run.log
    assert "restarting" not in run.log
    results = _results(run.log)
    assert sorted(r["start_rank"] for r in results) == sorted({0, 1, 2} - {victim}), run.log
    for result in results:
        assert result["world_size"] == 2 and result["buddy_copy"]
        assert result["global_step"] == expected["global_step"]
        for key, value in expected["weights"].items():
            torch.testing.assert_close(
                torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE, msg=key
            )


@pytest.mark.processes
def test_two_losses_in_one_job_3_then_2_then_1_rank():
    """After the first regroup the buddy copies are of the new ring: a second loss recovers too."""
    expected = _uninterrupted("parameters")
    run = spread_run(SCRIPT, 3, "2,1", "4,9", "kill", "parameters", flags=("--recover",))
    assert run.returncode == 0, run.log
    assert "regrouped at world size 2 without restart" in run.log
    assert "regrouped at world size 1 without restart" in run.log
    (result,) = _results(run.log)
    assert (result["start_rank"], result["world_size"]) == (0, 1)
    assert result["global_step"] == expected["global_step"]
    for key, value in expected["weights"].items():
        torch.testing.assert_close(
            torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE, msg=key
        )


@pytest.mark.processes
def test_two_ring_neighbours_lost_together_fail_the_job_naming_both():
    run = spread_run(SCRIPT, 3, "1,2", "5", "kill", "parameters", flags=("--recover",))
    assert run.returncode != 0
    assert "cannot recover without restart from losing ranks 1 and 2 of 3 together" in run.log
    assert "RESULT " not in run.log


@pytest.mark.processes
@pytest.mark.parametrize(
    ("world", "victim", "at", "shard"),
    [(3, 2, 5, "parameters"), (4, 2, 5, "optimizer"), (4, 2, 7, "parameters")],
)
def test_a_loss_between_the_survivors_step_and_the_buddy_exchange_takes_them_back_one_step(
    world, victim, at, shard
):
    """The victim dies just before its optimizer step: the others step, then wait in vain for its
    shard in the buddy exchange (at 4 ranks, rank 0 completes its exchange with rank 3 first, and
    after the epoch's last step (8) goes on to the epoch's end), so the only copy of its shard is of
    the step before theirs. The survivors go back to their rollback point (the shard, Adam's step
    count, the learning rate the schedule had moved, the loop's position and sums) and repeat the
    step: the uninterrupted weights, each epoch ended once."""
    expected = _uninterrupted_at(world, shard)
    run = spread_run(SCRIPT, world, str(victim), str(at), "in_exchange", shard, flags=("--recover",))
    assert run.returncode == 0, run.log
    assert f"regrouped at world size {world - 1} without restart" in run.log
    assert f"(after {at} optimizer steps)" in run.log  # back one step: the step in flight is repeated
    results = _results(run.log)
    assert sorted(r["start_rank"] for r in results) == sorted(set(range(world)) - {victim}), run.log
    for result in results:
        assert result["world_size"] == world - 1
        assert result["global_step"] == expected["global_step"]
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)  # the loop's sums went back too
        # Two packed shards (the neighbour's copy, its own rollback point), each a parameter chunk
        # and Adam's two moments: 3x the moments' bytes, less Adam's step counts.
        assert result["recovery_copy_bytes"] == pytest.approx(3 * result["optimizer_state_bytes"], rel=0.05)
        for key, value in expected["weights"].items():
            torch.testing.assert_close(
                torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE, msg=key
            )


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["in_exchange", "backward"])
def test_batchnorm_running_statistics_stay_equal_on_every_rank_after_a_regroup(monkeypatch, mode):
    """The lost step's forward moved each survivor's running statistics its own way; after the
    regroup they are broadcast, and the averaging after each step must start from them, or each
    rank keeps its own offset for good. (Batch norm is not exact across world sizes: each rank
    normalises over its own part of the batch, so only the ranks' agreement is checked.)"""
    monkeypatch.setenv("SPREAD_TEST_BATCHNORM", "1")
    run = spread_run(SCRIPT, 3, "2", "5", mode, "parameters", flags=("--recover",))
    assert run.returncode == 0, run.log
    assert "regrouped at world size 2 without restart" in run.log
    first, *others = _results(run.log)
    assert others and "norm.running_mean" in first["weights"]
    for other in others:
        for key, value in first["weights"].items():
            assert other["weights"][key] == value, key


def test_survivors_agree_on_the_step_the_lost_copy_is_of_and_refuse_what_no_rank_can_reach():
    # Rows: [steps applied, step of the lost neighbour's copy it keeps, its rollback point's, has a shard].
    assert agreed_version([[6, -1, 5, 1], [6, 5, 5, 1]], [2]) == 5  # both go back one step
    assert agreed_version([[6, -1, 5, 1], [6, 6, 5, 1]], [2]) == 6  # the copy came through: no going back
    assert agreed_version([[6, -1, 5, 1], [6, -1, 5, 1], [0, -1, -1, 0]], []) == 6  # admitting a joiner
    two_back = r"of optimizer step\(s\) \[4\], the survivors' shards of step\(s\) \[6\]"
    with pytest.raises(SpreadError, match=two_back):
        agreed_version([[6, -1, 5, 1], [6, 4, 5, 1]], [2])  # two steps back: no rollback point for it
    disagree = r"copies of the lost rank\(s\) \[1, 3\] are of optimizer step\(s\) \[5, 6\]"
    with pytest.raises(SpreadError, match=disagree):
        agreed_version([[6, 5, 5, 1], [6, 6, 5, 1]], [1, 3])


def test_a_loss_is_recoverable_unless_a_shard_and_its_buddy_copy_went_together():
    check_recoverable_loss(3, [2])
    check_recoverable_loss(4, [0, 2])  # not neighbours: rank 3 keeps 0's copy, rank 1 keeps 2's
    with pytest.raises(SpreadError, match="losing ranks 3 and 0 of 4 together"):
        check_recoverable_loss(4, [0, 3])
    with pytest.raises(SpreadError, match="losing ranks 0 and 1 of 4 together"):
        check_recoverable_loss(4, [1, 0])


def test_a_shards_layout_travels_to_a_joiner_as_plain_values_and_an_unknown_dtype_is_refused():
    entries = [Entry(0, 0, "", torch.float32, 0, 6), Entry(0, 0, "exp_avg", torch.float32, 6, 6)]
    entries.append(Entry(1, 0, "", torch.bfloat16, 0, 4))
    plain = entries_to_plain(entries)
    assert json.loads(json.dumps(plain)) == plain  # JSON: never a pickle on the wire
    assert entries_from_plain(plain) == entries
    with pytest.raises(SpreadError, match="unknown dtype 'Tensor'"):
        entries_from_plain([[0, 0, "", "Tensor", 0, 6]])
