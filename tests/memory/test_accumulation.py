"""Gradient accumulation gives the update of the whole global batch, with one exchange per step."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn

import spread
from spread.memory import checkpoint_blocks, micro_batches, offload_module, split_batch
from spread.testing import run_ranks

NUM_SAMPLES = 103  # 6 global batches of 16, then an uneven one of 7
GLOBAL_BATCH = 16
EPOCHS = 2
TOLERANCE = 1e-6


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(NUM_SAMPLES, 10, generator=g), torch.randint(0, 3, (NUM_SAMPLES,), generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def fit(strategy, accumulation_steps: int, memory_tools: bool = False) -> dict[str, torch.Tensor]:
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if memory_tools:  # checkpointing and offload compose with accumulation and the gradient exchange
        checkpoint_blocks(model, every=1)
        offload_module(model)
    trainer = spread.Trainer(
        model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, accumulation_steps=accumulation_steps
    )
    history = trainer.fit(make_data(), epochs=EPOCHS, global_batch_size=GLOBAL_BATCH, seed=5, verbose=0)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights["_loss"] = torch.tensor(history.history["loss"])
    return weights


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


@pytest.fixture(scope="module")
def reference() -> dict:
    return fit(spread.OneDeviceStrategy("cpu"), 1)


# -- splitting ----------------------------------------------------------------------------------------
def test_split_batch_sizes_differ_by_at_most_one_and_keep_structure():
    x, y = torch.arange(14).reshape(7, 2), torch.arange(7)
    parts = split_batch({"x": x, "y": y}, 3)
    assert [n for _, n in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), x)
    assert torch.equal(torch.cat([p["y"] for p, _ in parts]), y)
    assert [n for _, n in split_batch((x[:2], y[:2]), 4)] == [1, 1]  # fewer samples than steps
    assert [n for _, n in split_batch((x[:0], y[:0]), 4)] == [0]  # an empty replica batch


def test_split_batch_refuses_bad_input():
    with pytest.raises(ValueError, match="accumulation_steps"):
        split_batch(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="disagree"):
        split_batch((torch.zeros(4), torch.zeros(5)), 2)
    with pytest.raises(TypeError, match="tensor"):
        split_batch((torch.zeros(4), ["a", "b", "c", "d"]), 2)
    with pytest.raises(ValueError, match="accumulation_steps"):
        spread.Trainer(make_model(), None, nn.MSELoss(), accumulation_steps=0)


def test_only_the_last_micro_batch_backward_runs_outside_no_sync():
    class Recorder:
        def __init__(self) -> None:
            self.depth = 0

        @contextmanager
        def no_sync(self):
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1

    recorder = Recorder()
    w = torch.ones(1, requires_grad=True)
    depths, weights = [], []
    w.register_hook(lambda grad: depths.append(recorder.depth))
    for micro in micro_batches(torch.ones(10, 1), 4, strategy=recorder):
        assert recorder.depth == 0  # nothing is held between micro-batches
        weights.append(micro.weight)
        micro.backward((micro.data * w).mean())
    assert depths == [1, 1, 1, 0]  # the last micro-batch's backward exchanges
    assert weights == [3 / 10, 3 / 10, 2 / 10, 2 / 10]
    assert torch.allclose(w.grad, torch.ones(1))  # the weighted means add up to the whole batch's mean
    with pytest.raises(RuntimeError):  # an error inside backward leaves the strategy synchronising
        next(micro_batches(torch.ones(4, 1), 2, strategy=recorder)).backward(torch.ones(1))
    assert recorder.depth == 0


# -- equivalence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [2, 3, 16])
def test_one_device_accumulation_equals_the_whole_batch(reference, steps):
    # steps=3 splits 16 into 6+5+5 and the final 7 into 3+2+2; steps=16 leaves 7 single samples
    assert max_relative_difference(fit(spread.OneDeviceStrategy("cpu"), steps), reference) <= TOLERANCE


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_threaded_replicas_accumulation_equals_the_whole_batch(reference, name):
    strategy = spread.strategies.make_strategy(name, num_replicas=2, intra_op_threads=1)
    try:
        weights = fit(strategy, 3)
    finally:
        strategy.close()
    assert max_relative_difference(weights, reference) <= TOLERANCE


def _count_all_reduces():
    """Count torch.distributed.all_reduce calls in this process (the 'native' algorithm's path)."""
    import torch.distributed as dist

    original = dist.all_reduce
    counter = {"calls": 0}

    def counting(*args, **kwargs):
        counter["calls"] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    return counter


def _mwms_accumulation_worker() -> dict:
    counter = _count_all_reduces()
    owner = spread.MultiWorkerMirroredStrategy("native")  # owns the process group; the others reuse it
    out = {}
    try:
        for steps in (1, 3, "3+tools"):
            strategy = spread.MultiWorkerMirroredStrategy("native", bucket_cap_mb=0.0005)  # several buckets
            try:
                before = counter["calls"]
                out[steps] = fit(
                    strategy, 3 if steps == "3+tools" else steps, memory_tools=steps == "3+tools"
                )
                out[f"calls_{steps}"] = counter["calls"] - before
                out[f"exchanges_{steps}"] = strategy._reducer.reductions
                out["buckets"] = len(strategy._reducer.buckets)
            finally:
                strategy.close()
    finally:
        owner.close()
    return out


@pytest.mark.processes
def test_multi_worker_mirrored_accumulation_equals_the_whole_batch_with_one_exchange_per_step(reference):
    per_rank = run_ranks(_mwms_accumulation_worker, 2, timeout=240)
    optimizer_steps = EPOCHS * 7
    for rank, out in enumerate(per_rank):
        for config in (3, "3+tools"):
            diff = max_relative_difference(out[config], reference)
            assert diff <= TOLERANCE, f"rank {rank}, {config}: max relative difference {diff:.2e}"
        assert out["buckets"] > 1
        assert out["exchanges_3"] == out["exchanges_1"] == optimizer_steps
        # identical all-reduce traffic with and without accumulation: nothing on the non-final micro-steps
        assert out["calls_3"] == out["calls_1"] == out["calls_3+tools"]
        assert out["calls_3"] >= optimizer_steps * out["buckets"]


def _custom_loop(strategy, steps: int) -> dict[str, torch.Tensor]:
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    dataset = strategy.distribute_dataset(make_data(), GLOBAL_BATCH, seed=5)

    def train_step(x, y):
        for micro in micro_batches((x, y), steps, strategy=strategy):
            mx, my = micro.data
            micro.backward(loss_fn(model(mx), my))

    for _ in range(EPOCHS):
        for x, y in dataset:
            optimizer.zero_grad()
            strategy.run(train_step, args=(x, y))
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mwms_custom_loop_worker() -> dict:
    counter = _count_all_reduces()
    strategy = spread.MultiWorkerMirroredStrategy("native")
    try:
        weights = _custom_loop(strategy, 4)
        return {"weights": weights, "calls": counter["calls"], "exchanges": strategy._reducer.reductions}
    finally:
        strategy.close()


@pytest.mark.processes
def test_custom_loop_accumulation_equals_the_whole_batch(reference):
    expected = {k: v for k, v in reference.items() if k != "_loss"}
    one = _custom_loop(spread.OneDeviceStrategy("cpu"), 4)
    assert max_relative_difference(one, expected) <= TOLERANCE
    for rank, out in enumerate(run_ranks(_mwms_custom_loop_worker, 2, timeout=240)):
        assert max_relative_difference(out["weights"], expected) <= TOLERANCE, f"rank {rank}"
        assert out["exchanges"] == EPOCHS * 7  # one per optimizer step, not one per micro-batch
