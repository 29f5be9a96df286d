"""Gradient clipping arithmetic shared by the strategies: local norms, the clip coefficient.

The global norm of a model whose gradient is spread over processes (pipeline stages) is the square
root of the summed squared norms of the parts; each strategy sums the parts over whatever holds them
(:meth:`spread.strategies.Strategy.clip_gradients`). The arithmetic here is torch's
(``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_``: coefficient
``max_norm / (norm + 1e-6)``, at most 1), so one device's result equals ``clip_grad_norm_``'s. Sparse
gradients (``nn.Embedding(sparse=True)``), which torch's functions refuse, count by their values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def _grads(params: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    dense: list[torch.Tensor] = []
    sparse: list[torch.Tensor] = []
    for p in params:
        if p.grad is not None:
            (sparse if p.grad.is_sparse else dense).append(p.grad)
    return dense, sparse


def local_norm(params: Iterable[nn.Parameter], device: torch.device) -> torch.Tensor:
    """L2 norm (float32, 0-dim, on ``device``) of the gradients this process holds for ``params``."""
    dense, sparse = _grads(params)
    norms = [get_total_norm(dense).to(device, torch.float32)] if dense else []
    norms += [g.coalesce().values().float().norm().to(device) for g in sparse]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def scale_by_norm(params: Iterable[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Multiply every gradient by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's rule)."""
    dense_params: list[nn.Parameter] = []
    sparse: list[nn.Parameter] = []
    for p in params:
        if p.grad is not None:
            (sparse if p.grad.is_sparse else dense_params).append(p)
    if dense_params:
        clip_grads_with_norm_(dense_params, max_norm, total_norm)
    if sparse:
        coef = torch.clamp(max_norm / (total_norm + EPS), max=1.0)
        for p in sparse:
            assert p.grad is not None
            p.grad.mul_(coef.to(p.grad.device))


def clamp_values(params: Iterable[nn.Parameter], max_value: float) -> None:
    """Clip every gradient element to ``[-max_value, max_value]`` (``clip_grad_value_``)."""
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            g = p.grad.coalesce()
            values = g.values().clamp(-max_value, max_value)
            p.grad = torch.sparse_coo_tensor(
                g.indices(), values, g.shape, is_coalesced=True, check_invariants=False
            )
        else:
            p.grad.clamp_(-max_value, max_value)


def clip_by_norm(
    params: Sequence[nn.Parameter], norm: torch.Tensor, max_norm: float | None, max_value: float | None
) -> torch.Tensor:
    """Scale ``params``' gradients by ``norm`` (their whole model's global norm) to ``max_norm``, then
    clamp each element to ``max_value`` (each where given); returns ``norm``."""
    if max_norm is not None:
        scale_by_norm(params, max_norm, norm)
    if max_value is not None:
        clamp_values(params, max_value)
    return norm
