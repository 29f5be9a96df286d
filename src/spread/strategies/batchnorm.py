"""BatchNorm over replicas: statistics of the global batch (``sync_batchnorm=True``), or one update
of the running statistics per step from every replica's batch (thread replicas, the default).

Why spread has its own: ``torch.nn.SyncBatchNorm`` refuses CPU tensors (it needs CUDA kernels such as
``batch_norm_gather_stats_with_counts``) and speaks only to a process group, not to replicas on
threads of one process. Here one autograd function serves every strategy; what differs is how a small
tensor is summed over the replicas (a :data:`SumOverReplicas`): an all-reduce on a process group, or
a rendezvous of the replica threads (:class:`ThreadReplicaSum`).

Forward: each replica computes its slice's per-channel mean and variance (one native pass) and
counts its elements; one exchange of ``[n * mean, n * (var + mean**2), n]`` (float64) gives every
replica the global mean and variance, which normalise its slice. Backward: the input gradient of
batch normalisation needs ``sum(g)`` and ``sum(g * x_hat)`` over the global batch, one more
exchange. A replica's loss is the mean over its own slice and the strategy weights its parameter
gradients by its share ``w_r = n_r / N``; the true gradient at a replica's output is therefore
``w_r`` times the one autograd hands it, and the input gradient returned is scaled back by ``1 /
w_r``, so that after the strategy's weighting every weight upstream gets exactly the gradient of one
device on the global batch. The affine parameters' gradients are the local sums; the strategy's
gradient exchange adds them up, as for any parameter.

Running statistics under ``sync_batchnorm``: updated from the global mean and (unbiased) variance,
the same on every replica, as one device would. Without it, on thread replicas (which share one
module, so their in-place updates would race and depend on thread order): each replica normalises
with its own slice's statistics and records them; after the step's replicas returned,
:meth:`BatchNormReplicas.apply_pending_updates` applies one update from the replicas' statistics
weighted by their shares, the same result :class:`~spread.comm.buffers.BufferAverager` gives for
replicas in separate processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from spread.errors import SpreadError
from spread.memory.forward_wrap import unwrap_forward, wrap_forward
from spread.strategies.context import get_replica_context

SumOverReplicas = Callable[[torch.Tensor, int], torch.Tensor]
"""``(tensor, replica_id) -> the elementwise sum of every replica's tensor``; collective, the same
result on every replica."""

_WRAP_KIND = "spread-batchnorm"


class ReplicaExchangeAborted(SpreadError):
    """A replica stopped waiting in :class:`ThreadReplicaSum` because another replica failed or did
    not come: the other replica's error is the one to report."""


class ThreadReplicaSum:
    """Sum a tensor over the replica threads of one process: each deposits its tensor, waits for the
    others, and adds them up in replica order (so every replica gets the same bits).

    A replica that fails calls :meth:`abort`, so the others stop waiting at once with an error
    instead of at the deadline.
    """

    def __init__(self, num_replicas: int, timeout: float) -> None:
        self._slots: list[torch.Tensor | None] = [None] * num_replicas
        self._barrier = threading.Barrier(num_replicas, timeout=timeout)
        self.timeout = timeout

    def __call__(self, tensor: torch.Tensor, replica_id: int) -> torch.Tensor:
        self._slots[replica_id] = tensor
        self._wait()
        total = torch.zeros_like(tensor)
        for slot in self._slots:
            assert slot is not None
            total.add_(slot)
        self._wait()  # nobody deposits the next exchange's tensor before everyone has read this one
        return total

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise ReplicaExchangeAborted(
                f"sync_batchnorm: a replica did not reach the BatchNorm statistics exchange within "
                f"{self.timeout:g} s (another replica failed, or the replicas ran different numbers of "
                "BatchNorm layers in training mode)"
            ) from None

    def abort(self) -> None:
        self._barrier.abort()

    def reset(self) -> None:
        """Ready for the next step (after an abort)."""
        self._barrier.reset()
        self._slots = [None] * len(self._slots)


