"""``torch.compile``d models under every strategy: equal to one eager device on the same global batch
(custom loop and ``Trainer.fit``), or refused with what to do (a pipeline of a model compiled whole)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from _equivalence_cases import (
    GLOBAL_BATCH,
    STEPS,
    make_data,
    make_model,
    make_optimizer,
    max_relative_difference,
)
from torch import nn

import spread
from spread.testing import run_ps_job, run_ranks

TOLERANCE = 1e-5  # inductor's fused kernels round differently from eager's, well within this
EPOCHS = 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no graph compiled by an earlier test (for another model) is reused
    yield
    torch._dynamo.reset()


def custom_loop(strategy, *, compiled: bool = True, init_seed: int = 0, model_fn=make_model) -> dict:
    """The user's loop with the model compiled after the scope (the usual place)."""
    with strategy.scope():
        model = model_fn(init_seed)
        optimizer = make_optimizer("sgd_momentum", model)
    run_model = torch.compile(model) if compiled else model
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, shuffle=True, seed=7)

    def step_fn(x, y):
        loss = loss_fn(run_model(x), y)
        loss.backward()
        return loss

    steps = 0
    while steps < STEPS:
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(step_fn, args=(x, y))
            optimizer.step()
            steps += 1
            if steps == STEPS:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(strategy, *, compiled: bool = True, init_seed: int = 0) -> dict:
    """``Trainer.fit`` on a model compiled inside the scope; weights by the uncompiled module's keys."""
    with strategy.scope():
        model = make_model(init_seed)
        optimizer = make_optimizer("sgd_momentum", model)
        run_model = torch.compile(model) if compiled else model
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainer = spread.Trainer(run_model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
    history = trainer.fit(make_data(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, seed=7, verbose=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"weights": weights, "initial": initial, "loss": history.history["loss"]}


@pytest.fixture(scope="module")
def reference() -> dict:
    """One device, eager."""
    one = spread.OneDeviceStrategy("cpu")
    return {"loop": custom_loop(one, compiled=False), "fit": fit(one, compiled=False)}


def _assert_fit_equal(got: dict, ref: dict, who: str) -> None:
    diff = max_relative_difference(got["weights"], ref["weights"])
    assert diff <= TOLERANCE, f"{who}: max relative weight difference {diff:.2e}"
    assert got["loss"] == pytest.approx(ref["loss"], rel=TOLERANCE), who


# -- one process ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_device_compiled_equals_eager(reference):
    one = spread.OneDeviceStrategy("cpu")
    assert max_relative_difference(custom_loop(one), reference["loop"]) <= TOLERANCE
    _assert_fit_equal(fit(one), reference["fit"], "OneDevice")


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: spread.MirroredStrategy(num_replicas=3, intra_op_threads=1),
        lambda: spread.MirroredStrategy(num_replicas=2, intra_op_threads=1, cross_device_ops="reduce_to_one"),
        lambda: spread.CentralStorageStrategy(num_replicas=2, intra_op_threads=1),
    ],
    ids=["mirrored", "mirrored_reduce_to_one", "central_storage"],
)
def test_thread_replicas_run_one_compiled_model_and_equal_one_device(reference, make):
    # The replicas' threads call the one compiled model at once; dynamo compiles under its own lock.
    strategy = make()
    try:
        diff = max_relative_difference(custom_loop(strategy), reference["loop"])
        assert diff <= TOLERANCE, f"custom loop: {diff:.2e}"
        _assert_fit_equal(fit(strategy), reference["fit"], type(strategy).__name__)
    finally:
        strategy.close()


