"""PipelineStrategy: equals one device (GPipe, 1F1B, hybrid), trains under Trainer, checkpoints both
ways, names a dead stage, refuses bad arguments."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from _equivalence_cases import GLOBAL_BATCH, make_data, make_model, make_optimizer, max_relative_difference
from torch import nn

import spread
import spread.memory
from spread.testing import launch_ranks, run_ranks

OPTIMIZERS = ["sgd_momentum", "adamw"]
STEPS = 10
TOLERANCE = 1e-5


def custom_loop(strategy, optimizer_name: str, *, init_seed: int = 0, die_at: int | None = None) -> dict:
    """The custom loop of a pipeline user: train_step replaces run(step_fn)."""
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = make_optimizer(optimizer_name, model)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, shuffle=True, seed=7)
    steps = 0
    while steps < STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            if isinstance(strategy, spread.PipelineStrategy):
                strategy.train_step(model, x, y, loss_fn)
            else:

                def step_fn(x, y):
                    loss_fn(model(x), y).backward()

                strategy.run(step_fn, args=(x, y))
            optimizer.step()
            steps += 1
            if steps == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if steps == STEPS:
                break
    if isinstance(strategy, spread.PipelineStrategy):
        return strategy.gather_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference() -> dict:
    return {name: custom_loop(spread.OneDeviceStrategy("cpu"), name) for name in OPTIMIZERS}


def _equivalence_worker(stages: int, replicas: int, schedules: list[str]) -> dict:
    rank = int(os.environ["RANK"])
    out = {}
    owner = None
    try:
        for label in schedules:
            schedule, _, extra = label.partition("+")  # "gpipe+checkpoint": per-stage checkpointing
            for name in OPTIMIZERS:
                strategy = spread.PipelineStrategy(
                    stages=stages,
                    microbatches=3,
                    schedule=schedule,
                    replicas=replicas,
                    checkpoint_stages=extra == "checkpoint",
                )
                owner = owner or strategy  # the first strategy owns the process group; later ones reuse it
                # Ranks start from different weights: rank 0's must win.
                out[(label, name)] = custom_loop(strategy, name, init_seed=rank * 101)
                assert spread.memory.is_checkpointed(strategy.stage_module) == (extra == "checkpoint")
                if strategy is not owner:
                    strategy.close()
        if replicas > 1:  # Trainer.fit, evaluate and predict on the hybrid layout too
            strategy = spread.PipelineStrategy(
                stages=stages, microbatches=2, replicas=replicas, schedule="zb"
            )
            out["trainer"] = _trainer_run(strategy)
            strategy.close()
    finally:
        if owner is not None:
            owner.close()
    return out


@pytest.mark.parametrize(
    ("stages", "replicas", "schedules"),
    [
        (2, 1, ["gpipe", "1f1b", "zb"]),
        (3, 1, ["1f1b", "gpipe+checkpoint", "zb"]),
        (2, 2, ["gpipe", "1f1b", "zb"]),
    ],
    ids=["2_stages", "3_stages", "hybrid_2x2"],
)
@pytest.mark.processes
def test_pipeline_equals_one_device(reference, stages, replicas, schedules):
    per_rank = run_ranks(
        _equivalence_worker, stages * replicas, args=(stages, replicas, schedules), timeout=300
    )
    for rank, results in enumerate(per_rank):
        if "trainer" in results:
            _check_trainer_result(rank, results.pop("trainer"), _trainer_run(spread.OneDeviceStrategy("cpu")))
        for (schedule, name), weights in results.items():
            diff = max_relative_difference(weights, reference[name])
            assert diff <= TOLERANCE, f"rank {rank}, {schedule}, {name}: max relative difference {diff:.2e}"


# -- Trainer, evaluate, predict, checkpoints ---------------------------------------------------------
def _trainer_run(strategy, ckpt_in: str | None = None) -> dict:
    torch.manual_seed(0)
    with strategy.scope():
        model = make_model(0)
        optimizer = make_optimizer("adamw", model)
    if ckpt_in is not None:  # a one-device checkpoint into the (pipelined) model
        model.load_state_dict(torch.load(ckpt_in, weights_only=True))
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, metrics=["accuracy"])
    x, y = make_data()
    val = (x[:50], y[:50])
    history = trainer.fit((x, y), epochs=2, global_batch_size=GLOBAL_BATCH, validation_data=val, verbose=0)
    evaluated = trainer.evaluate(val, global_batch_size=20)
    predicted = trainer.predict(x[:37], global_batch_size=16)
    gather = getattr(strategy, "gather_state_dict", None)
    state = gather(model) if gather is not None else {k: v.clone() for k, v in model.state_dict().items()}
    return {"history": history.history, "evaluate": evaluated, "predict": predicted, "state": state}


def _trainer_worker(path: str, one_device_ckpt: str) -> dict:
    strategy = spread.PipelineStrategy(stages=2, microbatches=3, schedule="1f1b")
    try:
        result = _trainer_run(strategy)
        if strategy.is_chief:
            torch.save(result["state"], path)
        # The reverse: a one-device checkpoint, loaded on every rank, evaluated through the pipeline.
        model = strategy._model
        model.load_state_dict(torch.load(one_device_ckpt, weights_only=True))
        trainer = spread.Trainer(
            model, make_optimizer("adamw", model), nn.CrossEntropyLoss(), strategy=strategy
        )
        x, y = make_data()
        result["reloaded_evaluate"] = trainer.evaluate((x, y), global_batch_size=64)
        result["too_many_stages"] = _too_many_stages()
        return result
    finally:
        strategy.close()


def _close(a: dict, b: dict, tol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol * max(1.0, abs(b[k])) for k in a)


def _check_trainer_result(rank: int, got: dict, ref: dict) -> None:
    for key, values in ref["history"].items():
        assert got["history"][key] == pytest.approx(values, rel=1e-5), (rank, key)
    assert _close(got["evaluate"], ref["evaluate"]), (rank, got["evaluate"], ref["evaluate"])
    torch.testing.assert_close(got["predict"], ref["predict"], rtol=1e-5, atol=1e-6)
    assert max_relative_difference(got["state"], ref["state"]) <= TOLERANCE


@pytest.fixture(scope="module")
def trainer_job(tmp_path_factory) -> tuple[dict, list[dict], Path]:
    """One 2-stage job for the Trainer, checkpoint and argument tests: (reference, per rank, ckpt)."""
    tmp_path = tmp_path_factory.mktemp("pipeline_trainer")
    ref = _trainer_run(spread.OneDeviceStrategy("cpu"))
    one_device_ckpt = tmp_path / "one_device.pt"
    torch.save(ref["state"], one_device_ckpt)
    pipeline_ckpt = tmp_path / "pipeline.pt"
    per_rank = run_ranks(_trainer_worker, 2, args=(str(pipeline_ckpt), str(one_device_ckpt)), timeout=240)
    return ref, per_rank, pipeline_ckpt


@pytest.mark.processes
def test_trainer_fit_evaluate_predict_and_checkpoints(trainer_job):
    ref, per_rank, pipeline_ckpt = trainer_job
    for rank, got in enumerate(per_rank):
        _check_trainer_result(rank, got, ref)
    # A pipeline checkpoint loads into a one-device model (original keys) and gives its outputs.
    model = make_model(5)
    model.load_state_dict(torch.load(pipeline_ckpt, weights_only=True))
    x, _ = make_data()
    with torch.no_grad():
        torch.testing.assert_close(model(x[:37]), ref["predict"], rtol=1e-5, atol=1e-6)
    # ... and a one-device checkpoint evaluated through the pipeline equals one device.
    reference_model = make_model(5)
    reference_model.load_state_dict(ref["state"])
    one = spread.Trainer(reference_model, make_optimizer("adamw", reference_model), nn.CrossEntropyLoss())
    expected = one.evaluate(make_data(), global_batch_size=64)
    for got in per_rank:
        assert _close(got["reloaded_evaluate"], expected)


# -- a dying stage (RELIABILITY.md P6) ---------------------------------------------------------------
def _dying_worker(victim: int) -> None:
    strategy = spread.PipelineStrategy(stages=3, microbatches=4, schedule="1f1b")
    try:
        custom_loop(strategy, "sgd_momentum", die_at=3 if strategy.rank == victim else None)
    finally:
        strategy.close()


@pytest.mark.parametrize("victim", [2, 0])  # 2: the first stage hears of it two hops away
@pytest.mark.processes
def test_a_killed_stage_is_named_by_every_other_stage(victim):
    # The collective deadline is long (120 s) and the harness gives survivors 45 s after the first
    # death: passing proves the survivors noticed the death itself, not a timeout.
    results = launch_ranks(
        _dying_worker, 3, args=(victim,), timeout=240, collective_timeout=120, fail_fast_grace=45
    )
    assert results[victim].exitcode == -signal.SIGKILL
    for r in results:
        if r.rank == victim:
            continue
        assert not r.timed_out, f"rank {r.rank} still running at the deadline"
        assert r.error is not None and r.error.startswith("PipelineStageError"), r.describe()
        assert f"stage {victim} (rank {victim}) died or stopped responding" in r.error, r.error
        assert r.exitcode not in (None, 0)


# -- bad arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 0}, "stages must be a positive integer"),
        ({"stages": 2, "microbatches": 0}, r"M >= 1"),
        ({"stages": 2, "schedule": "zigzag"}, "schedule must be one of"),
        ({"stages": 2, "schedule": "zb", "checkpoint_stages": True}, "does not combine with checkpoint"),
        ({"stages": 2, "replicas": 0}, "replicas must be a positive integer"),
        ({"stages": 3, "split_points": [2]}, "split_points must be stages-1=2"),
        ({"stages": 2, "split_points": [0]}, "strictly increasing"),
        ({"stages": 2, "balance_by": "flops"}, "balance_by must be one of"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        spread.PipelineStrategy(**kwargs)


def test_the_job_must_have_stages_times_replicas_processes(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        ValueError, match=r"needs 4 processes, but the job has 1; launch it with `spread run -n 4`"
    ):
        spread.PipelineStrategy(stages=2, replicas=2)


def _too_many_stages() -> str:
    """Every rank raises the same ValueError before any of them waits in a collective (a second
    strategy on the owner's process group)."""
    strategy = spread.PipelineStrategy(stages=2, microbatches=2)
    try:
        model = nn.Sequential(nn.Linear(4, 2))  # one layer, two stages
        try:
            strategy.train_step(model, torch.randn(4, 4), torch.randn(4, 2), nn.MSELoss())
        except ValueError as exc:
            return str(exc)
        return "no error"
    finally:
        strategy.close()


@pytest.mark.processes
def test_more_stages_than_layers_is_a_clear_error(trainer_job):
    _, per_rank, _ = trainer_job
    assert all("stages=2 is more than the model's 1 layers" in r["too_many_stages"] for r in per_rank)


def test_training_through_model_call_is_refused_with_guidance():
    strategy = spread.PipelineStrategy.__new__(spread.PipelineStrategy)  # no process group needed
    with pytest.raises(spread.errors.SpreadError, match="inference only"):
        strategy._pipelined_forward(lambda x: x, torch.randn(2, 2))


# -- under `spread run` --------------------------------------------------------------------------------
@pytest.mark.processes
def test_example_under_spread_run_trains_and_reloads_in_one_process():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    argv = [str(Path(sys.executable).parent / "spread"), "run", "-n", "2", "examples/pipeline.py"]
    out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    match = re.search(r"val_accuracy (\S+); reloaded in one process: (\S+)", out.stdout)
    assert match, out.stdout[-3000:]
    assert float(match.group(1)) >= 0.95
    assert match.group(1) == match.group(2)
