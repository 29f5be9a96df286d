"""The strategy contract every strategy implements, and the parts they share.

A strategy answers three questions for a training script: where do variables live and how are they
kept in sync (``scope``), how is a step run on every replica (``run``), and how are per-replica
values combined (``reduce``, ``gather``). It composes the lower layers (cluster, comm, data) and owns
no sockets of its own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from spread.data import DistributedDataset, ReplicaLayout, ShardPolicy, StepInfo
from spread.strategies.context import _pop_scope, _push_scope
from spread.strategies.teardown import ProcessResources
from spread.values import PerReplica

REDUCE_OPS = ("sum", "mean")


def check_reduce_op(op: str) -> str:
    op = str(op).lower()
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")
    return op


def one_replica_tensor(value: Any, device: torch.device) -> torch.Tensor:
    """The value of a process that drives one replica, as a tensor on ``device``.

    A one-value ``PerReplica`` is unwrapped; a tensor already on ``device`` is returned as is.
    """
    if isinstance(value, PerReplica):
        (value,) = value.values
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return torch.as_tensor(value, device=device)


def reduce_locally(op: str, value: Any, axis: int | None, device: torch.device) -> torch.Tensor:
    """``reduce`` when this process's replica is the only one it combines (nothing crosses processes)."""
    op = check_reduce_op(op)
    tensor = one_replica_tensor(value, device)
    if axis is None:
        return tensor
    return tensor.sum(dim=axis) if op == "sum" else tensor.mean(dim=axis)


