"""Recovery without restart (``spread run --recover``): a MultiWorkerMirrored ``Trainer.fit`` of 3
ranks loses rank 2 (SIGKILL before a step, SIGKILL mid-backward while its peers are in the gradient
all-reduce, SIGSTOP, preemption by SIGTERM); the two survivors regroup in place, without restarting
or reloading anything, repeat the step in flight with the same global batch and end with the weights
of the uninterrupted 3-rank run. Strategies that cannot regroup are refused by name (ShardedStrategy's
recovery: test_sharded_recovery_without_restart.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spread.testing.processes import spread_run

SCRIPT = Path(__file__).parent / "scripts" / "recover_train.py"
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # the same sums, split and added in another order


def _results(log: str) -> list[dict]:
    return [json.loads(line.split("RESULT ", 1)[1]) for line in log.splitlines() if "RESULT " in line]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    run = spread_run(SCRIPT, 3, "-1", "0", "kill")
    assert run.returncode == 0, run.log
    results = _results(run.log)
    assert len(results) == 3 and {r["world_size"] for r in results} == {3}
    return results[0]


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["kill", "backward", "stop", "term"])
def test_survivors_of_a_lost_rank_finish_with_the_uninterrupted_weights(uninterrupted, mode):
    run = spread_run(SCRIPT, 3, "2", "5", mode, flags=("--recover",))
    assert run.returncode == 0, run.log
    assert "rank 2 was lost; --recover: the job continues without it at world size 2" in run.log
    assert "regrouped at world size 2 without restart" in run.log
    assert "restarting" not in run.log
    results = _results(run.log)
    assert sorted(r["start_rank"] for r in results) == [0, 1], run.log
    assert len({r["pid"] for r in results}) == 2  # each survivor is the process that started
    for result in results:
        assert result["world_size"] == 2
        assert result["global_step"] == uninterrupted["global_step"]
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(
                torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE, msg=key
            )


@pytest.mark.processes
def test_a_rank_lost_while_its_peers_validate_leaves_them_to_end_the_epoch_again(uninterrupted):
    """Validation's collectives come before any callback sees the epoch's end: the survivors regroup,
    end the epoch again at the smaller world (validating on it) and train on."""
    run = spread_run(SCRIPT, 3, "2", "10", "validation", flags=("--recover",))
    assert run.returncode == 0, run.log
    assert "regrouped at world size 2 without restart" in run.log
    assert "continuing at epoch 1, batch 10 (after 10 optimizer steps)" in run.log  # the epoch's end
    results = _results(run.log)
    assert sorted(r["start_rank"] for r in results) == [0, 1], run.log
    for result in results:
        assert len(result["val_loss"]) == 2 and len(result["loss"]) == 2  # each epoch ended once
        assert result["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5)
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(
                torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE, msg=key
            )


@pytest.mark.processes
def test_the_chief_lost_in_the_backup_at_an_epochs_end_leaves_the_others_to_go_on(uninterrupted, tmp_path):
    """``BackupAndRestore``'s default ``save_freq="epoch"`` saves in ``on_epoch_end``: the chief dies
    between writing its shard and committing, the others' save fails, and they go on at the next
    epoch (that backup never became the latest; the epoch ended once)."""
    run = spread_run(SCRIPT, 3, "0", "0", "epoch_save", str(tmp_path / "backups"), flags=("--recover",))
    assert run.returncode == 0, run.log
    assert "rank 0 was lost; --recover: the job continues without it at world size 2" in run.log
    assert "continuing at epoch 2, batch 0 (after 10 optimizer steps)" in run.log
    results = _results(run.log)
    assert sorted(r["start_rank"] for r in results) == [1, 2], run.log
    for result in results:
        assert result["loss"] == pytest.approx(uninterrupted["loss"], rel=1e-5)  # 2 epochs, each ended once
        for key, value in uninterrupted["weights"].items():
            torch.testing.assert_close(
                torch.tensor(result["weights"][key]), torch.tensor(value), **TOLERANCE, msg=key
            )


@pytest.mark.processes
def test_batchnorm_running_statistics_stay_equal_on_every_rank_after_a_regroup(monkeypatch):
    """Rank 2 dies in backward: the survivors' forward had moved their running statistics each its
    own way. They are broadcast at the regroup, and the averaging after each step starts from them
    (batch norm is not exact across world sizes, so only the ranks' agreement is checked)."""
    monkeypatch.setenv("SPREAD_TEST_BATCHNORM", "1")
    run = spread_run(SCRIPT, 3, "2", "5", "backward", flags=("--recover",))
    assert run.returncode == 0, run.log
    assert "regrouped at world size 2 without restart" in run.log
    first, *others = _results(run.log)
    assert others and "1.running_mean" in first["weights"]
    for other in others:
        for key, value in first["weights"].items():
            assert other["weights"][key] == value, key


@pytest.mark.parametrize("name", ["PipelineStrategy"])
def test_strategies_that_cannot_regroup_are_refused_by_name(name):
    import spread
    from spread.errors import SpreadError

    cls = getattr(spread, name)
    with pytest.raises(SpreadError, match=f"{name} cannot recover without restart"):
        cls.check_recoverable(object.__new__(cls))


def test_sharded_strategy_recovers_only_when_built_under_spread_run_recover():
    """It keeps the buddy copy of its neighbour's shard only then (tests/train/
    test_sharded_recovery_without_restart.py runs the recovery itself)."""
    import spread
    from spread.errors import SpreadError

    strategy = object.__new__(spread.ShardedStrategy)
    strategy._rendezvous, strategy._sync_batchnorm, strategy._data_axis = object(), False, None
    strategy._buddy, strategy.awaiting_state = None, False
    with pytest.raises(SpreadError, match="only when built under spread run --recover"):
        strategy.check_recoverable()


def test_fit_under_spread_run_recover_refuses_a_strategy_that_cannot_regroup(monkeypatch):
    import spread
    from spread.errors import SpreadError

    monkeypatch.setenv("SPREAD_RECOVER", "1")
    model = torch.nn.Linear(2, 1)
    trainer = spread.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.MSELoss(),
        strategy=spread.OneDeviceStrategy("cpu"),
    )
    with pytest.raises(SpreadError, match="OneDeviceStrategy cannot recover without restart"):
        trainer.fit((torch.randn(4, 2), torch.randn(4, 1)), epochs=1, global_batch_size=2, verbose=0)
    assert trainer.global_step == 0


def test_parameter_server_tasks_never_regroup_but_a_job_may_recover_its_servers():
    """Under --recover a parameter-server job restores a lost server in place (tests/ps/test_in_place*);
    its training tasks share no collective and never regroup: asked to, they say so by name."""
    import spread
    from spread.cluster.launcher import LaunchConfig
    from spread.errors import SpreadError

    cls = spread.ParameterServerStrategy
    cls.check_recoverable(object.__new__(cls))  # nothing refused: fit runs under --recover
    with pytest.raises(SpreadError, match="ParameterServerStrategy training tasks do not regroup"):
        cls.regroup(object.__new__(cls))
    assert LaunchConfig(entrypoint="train.py", workers=1, ps=1, recover=True).recover
    with pytest.raises(ValueError, match=r"recover.*must be True or False"):
        LaunchConfig(entrypoint="train.py", recover="yes")  # type: ignore[arg-type]
