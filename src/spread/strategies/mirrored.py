"""MirroredStrategy: one process, one replica per (logical) device, replicas on threads.

On a CPU the logical devices share the host's memory, so the replicas share one set of parameters:
each replica thread runs forward and backward on its slice, and autograd's gradient accumulation
(serialised per parameter by a lock inside PyTorch) sums the replicas' gradients in place. Each
replica's gradient counts by its share of the global batch: when the shares are equal and no
parameter had a gradient before the step (the usual ``zero_grad(set_to_none=True)`` loop), the sum
is scaled once in place after the replicas return (one pass over the gradients); otherwise a hook
weights each replica's gradient as it arrives (one new tensor per replica and parameter). That is
the in-process all-reduce with no copy at all: ``cross_device_ops="accumulate"`` (what ``"auto"``
means). Each replica gets ``cores // replicas`` intra-op threads so the replicas run side by side
instead of fighting over the cores.

``cross_device_ops="reduce_to_one"`` or ``"hierarchical_copy"`` give each replica its own flat
gradient buffer instead: a pre-hook on each parameter's gradient accumulator writes the replica's
weighted gradient into that replica's buffer and keeps it out of ``.grad``; when every replica has
returned, ``strategy.run`` sums the buffers with :mod:`spread.comm.in_process`'s algorithm of that
name (``hierarchical_copy`` on the replicas' threads) and adds the total to ``.grad``. Semantics
are the same as with ``"accumulate"`` (a parameter no replica used keeps its ``.grad``); the cost is
one write per replica and one reduction pass per step.

BatchNorm: the replicas share one module, so the layers' in-place running-statistics updates would
race between threads and depend on their order. Each BatchNorm layer managed by the strategy runs a
forward of its own inside ``strategy.run`` (:mod:`spread.strategies.batchnorm`): by default each
replica normalises with its own slice's statistics and the running statistics get one update per
forward call, after the replicas returned, from the replicas' statistics weighted by their shares
(what MultiWorkerMirroredStrategy's buffer averaging gives); with ``sync_batchnorm=True`` the
replicas exchange per-channel sums through a thread rendezvous and normalise with the global batch's
statistics (equal to one device).

Several distinct accelerators in one process are not supported: PyTorch's answer for that is one
process per device, which is :class:`MultiWorkerMirroredStrategy` under ``spread run -n <devices>``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from spread.cluster.rendezvous import default_collective_timeout
from spread.comm.in_process import hierarchical_copy, reduce_to_one
from spread.data import ReplicaLayout
from spread.errors import SpreadError
from spread.strategies import thread_state
from spread.strategies.base import Strategy, replica_weights
from spread.strategies.batchnorm import BatchNormReplicas, ReplicaExchangeAborted, ThreadReplicaSum
from spread.strategies.context import ReplicaContext, _set_replica_context, get_replica_context
from spread.strategies.one_device import default_device
from spread.values import PerReplica, on_device, select_replica

CROSS_DEVICE_OPS = ("auto", "accumulate", "reduce_to_one", "hierarchical_copy")


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
        cross_device_ops: how replicas' gradients are combined: ``"accumulate"`` (autograd sums them
            in place in the shared ``.grad``, no copy; what ``"auto"`` means), ``"reduce_to_one"`` or
            ``"hierarchical_copy"`` (per-replica gradient buffers, summed after the replicas return;
            see :mod:`spread.comm.in_process`).
        intra_op_threads: threads each replica's ops may use; ``"auto"`` = cores // replicas, set once
            for the process (``torch.set_num_threads``) unless ``OMP_NUM_THREADS`` is set.
        sync_batchnorm: BatchNorm statistics over the global batch (see :class:`Strategy`); on CPU
            replicas only (an accelerator runs every replica's backward on one device thread, where
            the replicas' rendezvous would wait forever).
    """

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        num_replicas: int | None = None,
        cross_device_ops: str = "auto",
        intra_op_threads: int | str = "auto",
        *,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(sync_batchnorm=sync_batchnorm)
        if cross_device_ops not in CROSS_DEVICE_OPS:
            raise ValueError(f"cross_device_ops must be one of {CROSS_DEVICE_OPS}, got {cross_device_ops!r}")
        self._devices = _resolve_devices(devices, num_replicas, type(self).__name__)
        n = len(self._devices)
        if sync_batchnorm and n > 1 and self._devices[0].type != "cpu":
            raise ValueError(
                f"sync_batchnorm=True with {n} thread replicas on {self._devices[0]} is not supported: "
                "autograd runs their backward passes on one device thread, so the replicas cannot meet "
                "to exchange BatchNorm statistics; use MultiWorkerMirroredStrategy (one process per "
                "replica) for synchronised BatchNorm on accelerators"
            )
        self._thread_sum = ThreadReplicaSum(n, default_collective_timeout()) if sync_batchnorm else None
        self._batchnorm = BatchNormReplicas(self, self._thread_sum, shared_module=True)
        self.cross_device_ops = "accumulate" if cross_device_ops == "auto" else cross_device_ops
        self._replica_grads: _ReplicaGradients | None = None
        if intra_op_threads == "auto":
            if "OMP_NUM_THREADS" not in os.environ and self._devices[0].type == "cpu":
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
        elif isinstance(intra_op_threads, int) and intra_op_threads >= 1:
            torch.set_num_threads(intra_op_threads)
        else:
            raise ValueError(
                f"intra_op_threads must be 'auto' or a positive integer, got {intra_op_threads!r}"
            )
        # On an accelerator autograd runs backward on the device's own thread, where a replica thread's
        # context is not seen: replicas there run one after another (the device serialises their
        # kernels anyway), and the gradient hooks read the running replica from ``_running_replica``.
        self._one_at_a_time = n > 1 and any(d.type != "cpu" for d in self._devices)
        self._running_replica: ReplicaContext | None = None
        self._pool = (
            ThreadPoolExecutor(max_workers=n - 1, thread_name_prefix="spread-replica")
            if n > 1 and not self._one_at_a_time
            else None
        )
        self._hooks: list[Any] = []
        self._weighted: list[nn.Parameter] = []  # parameters whose replica gradients get weighted
        self._scale_after: float | None = None  # set inside run: weight the summed .grad once, after
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
        if self.cross_device_ops == "accumulate":
            for p in params:
                if p.requires_grad:
                    self._weighted.append(p)
                    self._hooks.append(p.register_hook(functools.partial(_weight_by_replica_share, self)))
            return
        if self._replica_grads is not None:
            self._replica_grads.close()
        self._replica_grads = _ReplicaGradients(self, self.managed_parameters, self.num_replicas_in_sync)

    def _on_new_modules(self, modules: list[nn.Module]) -> None:
        self._batchnorm.add(modules)

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        if get_replica_context() is not None:
            raise SpreadError("strategy.run was called inside strategy.run; call it from the training loop")
        kwargs = kwargs or {}
        n = self.num_replicas_in_sync
        weights = replica_weights(self)
        self._step_info = None

        thread_sum = self._thread_sum
        if thread_sum is not None:
            thread_sum.reset()
        caller = thread_state.capture()  # autocast, grad mode, ... hold on every replica's thread

        def replica(i: int) -> Any:
            context = ReplicaContext(self, i, n, weights[i])
            _set_replica_context(context)
            if self._one_at_a_time:
                self._running_replica = context
            try:
                device = self._devices[i]
                args_i = on_device(select_replica(args, i), device)
                kwargs_i = on_device(select_replica(kwargs or {}, i), device)
                if i == 0:
                    return fn(*args_i, **kwargs_i)
                with thread_state.applied(caller):
                    return fn(*args_i, **kwargs_i)
            except BaseException:
                if thread_sum is not None:  # the others must not wait for this replica's statistics
                    thread_sum.abort()
                raise
            finally:
                _set_replica_context(None)
                self._running_replica = None

        # Equal shares on fresh gradients: the sum is weighted once, in place, after the replicas.
        same = all(w == weights[0] for w in weights) and all(p.grad is None for p in self._weighted)
        self._scale_after = weights[0] if same and self._weighted else None
        pool = None if self._one_at_a_time else self._pool
        futures = [pool.submit(replica, i) for i in range(1, n)] if pool else []
        results: list[Any] = [None] * n
        errors: list[tuple[int, BaseException]] = []
        for i in range(n if self._one_at_a_time else 1):
            try:
                results[i] = replica(i)
            except BaseException as exc:  # wait for the other replicas before raising
                errors.append((i, exc))
                break
        for i, future in enumerate(futures, start=1):
            try:
                results[i] = future.result()
            except BaseException as exc:
                errors.append((i, exc))
        scale, self._scale_after = self._scale_after, None
        if scale is not None and scale != 1.0:
            for p in self._weighted:
                if p.grad is not None:
                    p.grad.mul_(scale)
        if errors:
            self._batchnorm.discard_pending()
            if self._replica_grads is not None:
                self._replica_grads.discard()
            # A replica released from the BatchNorm exchange by another's failure reports the cause.
            causes = [e for e in errors if not isinstance(e[1], ReplicaExchangeAborted)]
            index, error = (causes or errors)[0]
            raise SpreadError(f"replica {index} of {n} failed in strategy.run: {error!r}") from error
        self._batchnorm.apply_pending_updates(weights)
        if self._replica_grads is not None:
            self._replica_grads.reduce_into_grads(self.cross_device_ops, self._parallel)
        return PerReplica(results) if n > 1 else results[0]

    def _replica_in_backward(self) -> ReplicaContext | None:
        """The replica whose backward pass is running: this thread's, or on an accelerator (backward on
        the device's thread) the one replica running."""
        ctx = get_replica_context()
        if ctx is not None and ctx.strategy is self:
            return ctx
        return self._running_replica

    def _parallel(self, tasks) -> None:
        """Run ``tasks`` on the replica threads (the first on this thread) and wait for all."""
        futures = [self._pool.submit(task) for task in tasks[1:]] if self._pool else []
        if not self._pool:
            for task in tasks[1:]:
                task()
        if tasks:
            tasks[0]()
        for future in futures:
            future.result()

    def _sum_over_replicas(self, value: Any) -> tuple[torch.Tensor, int]:
        values = [_as_tensor(v, self.device).to(self.device) for v in self.local_results(value)]
        return torch.stack(values).sum(dim=0), len(values)

    def gather(self, value: Any, axis: int = 0) -> torch.Tensor:
        values = [_as_tensor(v, self.device).to(self.device) for v in self.local_results(value)]
        return torch.cat(values, dim=axis)

    def close(self) -> None:
        self._batchnorm.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._weighted.clear()
        if self._replica_grads is not None:
            self._replica_grads.close()
            self._replica_grads = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        super().close()


