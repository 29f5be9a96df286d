"""Server-side optimizers equal torch.optim on dense gradients, and row updates touch only their rows."""

from __future__ import annotations

import pytest
import torch

from spread.ps.optimizers import ServerOptimizer, spec_from_torch

CASES = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]


@pytest.mark.parametrize(("cls", "kwargs"), CASES)
def test_dense_updates_equal_torch_optim(cls, kwargs):
    torch.manual_seed(0)
    start = torch.randn(6, 5)
    reference = torch.nn.Parameter(start.clone())
    opt = cls([reference], **kwargs)
    server = ServerOptimizer(spec_from_torch(opt))
    mine = start.clone()
    for _ in range(5):
        grad = torch.randn(6, 5)
        reference.grad = grad.clone()
        opt.step()
        server.apply_dense("w", mine, grad, server.spec)
    assert torch.equal(mine, reference.detach())


@pytest.mark.parametrize(
    ("cls", "kwargs"), [(torch.optim.SGD, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01})]
)
def test_row_updates_equal_dense_when_untouched_rows_stay(cls, kwargs):
    """SGD and Adagrad without weight decay: a zero gradient does not move a row (lazy == dense)."""
    torch.manual_seed(1)
    start = torch.randn(10, 3)
    dense, rows_version = start.clone(), start.clone()
    spec = spec_from_torch(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs))
    a, b = ServerOptimizer(spec), ServerOptimizer(spec)
    for _ in range(4):
        rows = torch.tensor([1, 4, 7])
        g = torch.randn(3, 3)
        full = torch.zeros(10, 3)
        full[rows] = g
        a.apply_dense("w", dense, full, spec)
        b.apply_rows("w", rows_version, rows, g, spec)
    assert torch.allclose(dense, rows_version, rtol=1e-6, atol=1e-7)
    assert torch.equal(rows_version[0], start[0])


def test_adam_rows_are_lazy():
    spec = spec_from_torch(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    opt = ServerOptimizer(spec)
    w = torch.zeros(5, 2)
    opt.apply_rows("w", w, torch.tensor([0, 3]), torch.ones(2, 2), spec)
    opt.apply_rows("w", w, torch.tensor([3]), torch.ones(1, 2), spec)
    assert torch.equal(w[[1, 2, 4]], torch.zeros(3, 2))
    assert (w[[0, 3]] < 0).all()


def test_unsupported_optimizers_are_refused_by_name():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="RMSprop"):
        spec_from_torch(torch.optim.RMSprop(p))
    with pytest.raises(ValueError, match="amsgrad"):
        spec_from_torch(torch.optim.Adam(p, amsgrad=True))