# -- MultiWorkerMirrored -------------------------------------------------------------------------------
def _wide_model(seed: int) -> nn.Module:
    """Three ~1 MB layers in front of the usual 3 classes: with 1 MB buckets, the graph is cut."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(10, 512), nn.Tanh(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
        nn.Linear(512, 3),
    )  # fmt: skip


def _compiled_nodes(strategy, model_seed: int) -> int:
    """How many compiled backward nodes a loss of a model compiled inside ``run`` has."""
    with strategy.scope():
        model = _wide_model(model_seed)
    compiled = torch.compile(model)
    x, y = make_data()

    def count(x, y):
        loss = nn.functional.cross_entropy(compiled(x[:8]), y[:8])
        seen, stack, nodes = set(), [loss.grad_fn], 0
        while stack:
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                nodes += "CompiledFunctionBackward" in node.name()
                stack.extend(n for n, _ in node.next_functions)
        loss.backward()
        return nodes

    return strategy.run(count, args=(x, y))


def _mwms_worker() -> dict:
    rank = int(os.environ["RANK"])
    owner = spread.MultiWorkerMirroredStrategy()  # owns the process group; closed last
    try:
        out = {
            "loop": custom_loop(owner, init_seed=rank * 101),
            "fit": fit(owner, init_seed=rank * 101),
        }
        torch._dynamo.reset()  # the wide model's graphs compile afresh, inside the 1 MB strategy's run
        # gloo's own all-reduce runs while backward computes (shm's waits for wait(): no cut there)
        cut = spread.MultiWorkerMirroredStrategy("native", bucket_cap_mb=1.0)
        try:
            out["nodes"] = _compiled_nodes(cut, rank * 101)
            out["cut_loop"] = custom_loop(cut, init_seed=rank * 101, model_fn=_wide_model)
        finally:
            cut.close()
        # Where nothing can overlap, the graph stays whole (cutting would only cost fusion).
        for name, (communication, cap_mb) in {"one_bucket": ("native", 25.0), "shm": ("shm", 1.0)}.items():
            torch._dynamo.reset()
            other = spread.MultiWorkerMirroredStrategy(communication, bucket_cap_mb=cap_mb)
            try:
                out[f"nodes_{name}"] = _compiled_nodes(other, rank * 101)
            finally:
                other.close()
        return out
    finally:
        owner.close()


@pytest.mark.processes
def test_multi_worker_mirrored_compiled_equals_one_device_with_the_graph_cut_at_buckets(reference):
    wide_reference = custom_loop(spread.OneDeviceStrategy("cpu"), compiled=False, model_fn=_wide_model)
    for rank, got in enumerate(run_ranks(_mwms_worker, 2, timeout=420)):
        diff = max_relative_difference(got["loop"], reference["loop"])
        assert diff <= TOLERANCE, f"rank {rank}, custom loop: {diff:.2e}"
        _assert_fit_equal(got["fit"], reference["fit"], f"rank {rank}, fit")
        assert got["nodes"] >= 2, f"rank {rank}: the compiled graph was not cut ({got['nodes']} node)"
        assert got["nodes_one_bucket"] == 1, f"rank {rank}: one bucket, yet the graph was cut"
        assert got["nodes_shm"] == 1, f"rank {rank}: shm overlaps nothing, yet the graph was cut"
        diff = max_relative_difference(got["cut_loop"], wide_reference)
        assert diff <= TOLERANCE, f"rank {rank}, cut graph: {diff:.2e}"


# -- parameter servers ---------------------------------------------------------------------------------
def _ps_rank() -> int:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return 0 if task["type"] == "chief" else task["index"] + 1


def _ps_worker(mode: str) -> dict:
    strategy = spread.ParameterServerStrategy(mode=mode)
    try:
        return {**fit(strategy, init_seed=_ps_rank() * 101), "steps": strategy.local_step}
    finally:
        strategy.close()


@pytest.mark.processes
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parameter_servers_train_a_compiled_model(reference, mode):
    results = run_ps_job(_ps_worker, 2, 1, args=(mode,), timeout=300)
    assert all(r.ok for r in results), "\n".join(r.describe() for r in results if not r.ok)
    for rank in (0, 1):
        got = results[rank].value
        if mode == "sync":  # weights only: a task's logs are its own
            diff = max_relative_difference(got["weights"], reference["fit"]["weights"])
            assert diff <= TOLERANCE, f"rank {rank}: {diff:.2e}"
        else:  # asynchronous: no reference; every step of this task went through the compiled model
            assert got["steps"] == EPOCHS * 10
            for name, value in got["weights"].items():
                assert torch.isfinite(value).all(), name
                assert not torch.equal(value, got["initial"][name]), f"rank {rank}: {name} never moved"


# -- pipelines -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["torch.compile", "module.compile()"])
def test_a_pipeline_refuses_a_model_compiled_whole_and_says_what_to_do(how, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    model = make_model()
    if how == "torch.compile":
        model = torch.compile(model)
    else:
        model.compile()
    strategy = spread.PipelineStrategy(stages=1, microbatches=2)
    try:
        expected = re.escape(f"compiled as a whole ({how})") + r".*layer\.compile\(\)"
        with pytest.raises(TypeError, match=expected):
            strategy.prepare_model(model)
    finally:
        strategy.close()


def _pipeline_worker(schedule: str, replicas: int) -> dict:
    rank = int(os.environ["RANK"])
    strategy = spread.PipelineStrategy(stages=2, microbatches=3, schedule=schedule, replicas=replicas)
    try:
        with strategy.scope():
            model = make_model(rank * 101)
            optimizer = make_optimizer("sgd_momentum", model)
        for layer in model:
            layer.compile()  # each stage runs its own layers compiled
        trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy)
        history = trainer.fit(make_data(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, seed=7, verbose=0)
        weights = strategy.full_state_dict(model)  # collective: the one-device layout
        return {"weights": {k: v.clone() for k, v in weights.items()}, "loss": history.history["loss"]}
    finally:
        strategy.close()


@pytest.mark.processes
@pytest.mark.parametrize(
    ("schedule", "replicas"), [("1f1b", 1), ("zb", 1), ("1f1b", 2)], ids=["1f1b", "zb", "hybrid"]
)
def test_a_pipeline_of_layers_compiled_in_place_equals_one_device(reference, schedule, replicas):
    """Hybrid: 2 stages x 2 pipeline replicas, the replicas' gradients all-reduced per stage."""
    ranks = run_ranks(_pipeline_worker, 2 * replicas, args=(schedule, replicas), timeout=420)
    for rank, got in enumerate(ranks):
        _assert_fit_equal(got, reference["fit"], f"rank {rank}, {schedule}, {replicas} replica(s)")
