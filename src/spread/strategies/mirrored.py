"""MirroredStrategy: one process, one replica per (logical) device, replicas on threads.

On a CPU the logical devices share the host's memory, so the replicas share one set of parameters:
each replica thread runs forward and backward on its slice, and autograd's gradient accumulation
(serialised per parameter by a lock inside PyTorch) sums the replicas' gradients in place; a hook
weights each replica's gradient by its share of the global batch first. That is the in-process
all-reduce, with no copy at all. Each replica gets ``cores // replicas`` intra-op threads so the
replicas run side by side instead of fighting over the cores.

Several distinct accelerators in one process are not supported: PyTorch's answer for that is one
process per device, which is :class:`MultiWorkerMirroredStrategy` under ``spread run -n <devices>``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from spread.data import ReplicaLayout
from spread.errors import SpreadError
from spread.strategies.base import Strategy, check_reduce_op
from spread.strategies.context import ReplicaContext, _set_replica_context, get_replica_context
from spread.strategies.one_device import default_device
from spread.values import PerReplica, select_replica

CROSS_DEVICE_OPS = ("auto",)


def _resolve_devices(
    devices: Sequence[str | torch.device] | None,
    num_replicas: int | None,
    strategy_name: str = "MirroredStrategy",
) -> list[torch.device]:
    if num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
    if devices is not None:
        resolved = [torch.device(d) for d in devices]
        if not resolved:
            raise ValueError("devices must name at least one device")
        if num_replicas is not None and num_replicas != len(resolved):
            raise ValueError(f"num_replicas={num_replicas} does not match the {len(resolved)} devices given")
    else:
        base = default_device()
        count = (
            num_replicas if num_replicas is not None else (os.cpu_count() or 1) if base.type == "cpu" else 1
        )
        resolved = [base] * count
    physical = {d for d in resolved if d.type != "cpu"}
    if len(physical) > 1:
        raise SpreadError(
            f"{strategy_name} runs its replicas in one process on one physical device; "
            f"got {sorted(map(str, physical))}. "
            f"For several GPUs use MultiWorkerMirroredStrategy with one process per GPU: "
            f"`spread run -n {len(physical)} script.py`."
        )
    return resolved


class MirroredStrategy(Strategy):
    """Synchronous data parallelism inside one process.

    Args:
        devices: the replicas' devices (all on one physical device); default: the GPU if any (one
            replica), else one logical CPU device per core.
        num_replicas: number of replicas when ``devices`` is not given (e.g. 2 logical CPU devices).
        cross_device_ops: how replicas' gradients are combined; ``"auto"`` (in-place accumulation).
        intra_op_threads: threads each replica's ops may use; ``"auto"`` = cores // replicas, set once
            for the process (``torch.set_num_threads``) unless ``OMP_NUM_THREADS`` is set.
    """

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        num_replicas: int | None = None,
        cross_device_ops: str = "auto",
        intra_op_threads: int | str = "auto",
    ) -> None:
        super().__init__()
        if cross_device_ops not in CROSS_DEVICE_OPS:
            raise ValueError(f"cross_device_ops must be one of {CROSS_DEVICE_OPS}, got {cross_device_ops!r}")
        self._devices = _resolve_devices(devices, num_replicas, type(self).__name__)
        self.cross_device_ops = cross_device_ops
        n = len(self._devices)
        if intra_op_threads == "auto":
            if "OMP_NUM_THREADS" not in os.environ and self._devices[0].type == "cpu":
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        elif isinstance(intra_op_threads, int) and intra_op_threads >= 1:
            torch.set_num_threads(intra_op_threads)
        else:
            raise ValueError(
                f"intra_op_threads must be 'auto' or a positive integer, got {intra_op_threads!r}"
            )
        self._pool = (
            ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="spread-replica") if n > 1 else None
        )
        self._hooks: list[Any] = []
        self._lock = threading.Lock()

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def device(self) -> torch.device:
        return self._devices[0]

    @property
    def devices(self) -> tuple[torch.device, ...]:
        return tuple(self._devices)

    @property
    def _layout(self) -> ReplicaLayout:
        n = len(self._devices)
        return ReplicaLayout(num_replicas=n, first_local_replica=0, num_local_replicas=n)

    def _local_devices(self) -> list[torch.device]:
        return list(self._devices)

    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_hook(_weight_by_replica_share))

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        if get_replica_context() is not None:
            raise SpreadError("strategy.run was called inside strategy.run; call it from the training loop")
        kwargs = kwargs or {}
        n = self.num_replicas_in_sync
        weights = self._replica_weights()
        self._step_info = None

        def replica(i: int) -> Any:
            _set_replica_context(ReplicaContext(self, i, n, weights[i]))
            try:
                return fn(*select_replica(args, i), **select_replica(kwargs, i))
            finally:
                _set_replica_context(None)

        futures = [self._pool.submit(replica, i) for i in range(1, n)] if self._pool else []
        results: list[Any] = [None] * n
        errors: list[tuple[int, BaseException]] = []
        try:
            results[0] = replica(0)
        except BaseException as exc:  # wait for the other replicas before raising
            errors.append((0, exc))
        for i, future in enumerate(futures, start=1):
            try:
                results[i] = future.result()
            except BaseException as exc:
                errors.append((i, exc))
        if errors:
            index, exc = errors[0]
            raise SpreadError(f"replica {index} of {n} failed in strategy.run: {exc!r}") from exc
        return PerReplica(results) if n > 1 else results[0]

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor:
        op = check_reduce_op(op)
        if axis is not None:
            gathered = self.gather(value, axis=axis)
            return gathered.sum(dim=axis) if op == "sum" else gathered.mean(dim=axis)
        values = [_as_tensor(v, self.device) for v in self.local_results(value)]
        total = torch.stack([v.to(self.device) for v in values]).sum(dim=0)
        return total if op == "sum" else total / len(values)

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        values = [_as_tensor(v, self.device).to(self.device) for v in self.local_results(value)]
        return torch.cat(values, dim=axis)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        super().close()


def _weight_by_replica_share(grad: torch.Tensor) -> torch.Tensor | None:
    """Scale a replica's gradient by its share of the global batch (only inside strategy.run)."""
    ctx = get_replica_context()
    if ctx is None or not isinstance(ctx.strategy, MirroredStrategy):
        return None
    return grad * ctx.weight


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, PerReplica):
        raise TypeError("nested PerReplica values cannot be reduced")
    return torch.as_tensor(value, device=device)