def _weight_by_replica_share(strategy: MirroredStrategy, grad: torch.Tensor) -> torch.Tensor | None:
    """Scale a replica's gradient by its share of the global batch (only inside strategy.run)."""
    ctx = strategy._replica_in_backward()
    if ctx is None or strategy._scale_after is not None:
        return None
    return grad * ctx.weight


class _ReplicaGradients:
    """One flat gradient buffer per replica and (device, dtype), filled by accumulator pre-hooks.

    Replica ``i``'s hook (on replica ``i``'s thread, or on a GPU's backward thread while replica ``i``
    runs alone) writes ``weight_i * grad`` into its own
    buffer (adding when the parameter already has a gradient there this step) and returns no
    gradient, so ``.grad`` is untouched until :meth:`reduce_into_grads`. Outside ``strategy.run`` the
    hook passes gradients through, so plain backward passes behave as usual.
    """

    def __init__(self, strategy: MirroredStrategy, params: list[nn.Parameter], replicas: int) -> None:
        self.strategy = strategy
        self.params = [p for p in params if p.requires_grad]
        self.slots: dict[int, tuple[int, int]] = {}  # id(p) -> (group, offset)
        sizes: dict[tuple, int] = {}
        keys: list[tuple] = []
        for p in self.params:
            key = (p.device, p.dtype)
            if key not in sizes:
                sizes[key] = 0
                keys.append(key)
            self.slots[id(p)] = (keys.index(key), sizes[key])
            sizes[key] += p.numel()
        self.buffers = [
            [torch.zeros(sizes[key], dtype=key[1], device=key[0]) for _ in range(replicas)] for key in keys
        ]
        self.present: list[set[int]] = [set() for _ in range(replicas)]
        self._nodes: list[Any] = []  # the accumulators must stay alive for their hooks to stay
        self._handles: list[Any] = []
        for p in self.params:
            with torch.enable_grad():
                view_node = p.view_as(p).grad_fn
            node = view_node.next_functions[0][0] if view_node is not None else None  # AccumulateGrad
            assert node is not None  # p requires grad, so it has one
            self._nodes.append(node)
            self._handles.append(node.register_prehook(self._make_hook(p)))

    def _make_hook(self, p: nn.Parameter):
        key = id(p)
        group, offset = self.slots[key]
        numel, shape = p.numel(), p.shape

        def capture(grads: tuple) -> tuple | None:
            ctx = self.strategy._replica_in_backward()
            grad = grads[0]
            if ctx is None or grad is None:
                return None
            if grad.layout != torch.strided:
                raise SpreadError(
                    f"cross_device_ops={self.strategy.cross_device_ops!r} reduces dense gradients; a "
                    f"parameter of shape {tuple(shape)} got a {grad.layout} one (e.g. a sparse "
                    "embedding): use cross_device_ops='accumulate'"
                )
            i = ctx.replica_id_in_sync_group
            slot = self.buffers[group][i][offset : offset + numel].view(shape)
            if key in self.present[i]:
                slot.add_(grad, alpha=ctx.weight)
            else:
                torch.mul(grad, ctx.weight, out=slot)
                self.present[i].add(key)
            return (None,)

        return capture

    def reduce_into_grads(self, algorithm: str, parallel) -> None:
        """Sum the replicas' buffers (``algorithm`` of :mod:`spread.comm.in_process`) and add the
        total to ``.grad`` of every parameter some replica produced a gradient for."""
        used = set().union(*self.present)
        if not used:
            return
        for i, present in enumerate(self.present):
            for p in self.params:  # a parameter this replica did not use contributes zeros
                key = id(p)
                if key in used and key not in present:
                    group, offset = self.slots[key]
                    self.buffers[group][i][offset : offset + p.numel()].zero_()
        for replica_buffers in self.buffers:
            if algorithm == "reduce_to_one":
                reduce_to_one(replica_buffers)
            else:
                hierarchical_copy(replica_buffers, parallel=parallel)
        for p in self.params:
            if id(p) not in used:
                continue
            group, offset = self.slots[id(p)]
            total = self.buffers[group][0][offset : offset + p.numel()].view(p.shape)
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.add_(total)
        self.discard()

    def discard(self) -> None:
        for present in self.present:
            present.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._nodes.clear()


def _as_tensor(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, PerReplica):
        raise TypeError("nested PerReplica values cannot be reduced")
    return torch.as_tensor(value, device=device)
