"""How replicas on one CPU node slow each other down: measured, because no formula knows the machine.

Data-parallel replicas on a CPU node each get ``cores // replicas`` threads and their share of the
batch, but they also share memory bandwidth, caches and (for thread replicas) one address space. On
a 2-core VM two replicas of a dense MLP each ran ~1.3-2x slower than one alone with the same threads,
and the Adagrad update of a 256 MB embedding table, run by every process of a data-parallel job at
once, took far longer than the same update alone. These functions time the real thing (deep copies
stepping together, or the model under :class:`~spread.strategies.mirrored.MirroredStrategy`) and
return slowdown factors (>= 1) that :mod:`spread.plan.predict` multiplies into its terms.
"""

from __future__ import annotations

import copy
import statistics
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from spread.plan._timing import median_time, same_optimizer, take

if TYPE_CHECKING:
    from spread.plan.workload import ModelProfile


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


def run_together(steps: Sequence[Callable[[], None]], threads: int, repeats: int) -> list[float]:
    """Median seconds of each of ``steps``, all running at once, one Python thread each.

    torch releases the GIL inside operators, so the threads really compute in parallel. Each step is
    warmed up, then all start together behind a barrier; ``threads`` intra-op threads (process-wide).
    An exception in any thread aborts the barrier and is raised here, not lost in the thread.
    """
    barrier = threading.Barrier(len(steps))
    times: list[float] = []  # list.append is atomic: no lock needed
    errors: list[BaseException] = []

    def run(step: Callable[[], None]) -> None:
        try:
            step()  # warm-up: allocator, lazy optimizer state
            barrier.wait(timeout=600)
            seconds = median_time(step, repeats)
        except BaseException as exc:
            barrier.abort()
            errors.append(exc)
            return
        times.append(seconds)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        workers = [threading.Thread(target=run, args=(s,), daemon=True) for s in steps]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(previous)
    if errors:
        raise errors[0]
    return times


def _slowdown(together: list[float], alone: float, replicas: int, cores: int) -> float:
    """Median time together over time alone, time-slicing (more replicas than cores) removed; >= 1."""
    if alone <= 0:
        return 1.0
    time_slicing = max(1.0, replicas / cores)
    return max(1.0, statistics.median(together) / (alone * time_slicing))


def _backward_step(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], x: Any, y: Any):
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        for p in params:
            p.grad = None
        loss_fn(model(x), y).backward()

    return step


def _replica_share(
    profile: ModelProfile, inputs: Any, targets: Any, replicas: int, cores: int
) -> tuple[int, int, Any, Any]:
    """``(samples, intra-op threads, inputs, targets)`` of one of ``replicas`` on ``cores`` cores."""
    local = max(1, profile.batch // replicas)
    return local, max(1, cores // replicas), take(inputs, local), take(targets, local)


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
    """Slowdown of each of ``replicas`` copies of ``model`` doing forward+backward at once.

    Each copy computes ``batch / replicas`` samples with ``cores // replicas`` threads; the factor is
    their median step over what ``profile`` predicts for one alone.
    """
    local, threads, x, y = _replica_share(profile, inputs, targets, replicas, cores)
    steps = [_backward_step(copy.deepcopy(model), loss_fn, x, y) for _ in range(replicas)]
    together = run_together(steps, threads, repeats)
    return _slowdown(together, profile.compute_seconds(local, threads), replicas, cores)


def measure_optimizer_contention(
    profile: ModelProfile,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: Any,
    targets: Any,
    replicas: int,
    cores: int,
    repeats: int = 3,
) -> float:
    """Slowdown of each of ``replicas`` optimizer steps (one per copy of ``model``) running at once.

    Every process of a multi-process data-parallel job applies the full update to its own copy of
    the parameters at the same moment; for a large table that is memory-bound (an Adagrad step over
    256 MB reads and writes ~1 GB). Each copy gets its own optimizer of ``optimizer``'s class and
    settings and one backward's gradients; the factor compares with ``profile``'s step alone.
    """
    _, threads, x, y = _replica_share(profile, inputs, targets, replicas, cores)
    steps = []
    for _ in range(replicas):
        replica = copy.deepcopy(model)
        _backward_step(replica, loss_fn, x, y)()
        steps.append(same_optimizer(optimizer, [p for p in replica.parameters() if p.requires_grad]).step)
    together = run_together(steps, threads, repeats)
    return _slowdown(together, profile.optimizer_time(threads), replicas, cores)


def measure_in_process(
    profile: ModelProfile,
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    replicas: int,
    cores: int,
    repeats: int = 3,
) -> float:
    """Extra slowdown of ``replicas`` thread replicas of one process over separate replicas.

    :class:`~spread.strategies.mirrored.MirroredStrategy` (and CentralStorageStrategy, which reuses
    it) runs its replicas as threads of one process that share the parameters: each replica's
    gradient is weighted and summed into the shared ``.grad`` under autograd's per-parameter lock,
    and every fresh gradient buffer is allocated in one address space. For a model with a large dense
    gradient that costs far more than separate copies computing side by side. Measured by running
    the strategy itself on a copy of ``model``; the factor is its forward+backward step over what
    ``profile`` predicts for separate replicas (compute with :meth:`ModelProfile.contention_factor`).
    """
    from spread.strategies.mirrored import MirroredStrategy  # plan sits above strategies

    strategy = MirroredStrategy(num_replicas=replicas)
    try:
        replica_model = strategy.prepare_model(copy.deepcopy(model))
        params = [p for p in replica_model.parameters() if p.requires_grad]
        data = strategy.distribute_dataset((inputs, targets), profile.batch, shuffle=False, prefetch=0)
        batch = next(iter(data))

        def replica_step(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
            loss_fn(replica_model(pair[0]), pair[1]).backward()

        def step() -> None:
            for p in params:
                p.grad = None
            strategy.run(replica_step, args=(batch,))

        previous = torch.get_num_threads()
        torch.set_num_threads(cores)
        try:
            measured = median_time(step, repeats)
        finally:
            torch.set_num_threads(previous)
    finally:
        strategy.close()
    local, threads, _, _ = _replica_share(profile, inputs, targets, replicas, cores)
    separate = profile.compute_seconds(local, threads) * profile.contention_factor(replicas)
    return _slowdown([measured], separate, replicas, cores)