class Strategy(abc.ABC):
    """Base class: ``scope``, ``run``, ``reduce``, ``gather``, ``distribute_dataset``.

    Parameters created inside ``scope()`` (and modules passed to :meth:`prepare_model`) are *managed*:
    placed on the strategy's device, made identical on every replica when the scope exits, and kept in
    sync by gradient exchange at the end of each backward pass.
    """

    def __init__(self) -> None:
        self._managed: dict[int, nn.Parameter] = {}
        self._managed_buffers: dict[int, torch.Tensor] = {}
        self._step_info: StepInfo | None = None
        self._closed = False
        # Process groups and threads this strategy starts: released by close(), or at exit without it.
        self._resources = ProcessResources(type(self).__name__)

    # -- topology ----------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """How many replicas take part in each synchronous step, over all processes."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The device that this process's (first) replica computes on."""

    @property
    def is_chief(self) -> bool:
        """True on the one process that prints, writes logs and saves replicated state."""
        return True

    @property
    @abc.abstractmethod
    def _layout(self) -> ReplicaLayout: ...

    def _local_devices(self) -> list[torch.device]:
        return [self.device] * self._layout.num_local_replicas

    # -- variables ---------------------------------------------------------------------------------
    @contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Create models and optimizers inside: their parameters become managed by this strategy.

        On exit the new parameters are synchronised (the chief's values win) and hooked for gradient
        exchange. Re-entering the scope later adds the parameters created then.
        """
        created_params: list[nn.Parameter] = []
        created_buffers: list[torch.Tensor] = []

        def on_param(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None:
                created_params.append(param)

        def on_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> None:
            if buffer is not None:
                created_buffers.append(buffer)

        with ExitStack() as stack:
            stack.enter_context(
                _hook(nn.modules.module.register_module_parameter_registration_hook, on_param)
            )
            stack.enter_context(_hook(nn.modules.module.register_module_buffer_registration_hook, on_buffer))
            if self.device.type != "cpu":
                stack.enter_context(self.device)
            _push_scope(self)
            stack.callback(_pop_scope, self)
            yield self
        self._adopt(created_params, created_buffers)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Manage a model built outside ``scope()``: move it to the device, sync it, hook its gradients."""
        model.to(self.device)
        self._adopt(list(model.parameters()), list(model.buffers()))
        return model

    def is_managed(self, model: nn.Module) -> bool:
        return all(id(p) in self._managed for p in model.parameters() if p.requires_grad)

    def _adopt(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        new_params = [p for p in _unique(params) if id(p) not in self._managed]
        new_buffers = [b for b in _unique(buffers) if id(b) not in self._managed_buffers]
        if not new_params and not new_buffers:
            return
        for p in new_params:
            self._managed[id(p)] = p
        for b in new_buffers:
            self._managed_buffers[id(b)] = b
        self._on_new_variables(new_params, new_buffers)

    @abc.abstractmethod
    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        """Synchronise and hook newly managed variables."""

    @property
    def managed_parameters(self) -> list[nn.Parameter]:
        return list(self._managed.values())

    # -- computation -------------------------------------------------------------------------------
    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run ``fn`` once per local replica with that replica's slice of ``args``.

        Contract: ``fn`` computes a per-replica *mean* loss and calls ``loss.backward()``; when
        ``run`` returns, gradients are reduced across all replicas (weighted by sample count, so the
        result equals one device on the global batch). Call ``optimizer.step()`` after ``run``, in
        cross-replica context. Returns fn's result: a :class:`PerReplica` when this process drives
        several replicas, else the value itself.
        """

    @abc.abstractmethod
    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Combine a per-replica value over all replicas (``"sum"`` or ``"mean"``); the same on every
        rank. With ``axis``, also reduce along that axis of each value (mean over all elements)."""

    @abc.abstractmethod
    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        """Concatenate per-replica values along ``axis`` in replica order; the same on every rank."""

    def local_results(self, value: Any) -> tuple[Any, ...]:
        """The values of this process's replicas as a tuple."""
        return value.values if isinstance(value, PerReplica) else (value,)

    # -- data --------------------------------------------------------------------------------------
    def distribute_dataset(
        self,
        dataset: Any,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
        shard_policy: str | ShardPolicy = ShardPolicy.AUTO,
        num_workers: int | None = None,
        prefetch: int = 2,
    ) -> DistributedDataset:
        """Split each global batch of ``dataset`` over the replicas (see :class:`DistributedDataset`).

        Every process must pass the same dataset, batch size, seed and flags. The final batch may be
        smaller (unless ``drop_remainder``); gradients are weighted by each replica's sample count.
        ``prefetch`` batches are prepared ahead on a background thread (0: none);
        ``num_workers`` > 0 loads samples in that many worker processes (torch DataLoader).
        """
        return DistributedDataset(
            dataset,
            global_batch_size,
            self._layout,
            shuffle=shuffle,
            seed=seed,
            drop_remainder=drop_remainder,
            shard_policy=shard_policy,
            devices=self._local_devices(),
            num_workers=num_workers,
            prefetch=prefetch,
            on_step=self._set_step_info,
        )

    def _set_step_info(self, info: StepInfo) -> None:
        self._step_info = info

    def _replica_weights(self) -> list[float]:
        """Each local replica's share of the current global batch (1/replicas when unknown)."""
        info = self._step_info
        n = self._layout.num_local_replicas
        if info is None or info.global_size <= 0:
            return [1.0 / self.num_replicas_in_sync] * n
        return [size / info.global_size for size in info.local_sizes]

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Release hooks, threads and process groups this strategy created. Idempotent.

        A script that never calls it still gets its process groups and threads released, newest
        first, at interpreter exit (see :mod:`spread.strategies.teardown`); hooks stay until then.
        """
        self._closed = True
        self._resources.release()

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, device={self.device})"
        )


class SupportsNoSync(abc.ABC):
    """Capability of strategies that exchange gradients: skip the exchange for a few micro-steps."""

    @abc.abstractmethod
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next one outside exchanges everything."""


@contextmanager
def _hook(register: Callable[[Callable], Any], fn: Callable) -> Iterator[None]:
    handle = register(fn)
    try:
        yield
    finally:
        handle.remove()


def _unique(tensors: list) -> list:
    seen: dict[int, Any] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())
