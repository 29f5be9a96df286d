"""Profile a user's model on this device: step time, memory terms, sparse traffic, per-layer shares.

The planner predicts from measurements, not from FLOP counts: a few real forward/backward passes at
two batch sizes give a linear step-time model ``fixed + per_sample * batch`` per thread count; ``k``
copies stepping at once give the slowdown ``k`` replicas inflict on each other beyond sharing the
cores (memory bandwidth and caches, which matter on CPUs); saved-tensor hooks count the activation
bytes autograd keeps; one optimizer step on a copy counts the optimizer's state. The user's model
and optimizer are never touched (everything runs on deep copies).
"""

from __future__ import annotations

import copy
import inspect
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LayerProfile:
    """One top-level block, as a pipeline stage boundary or checkpoint unit sees it."""

    name: str
    time_share: float  # fraction of the model's forward time
    param_bytes: float
    activation_bytes_per_sample: float  # what autograd saves inside the block
    output_bytes_per_sample: float  # what crosses to the next block


@dataclass(frozen=True)
class ModelProfile:
    """Measured figures of one model with one loss and optimizer."""

    name: str
    param_bytes: float
    sparse_bytes: float  # parameters of embedding tables (rows pulled on demand by a PS)
    sparse_row_bytes: float
    sparse_rows_per_sample: float  # distinct rows one sample touches (measured at ``batch``)
    optimizer_bytes: float
    activation_bytes_per_sample: float
    compute: dict[int, tuple[float, float]]  # threads -> (fixed s, s per sample) of forward+backward
    backward_fraction: float
    optimizer_seconds: float
    batch: int
    layers: tuple[LayerProfile, ...] = field(default_factory=tuple)
    # (fraction of backward elapsed, fraction of gradient bytes ready), measured; None: even pace
    gradient_arrival: tuple[tuple[float, float], ...] | None = None
    # replicas computing at once -> slowdown of each one's step beyond core sharing (>= 1), measured
    contention: dict[int, float] = field(default_factory=dict)

    def contention_factor(self, replicas: int) -> float:
        """How much slower each of ``replicas`` concurrent replicas computes than one alone would.

        1.0 for one replica or when nothing was measured; past the largest measured count, the
        largest count's factor (more replicas than cores are slowed by time-slicing on top, which
        the caller adds).
        """
        if replicas <= 1 or not self.contention:
            return 1.0
        known = [k for k in sorted(self.contention) if k <= replicas]
        return self.contention[known[-1]] if known else 1.0

    @property
    def dense_bytes(self) -> float:
        return self.param_bytes - self.sparse_bytes

    def compute_seconds(self, batch: float, threads: int | None = None) -> float:
        """Forward+backward seconds for ``batch`` samples with ``threads`` intra-op threads."""
        if threads is None or threads not in self.compute:
            known = sorted(self.compute)
            threads = min(known, key=lambda t: (abs(t - (threads or known[-1])), -t))
        fixed, per_sample = self.compute[threads]
        return fixed + per_sample * max(batch, 0.0) if batch > 0 else 0.0

    def checkpointed_activation_bytes_per_sample(self) -> float:
        """Activations with each block checkpointed: block outputs kept, one block's inside at a time."""
        if not self.layers:
            return self.activation_bytes_per_sample
        kept = sum(layer.output_bytes_per_sample for layer in self.layers)
        return kept + max(layer.activation_bytes_per_sample for layer in self.layers)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


