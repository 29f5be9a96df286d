"""MirroredStrategy's cross_device_ops: every algorithm gives the weights of one device, handles
unused parameters like autograd does, and leaves plain backward passes outside ``run`` alone."""

from __future__ import annotations

import threading

import pytest
import torch
from _equivalence_cases import max_relative_difference, train_custom_loop
from torch import nn

import spread
from spread.errors import SpreadError

TOLERANCE = 1e-5
CROSS_DEVICE_OPS = ["accumulate", "reduce_to_one", "hierarchical_copy"]


@pytest.fixture(scope="module")
def reference() -> dict:
    return {
        name: train_custom_loop(spread.OneDeviceStrategy("cpu"), name) for name in ("sgd_momentum", "adamw")
    }


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("cross_device_ops", CROSS_DEVICE_OPS)
@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw"])
def test_every_cross_device_op_equals_one_device(reference, replicas, cross_device_ops, optimizer_name):
    strategy = spread.MirroredStrategy(
        num_replicas=replicas, cross_device_ops=cross_device_ops, intra_op_threads=1
    )
    try:
        weights = train_custom_loop(strategy, optimizer_name)
    finally:
        strategy.close()
    assert max_relative_difference(weights, reference[optimizer_name]) <= TOLERANCE


@pytest.mark.parametrize("cross_device_ops", CROSS_DEVICE_OPS)
def test_replicas_whose_backward_runs_on_another_thread_run_one_at_a_time(reference, cross_device_ops):
    """Replicas on an accelerator run one after another so the gradient hooks, on the device's
    thread, still know whose gradient they weigh; simulated here by a backward on its own thread."""
    strategy = spread.MirroredStrategy(num_replicas=2, cross_device_ops=cross_device_ops, intra_op_threads=1)
    strategy._one_at_a_time = True  # what a GPU device sets; the pool stays unused
    real_backward = torch.Tensor.backward

    def backward_elsewhere(loss, *args, **kwargs):
        error = []
        thread = threading.Thread(target=lambda: _capture(error, real_backward, loss, *args, **kwargs))
        thread.start()
        thread.join()
        if error:
            raise error[0]

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "backward", backward_elsewhere)
            weights = train_custom_loop(strategy, "adamw")
    finally:
        strategy.close()
    assert max_relative_difference(weights, reference["adamw"]) <= TOLERANCE


def _capture(errors: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException as exc:
        errors.append(exc)


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head_a = nn.Linear(4, 1)
        self.head_b = nn.Linear(4, 1)
        self.never = nn.Linear(4, 1)

    def forward(self, x, use_b):
        h = self.body(x)
        return self.head_a(h) + self.head_b(h) if use_b else self.head_a(h)


def _grads_after_steps(cross_device_ops: str) -> list[dict]:
    """Replica 0 alone uses head_b; a second run accumulates; a plain backward outside run adds."""
    strategy = spread.MirroredStrategy(num_replicas=2, cross_device_ops=cross_device_ops, intra_op_threads=1)
    try:
        torch.manual_seed(0)
        with strategy.scope():
            model = TwoHeads()
        x = torch.arange(16.0).view(4, 4) / 10
        dataset = strategy.distribute_dataset((x,), 4, shuffle=False)
        (batch,) = next(iter(dataset))

        def step(xb):
            ctx = spread.get_replica_context()
            model(xb, use_b=ctx.replica_id_in_sync_group == 0).sum().backward()

        snapshots = []
        strategy.run(step, args=(batch,))
        snapshots.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        strategy.run(step, args=(batch,))  # no zero_grad: accumulates
        snapshots.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        model(x, use_b=True).sum().backward()  # outside run: a plain local backward
        snapshots.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        return snapshots
    finally:
        strategy.close()


@pytest.mark.parametrize("cross_device_ops", ["reduce_to_one", "hierarchical_copy"])
def test_unused_parameters_accumulation_and_plain_backward_match_accumulate(cross_device_ops):
    expected = _grads_after_steps("accumulate")
    got = _grads_after_steps(cross_device_ops)
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        for name in want:
            if want[name] is None:
                assert have[name] is None, f"step {step}: {name} should have no gradient"
            else:
                assert torch.allclose(have[name], want[name], rtol=1e-6, atol=1e-7), f"step {step}: {name}"
    assert expected[0]["never.weight"] is None and expected[0]["head_b.weight"] is not None


def test_unknown_cross_device_ops_is_refused():
    with pytest.raises(ValueError, match="hierarchical_copy"):
        spread.MirroredStrategy(num_replicas=2, cross_device_ops="nccl_all_reduce")


def test_sparse_gradients_are_refused_with_the_way_out():
    strategy = spread.MirroredStrategy(num_replicas=2, cross_device_ops="reduce_to_one", intra_op_threads=1)
    try:
        with strategy.scope():
            table = nn.Embedding(10, 3, sparse=True)
        ids = strategy.distribute_dataset((torch.arange(4),), 4, shuffle=False)
        (batch,) = next(iter(ids))
        with pytest.raises(SpreadError, match="accumulate"):
            strategy.run(lambda i: table(i).sum().backward(), args=(batch,))
    finally:
        strategy.close()


@pytest.mark.parametrize("global_batch", [8, 7])  # 7 over 2 replicas: unequal shares
def test_accumulate_weights_fresh_and_accumulated_gradients_like_one_device(global_batch):
    """``accumulate`` weights the summed gradient once after the replicas when the shares are equal
    and every ``.grad`` was empty, else per replica as gradients arrive: both equal one device."""
    torch.manual_seed(0)
    reference = nn.Linear(3, 2)
    x = torch.randn(global_batch, 3)
    nn.functional.mse_loss(reference(x), torch.zeros(global_batch, 2)).backward()
    want = reference.weight.grad.clone()
    strategy = spread.MirroredStrategy(num_replicas=2, cross_device_ops="accumulate", intra_op_threads=1)
    try:
        with strategy.scope():
            model = nn.Linear(3, 2)
        model.load_state_dict(reference.state_dict())
        dataset = strategy.distribute_dataset((x,), global_batch, shuffle=False)

        def step(xb):
            nn.functional.mse_loss(model(xb), torch.zeros(xb.shape[0], 2)).backward()

        strategy.run(step, args=next(iter(dataset)))  # each batch carries its replicas' shares
        assert torch.allclose(model.weight.grad, want, rtol=1e-6, atol=1e-7)
        strategy.run(step, args=next(iter(dataset)))  # .grad is set: weighted per replica, added
        assert torch.allclose(model.weight.grad, 2 * want, rtol=1e-6, atol=1e-7)
    finally:
        strategy.close()
