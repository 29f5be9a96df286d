"""Gradient clipping: the arithmetic is torch's (clip_grad_norm_, clip_grad_value_), sparse gradients
count, the Trainer's clip equals a hand-written one-device loop, bad values and non-finite norms are
handled by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spread
from spread.errors import NonFiniteLossError
from spread.strategies.clipping import clamp_values, local_norm, scale_by_norm


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model(torch.randn(9, 5)).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_norm_and_scaling_equal_clip_grad_norm(max_norm):
    ours, theirs = _model_with_grads(), _model_with_grads()
    norm = local_norm(list(ours.parameters()), torch.device("cpu"))
    scale_by_norm(list(ours.parameters()), max_norm, norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert torch.equal(norm, expected)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_value_clipping_equals_clip_grad_value():
    ours, theirs = _model_with_grads(), _model_with_grads()
    clamp_values(list(ours.parameters()), 0.05)
    torch.nn.utils.clip_grad_value_(theirs.parameters(), 0.05)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_sparse_gradients_count_by_their_values():
    torch.manual_seed(0)
    sparse, dense = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4)
    dense.weight.data.copy_(sparse.weight.data)
    ids = torch.tensor([1, 3, 3, 7])
    for table in (sparse, dense):
        (table(ids) * torch.arange(16.0).view(4, 4)).sum().backward()
    norm = local_norm([sparse.weight], torch.device("cpu"))
    assert torch.allclose(norm, dense.weight.grad.norm())
    scale_by_norm([sparse.weight], 1.0, norm)
    clamp_values([sparse.weight], 0.1)
    expected = dense.weight.grad * (1.0 / (norm + 1e-6))
    assert torch.allclose(sparse.weight.grad.to_dense(), expected.clamp(-0.1, 0.1))


def test_no_gradients_have_norm_zero():
    assert float(local_norm([nn.Parameter(torch.ones(3))], torch.device("cpu"))) == 0.0


def _data():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(36, 5, generator=g)
    return x, (x[:, 0] > 0).long()


def test_trainer_clipping_equals_a_one_device_loop_with_clip_grad_norm():
    x, y = _data()
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for i in range(0, 36, 12):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 12]), y[i : i + 12]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)))
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        optimizer.step()

    torch.manual_seed(1)
    ours = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    trainer = spread.Trainer(
        ours,
        torch.optim.SGD(ours.parameters(), lr=0.5),
        nn.CrossEntropyLoss(),
        clip_grad_norm=0.2,
        clip_grad_value=0.05,
    )
    logged = []

    class Norms(spread.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            logged.append(logs["grad_norm"])

    history = trainer.fit(
        (x, y), epochs=1, global_batch_size=12, shuffle=False, verbose=0, callbacks=[Norms()]
    )
    assert logged == norms and max(norms) > 0.2  # it did clip
    assert history.history["grad_norm"] == pytest.approx([sum(norms) / 3])
    for a, b in zip(ours.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


class _InfGrad(nn.Module):
    """Identity forward, infinite gradient backward: a finite loss with a non-finite gradient."""

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(lambda g: torch.full_like(g, float("inf")))
        return x


def test_a_non_finite_gradient_norm_follows_on_nonfinite():
    def build(policy):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4), _InfGrad(), nn.Linear(4, 2))
        return spread.Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            clip_grad_norm=1.0,
            on_nonfinite=policy,
        )

    with pytest.raises(NonFiniteLossError, match="non-finite gradient norm"):
        build("raise").fit(_data(), epochs=1, global_batch_size=12, verbose=0)
    trainer = build("skip_step")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.fit(_data(), epochs=1, global_batch_size=12, verbose=0)
    assert (trainer.skipped_steps, trainer.global_step) == (3, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


@pytest.mark.parametrize("field", ["clip_grad_norm", "clip_grad_value"])
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "1", True])
def test_bad_clip_values_are_refused_by_name(field, bad):
    with pytest.raises(ValueError, match=f"{field} must be None or a positive finite number"):
        spread.Trainer(
            nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters()), nn.MSELoss(), **{field: bad}
        )