class _SavedBytes:
    """Counts bytes autograd saves for backward, excluding the parameters themselves."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {p.data_ptr() for p in model.parameters()}
        self.bytes = 0
        self._seen: set[int] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.data_ptr()
        if ptr not in self._params and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _take(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, list | tuple):
        return type(batch)(_take(b, n) for b in batch)
    if isinstance(batch, dict):
        return {k: _take(v, n) for k, v in batch.items()}
    return batch


def _same_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of the same class and settings over ``params`` (the copies).

    ``defaults`` can hold keys the constructor does not take (torch 2.13's AdamW records
    ``decoupled_weight_decay``), so only the constructor's own arguments are passed on.
    """
    accepted = inspect.signature(type(optimizer).__init__).parameters
    settings = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return type(optimizer)(params, **settings)


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, lazy init
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_model(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    threads: Sequence[int] = (1,),
    concurrency: Sequence[int] = (),
    repeats: int = 3,
    name: str | None = None,
) -> ModelProfile:
    """Profile ``model`` on ``inputs``/``targets`` (a batch whose first dimension is the sample axis).

    ``threads``: intra-op thread counts to time compute at (a CPU process of a job that runs ``k``
    processes per ``c``-core node gets ``c // k``). ``concurrency``: replica counts ``k >= 2`` whose
    mutual slowdown to measure (:func:`measure_contention`; CPU only, where replicas share a node's
    memory system). The model, its parameters and ``optimizer`` are copied, never modified.
    """
    batch = int(targets.shape[0]) if isinstance(targets, torch.Tensor) else int(inputs.shape[0])
    if batch < 2:
        raise ValueError(f"profiling needs a batch of at least 2 samples, got {batch}")
    work = copy.deepcopy(model)
    work.train()
    params = [p for p in work.parameters() if p.requires_grad]
    param_bytes = float(sum(p.numel() * p.element_size() for p in work.parameters()))

    sparse_bytes = sparse_row_bytes = 0.0
    touched: list[torch.Tensor] = []
    handles = []
    for module in work.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            sparse_bytes += module.weight.numel() * module.weight.element_size()
            sparse_row_bytes = max(sparse_row_bytes, module.weight.shape[1] * module.weight.element_size())
            handles.append(module.register_forward_pre_hook(lambda m, args: touched.append(args[0].detach())))

    def step(n: int) -> None:
        x, y = _take(inputs, n), _take(targets, n)
        for p in params:
            p.grad = None
        loss_fn(work(x), y).backward()

    counter = _SavedBytes(work)
    arrivals: list[tuple[float, int]] = []
    hooks = [
        p.register_post_accumulate_grad_hook(
            lambda p: arrivals.append((time.perf_counter(), p.numel() * p.element_size()))
        )
        for p in params
    ]
    with counter.hooks():
        x, y = _take(inputs, batch), _take(targets, batch)
        loss = loss_fn(work(x), y)
    started = time.perf_counter()
    loss.backward()
    ended = time.perf_counter()
    for hook in hooks:
        hook.remove()
    gradient_arrival = _arrival_curve(arrivals, started, ended)
    for handle in handles:
        handle.remove()
    rows = sum(int(torch.unique(t).numel()) for t in touched) / batch if touched else 0.0

    previous_threads = torch.get_num_threads()
    compute: dict[int, tuple[float, float]] = {}
    small = max(1, batch // 4)
    try:
        for t in sorted(threads):
            torch.set_num_threads(int(t))
            t_small = _median_time(lambda: step(small), repeats)
            t_full = _median_time(lambda: step(batch), repeats)
            per_sample = max((t_full - t_small) / (batch - small), 0.0)
            fit = (max(t_full - per_sample * batch, 0.0), per_sample)
            fewer = [compute[k] for k in sorted(compute) if k < t]
            if fewer and fewer[-1][0] + fewer[-1][1] * batch < t_full:
                fit = fewer[-1]  # more threads measured slower (busy cores): a process can use fewer
            compute[int(t)] = fit
        torch.set_num_threads(max(threads))
        x, y = _take(inputs, batch), _take(targets, batch)

        def forward_only() -> None:
            loss_fn(work(x), y)

        forward = _median_time(forward_only, repeats)
        full = _median_time(lambda: step(batch), repeats)
        backward_fraction = min(max(1.0 - forward / full, 0.0), 0.95) if full > 0 else 0.66

        optimizer_bytes = 0.0
        optimizer_seconds = 0.0
        if optimizer is not None:
            opt = _same_optimizer(optimizer, params)
            step(batch)
            optimizer_seconds = _median_time(opt.step, repeats)
            optimizer_bytes = float(sum(_tensor_bytes(s) for s in opt.state.values()))
        layers = _layer_profiles(work, x, forward)
    finally:
        torch.set_num_threads(previous_threads)
    profile = ModelProfile(
        name=name or type(model).__name__,
        param_bytes=param_bytes,
        sparse_bytes=sparse_bytes,
        sparse_row_bytes=sparse_row_bytes,
        sparse_rows_per_sample=rows,
        optimizer_bytes=optimizer_bytes,
        activation_bytes_per_sample=counter.bytes / batch,
        compute=compute,
        backward_fraction=backward_fraction,
        optimizer_seconds=optimizer_seconds,
        batch=batch,
        layers=layers,
        gradient_arrival=gradient_arrival,
    )
    counts = sorted({int(k) for k in concurrency if 2 <= k <= batch})
    if not counts:
        return profile
    cores = max(threads)
    return replace(
        profile,
        contention={
            k: measure_contention(profile, work, loss_fn, inputs, targets, k, cores, repeats) for k in counts
        },
    )


def replica_counts(per_node: int, most: int = 6) -> list[int]:
    """Replica counts worth measuring contention at for up to ``per_node`` replicas on a node.

    Every count up to 4, then doubling, always ending at ``per_node``; at most ``most`` counts, so
    profiling a 64-device node measures 2, 3, 4, 8, 16 and 64 replicas rather than 63 settings.
    """
    counts = [k for k in (2, 3, 4) if k <= per_node]
    k = 8
    while k < per_node:
        counts.append(k)
        k *= 2
    if per_node >= 2 and per_node not in counts:
        counts.append(per_node)
    return counts if len(counts) <= most else [*counts[: most - 1], per_node]


def measure_contention(
    profile: ModelProfile,
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    replicas: int,
    cores: int,
    repeats: int = 3,
) -> float:
    """Slowdown of each of ``replicas`` copies of ``model`` stepping at once on ``batch / replicas``.

    Data-parallel replicas on one CPU node each get ``cores // replicas`` threads and their share
    of the batch, but they also share the memory bandwidth and caches: on a 2-core VM two replicas of
    a dense MLP each ran ~1.3-2x slower than one alone with the same threads, far more than their
    all-reduce. Each replica here is a deep copy driven by its own Python thread (torch releases the
    GIL inside operators), started together behind a barrier; the factor is the replicas' median step
    time over what ``profile`` predicts for one alone, after removing time-slicing when ``replicas >
    cores``. Never below 1.
    """
    local = max(1, profile.batch // replicas)
    per_replica_threads = max(1, cores // replicas)
    copies = [copy.deepcopy(model) for _ in range(replicas)]
    x, y = _take(inputs, local), _take(targets, local)
    barrier = threading.Barrier(replicas)
    times: list[float] = []  # list.append is atomic: no lock needed
    errors: list[BaseException] = []

    def run(replica: nn.Module) -> None:
        params = [p for p in replica.parameters() if p.requires_grad]

        def step() -> None:
            for p in params:
                p.grad = None
            loss_fn(replica(x), y).backward()

        try:
            step()  # warm-up
            barrier.wait(timeout=600)
            seconds = _median_time(step, repeats)
        except BaseException as exc:  # reported to the caller below, not lost in the thread
            barrier.abort()
            errors.append(exc)
            return
        times.append(seconds)

    previous = torch.get_num_threads()
    torch.set_num_threads(per_replica_threads)
    try:
        workers = [threading.Thread(target=run, args=(c,), daemon=True) for c in copies]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(previous)
    if errors:
        raise errors[0]
    alone = profile.compute_seconds(local, per_replica_threads)
    time_slicing = max(1.0, replicas / cores)
    if alone <= 0:
        return 1.0
    return max(1.0, statistics.median(times) / (alone * time_slicing))


def _arrival_curve(
    arrivals: list[tuple[float, int]], started: float, ended: float
) -> tuple[tuple[float, float], ...] | None:
    """Cumulative gradient bytes over backward time, from post-accumulate hook timestamps."""
    total = sum(n for _, n in arrivals)
    span = ended - started
    if not arrivals or total <= 0 or span <= 0:
        return None
    points, done = [], 0
    for when, nbytes in sorted(arrivals):
        done += nbytes
        points.append((min(max((when - started) / span, 0.0), 1.0), done / total))
    return tuple(points)


def _layer_profiles(model: nn.Module, x: Any, forward_seconds: float) -> tuple[LayerProfile, ...]:
    """Per-block figures when the model is a chain of blocks (``nn.Sequential``); else none."""
    if not isinstance(model, nn.Sequential) or len(model) < 2 or not isinstance(x, torch.Tensor):
        return ()
    batch = x.shape[0]
    out = []
    times = []
    for name, block in model.named_children():
        counter = _SavedBytes(block)
        start = time.perf_counter()
        with counter.hooks():
            y = block(x)
        times.append(time.perf_counter() - start)
        out.append(
            (
                name,
                float(sum(p.numel() * p.element_size() for p in block.parameters())),
                counter.bytes / batch,
                _tensor_bytes(y) / batch,
            )
        )
        x = y.detach().requires_grad_(y.is_floating_point())
    total = sum(times) or 1.0
    return tuple(
        LayerProfile(
            name=n,
            time_share=t / total,
            param_bytes=p,
            activation_bytes_per_sample=a,
            output_bytes_per_sample=o,
        )
        for (n, p, a, o), t in zip(out, times, strict=True)
    )