class _SyncBatchNormFunction(torch.autograd.Function):
    """``y = (x - mean) * invstd * weight + bias`` with ``mean``/``var`` of the global batch.

    Portable operators only (``torch.batch_norm`` in inference form for the forward, a few
    elementwise passes for the backward): the fused kernels ``torch.nn.SyncBatchNorm`` uses
    (``batch_norm_stats``, ``batch_norm_backward_reduce``/``_elemt``) exist for CUDA only.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        var: torch.Tensor,
        eps: float,
        sum_over_replicas: SumOverReplicas,
        replica_id: int,
        share: float,
    ) -> torch.Tensor:
        # Under autocast a bf16/fp16 input meets float32 parameters: the statistics join them in
        # float32 (as torch's SyncBatchNorm does since pytorch/pytorch#96203); the output keeps x's dtype.
        mean_x, var_x = mean.to(_statistics_dtype(x, weight)), var.to(_statistics_dtype(x, weight))
        y = torch.batch_norm(x, weight, bias, mean_x, var_x, False, 0.0, eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(x, weight, mean, (var + eps).rsqrt())
        ctx.exchange = (sum_over_replicas, replica_id, share)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, weight, mean, invstd = ctx.saved_tensors
        sum_over_replicas, replica_id, share = ctx.exchange
        dims = _reduce_dims(grad_out)
        channels = grad_out.shape[1]
        sum_g = grad_out.sum(dims).double()
        # sum(g * x_hat) = invstd * (sum(g * x) - mean * sum(g))
        sum_gx_hat = invstd * ((grad_out * x).sum(dims).double() - mean * sum_g)
        # The true gradient at this replica's output is share * grad_out (see the module docstring).
        totals = sum_over_replicas(torch.cat([sum_g, sum_gx_hat]) * share, replica_id)
        grad_x = None
        n_local = grad_out.numel() // max(channels, 1)
        if ctx.needs_input_grad[0] and n_local > 0:
            # sum(g) / N divided by the share n_r / N is sum(g) / n_r; likewise for sum(g * x_hat).
            mean_g, mean_gx_hat = totals[:channels] / n_local, totals[channels:] / n_local
            k = invstd * weight.double() if weight is not None else invstd
            # grad_x = k * (g - mean_g - x_hat * mean_gx_hat), x_hat = (x - mean) * invstd,
            # as one per-channel affine map of g and x.
            c_x = -k * invstd * mean_gx_hat
            c_0 = k * (mean * invstd * mean_gx_hat - mean_g)
            shape = _channel_shape(grad_out)
            # In float32 at least (a bf16/fp16 gradient under autocast, scaled by fp16's loss scaler,
            # overflows in these products where the native kernel's float arithmetic does not).
            to = torch.promote_types(grad_out.dtype, torch.float32)
            grad_x = torch.addcmul(
                torch.addcmul(c_0.to(to).view(shape), x.to(to), c_x.to(to).view(shape)),
                grad_out.to(to),
                k.to(to).view(shape),
            ).to(grad_out.dtype)
        elif ctx.needs_input_grad[0]:
            grad_x = torch.zeros_like(grad_out)
        grad_w = sum_gx_hat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_g.to(grad_out.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _statistics_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """The dtype ``torch.batch_norm`` needs its mean and variance in: the parameters' where there are
    any, float32 for a reduced-precision input without them, else the input's."""
    if weight is not None:
        return weight.dtype
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def _batch_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and biased variance of ``x`` in float64 (one native pass; ``var_mean`` over
    the batch and spatial dimensions is several times slower on CPU)."""
    mean, var = torch.batch_norm_update_stats(x.detach(), None, None, 0.0)
    return mean.double(), var.double()


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _momentum_factor(module: _BatchNorm) -> float:
    """The weight of this batch in the running statistics (BatchNorm's own rule); advances the count."""
    assert module.num_batches_tracked is not None
    module.num_batches_tracked.add_(1)
    if module.momentum is None:  # cumulative moving average
        return 1.0 / float(module.num_batches_tracked)
    return float(module.momentum)


@torch.no_grad()
def _update_running(module: _BatchNorm, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
    factor = _momentum_factor(module)
    assert module.running_mean is not None and module.running_var is not None
    module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype), alpha=factor)
    module.running_var.mul_(1 - factor).add_(unbiased_var.to(module.running_var.dtype), alpha=factor)


def _uses_batch_statistics(module: _BatchNorm) -> bool:
    return module.training or (module.running_mean is None and module.running_var is None)


class BatchNormReplicas:
    """The BatchNorm layers a strategy manages, and how their forward runs inside ``strategy.run``.

    Args:
        owner: the strategy; its replica contexts switch the special forward on (elsewhere, and in
            eval mode with running statistics, the layers run as usual).
        sum_over_replicas: with ``sync_batchnorm``, how statistics are summed over the replicas;
            ``None``: each replica normalises with its own slice's statistics.
        shared_module: the replicas run one shared module on threads: running statistics are updated
            once, by replica 0 (synchronised), or after the step from every replica's
            (:meth:`apply_pending_updates`); otherwise each process updates its own copy.
    """

    def __init__(
        self, owner: object, sum_over_replicas: SumOverReplicas | None, *, shared_module: bool
    ) -> None:
        self.owner = owner
        self.sum_over_replicas = sum_over_replicas
        self.shared_module = shared_module
        self.modules: list[_BatchNorm] = []
        self._pending: dict[int, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._lock = threading.Lock()

    def add(self, modules: Sequence[nn.Module]) -> None:
        for module in modules:
            if isinstance(module, _BatchNorm) and wrap_forward(
                module, _WRAP_KIND, self._make_forward(module)
            ):
                self.modules.append(module)

    def close(self) -> None:
        for module in self.modules:
            unwrap_forward(module, _WRAP_KIND)
        self.modules.clear()
        self._pending.clear()

    def _make_forward(self, module: _BatchNorm) -> Callable[..., Any]:
        def forward(inner: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            ctx = get_replica_context()
            if ctx is None or ctx.strategy is not self.owner or not _uses_batch_statistics(module):
                return inner(x, *args, **kwargs)
            module._check_input_dim(x)
            if self.sum_over_replicas is not None:
                return self._synchronised(module, x, ctx.replica_id_in_sync_group, ctx.weight)
            if self.shared_module:
                return self._local_recorded(module, x, ctx.replica_id_in_sync_group)
            return inner(x, *args, **kwargs)

        return forward

    def _synchronised(
        self, module: _BatchNorm, x: torch.Tensor, replica_id: int, share: float
    ) -> torch.Tensor:
        assert self.sum_over_replicas is not None
        channels = x.shape[1]
        with torch.no_grad():
            n = x.numel() // max(channels, 1)
            if n > 0:
                mean_local, var_local = _batch_statistics(x)
            else:
                mean_local = var_local = x.new_zeros(channels, dtype=torch.float64)
            local = torch.cat(
                [mean_local * n, (var_local + mean_local.square()) * n, mean_local.new_tensor([n])]
            )
            totals = self.sum_over_replicas(local, replica_id)
            count = float(totals[-1])
            if count <= 1 and module.training:
                raise ValueError(
                    f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)} "
                    f"(global batch: {count:g} values per channel)"
                )
            mean = totals[:channels] / count
            var = (totals[channels : 2 * channels] / count - mean.square()).clamp_min(0)
        if module.training and module.track_running_stats and (not self.shared_module or replica_id == 0):
            _update_running(module, mean, var * (count / (count - 1)))
        return _SyncBatchNormFunction.apply(
            x, module.weight, module.bias, mean, var, module.eps, self.sum_over_replicas, replica_id, share
        )

    def _local_recorded(self, module: _BatchNorm, x: torch.Tensor, replica_id: int) -> torch.Tensor:
        """This replica's own statistics normalise its slice; the running update waits for the step."""
        if module.training and module.track_running_stats and x.shape[0] > 0:
            with torch.no_grad():
                n = x.numel() // max(x.shape[1], 1)
                mean, var = _batch_statistics(x)
                var = var * (n / (n - 1)) if n > 1 else torch.full_like(var, float("nan"))
            with self._lock:
                self._pending.setdefault(id(module), {}).setdefault(replica_id, []).append((mean, var))
        return F.batch_norm(x, None, None, module.weight, module.bias, True, 0.0, module.eps)

    def discard_pending(self) -> None:
        self._pending.clear()

    def apply_pending_updates(self, weights: Sequence[float]) -> None:
        """After a step's replicas returned (thread replicas, no ``sync_batchnorm``): update each
        layer's running statistics once per forward call, from the replicas' statistics weighted by
        their shares ``weights`` (renormalised over the replicas that made that call)."""
        by_id = {id(m): m for m in self.modules}
        for key, per_replica in self._pending.items():
            module = by_id[key]
            calls = max(len(v) for v in per_replica.values())
            for j in range(calls):
                present = [(r, v[j]) for r, v in sorted(per_replica.items()) if j < len(v)]
                total_weight = sum(weights[r] for r, _ in present)
                if total_weight <= 0:
                    total_weight, share = float(len(present)), [1.0] * len(present)
                else:
                    share = [weights[r] for r, _ in present]
                mean = sum(
                    s / total_weight * m.double() for s, (_, (m, _v)) in zip(share, present, strict=True)
                )
                var = sum(
                    s / total_weight * v.double() for s, (_, (_m, v)) in zip(share, present, strict=True)
                )
                assert isinstance(mean, torch.Tensor) and isinstance(var, torch.Tensor)
                _update_running(module, mean, var)
        self._pending.clear()
