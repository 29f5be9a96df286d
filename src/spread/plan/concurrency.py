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
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from spread.plan._forked import can_fork, forked_rounds
from spread.plan._forward import LossFn, forward_loss
from spread.plan._timing import interleaved_medians, same_optimizer, take

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


def _together_rounds(
    steps: Sequence[Callable[[], None]], threads: int, repeats: int, between: Callable[[], None] | None = None
) -> list[list[float]]:
    """Per round, the seconds of each of ``steps`` run at once (one warm-up round first, untimed).

    torch releases the GIL inside operators, so the threads really compute in parallel. Every round
    starts all threads behind a barrier; an exception in any thread aborts the barrier and is raised
    here, not lost in the thread. ``between`` runs on this thread, alone, before every round, the
    warm-up included (the paired measurement of :func:`paired_slowdowns`).
    """
    rounds: list[list[float]] = []
    errors: list[BaseException] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in range(repeats + 1):
            if between is not None:
                between()
            barrier = threading.Barrier(len(steps))
            times = [0.0] * len(steps)

            def run(i: int, barrier=barrier, times=times) -> None:
                try:
                    barrier.wait(timeout=600)
                    start = time.perf_counter()
                    steps[i]()
                    times[i] = time.perf_counter() - start
                except BaseException as exc:
                    barrier.abort()
                    errors.append(exc)

            workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(steps))]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if errors:
                raise errors[0]
            if r > 0:  # round 0 warms up: allocator, lazy optimizer state
                rounds.append(times)
    finally:
        torch.set_num_threads(previous)
    return rounds


class Slowdown(NamedTuple):
    """Slowdowns of replicas stepping at once, each ``>= 1``, time-slicing removed.

    ``each``: a typical replica's (the median over the replicas); ``slowest``: the last to finish,
    which a synchronous step waits for (its ranks meet at the gradient exchange): ``each`` times how
    far the last of a round finishes behind that round's median.
    """

    each: float
    slowest: float


def paired_slowdowns(
    alone: Callable[[], None],
    together: Sequence[Callable[[], None]],
    threads: int,
    repeats: int,
    cores: int,
    *,
    processes: bool | None = None,
) -> Slowdown:
    """How much slower ``together`` run at once than ``alone`` by itself: each, and the slowest.

    Both are timed in the same rounds (``alone``, then all of ``together`` at once), so the VM's drift
    within minutes hits both alike; ``each`` is the median over rounds of (median time together) /
    (time alone), time-slicing (more steps than ``cores``) removed. ``processes``: run each
    step in its own forked process (:mod:`spread.plan._forked`), as a multi-process job's replicas run;
    by default whenever a replica gets one thread and this platform can fork, else as threads.
    """
    if processes is None:
        processes = threads == 1 and can_fork()
    if processes:
        try:
            alone_times, rounds = forked_rounds(alone, together, repeats)
        except (TimeoutError, OSError) as exc:  # a child stuck (an OpenMP runtime that cannot fork) or
            # no fork to be had (process or memory limits): threads, as before
            warnings.warn(f"{exc}; measuring contention with threads instead", RuntimeWarning, stacklevel=2)
            return paired_slowdowns(alone, together, threads, repeats, cores, processes=False)
    else:
        alone_times = []

        def time_alone() -> None:
            start = time.perf_counter()
            alone()
            alone_times.append(time.perf_counter() - start)

        rounds = _together_rounds(together, threads, repeats, between=time_alone)
        alone_times = alone_times[1:]  # [0]: the warm-up round's
    ratios = [statistics.median(r) / a for r, a in zip(rounds, alone_times, strict=True)]
    each = _beyond_time_slicing(statistics.median(ratios), len(together), cores)
    # The slowest against the others of its own round, not against the step alone: the step alone
    # jitters as much (two ResNet copies: the later 12% after their mean; against the step alone,
    # whose own rounds spread 87-114 ms, 1.01).
    behind = statistics.median(max(r) / statistics.median(r) for r in rounds)
    return Slowdown(each, each * behind)


def _beyond_time_slicing(slowdown: float, replicas: int, cores: int) -> float:
    """``slowdown`` without the part time-slicing explains (more replicas than cores), at least 1."""
    return max(1.0, slowdown / max(1.0, replicas / cores))


def _backward_step(model: nn.Module, loss_fn: LossFn, x: Any, y: Any):
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        for p in params:
            p.grad = None
        forward_loss(model, loss_fn, x, y).backward()

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
    loss_fn: LossFn,
    inputs: Any,
    targets: Any,
    replicas: int,
    cores: int,
    repeats: int = 3,
) -> Slowdown:
    """Slowdown of ``replicas`` copies of ``model`` doing forward+backward at once: each, and the slowest.

    Each copy computes ``batch / replicas`` samples with ``cores // replicas`` threads, against one
    more copy's step alone, timed in the same rounds. The slowest is what a synchronous job's step
    waits for: two one-thread ResNet copies each ran as fast as one alone (1.0), but the later of the
    two finished 12% after their mean (a 2-core VM). An extreme of each round settles more slowly than
    a median: ``2 * repeats + 1`` rounds.
    """
    _, threads, x, y = _replica_share(profile, inputs, targets, replicas, cores)
    steps = [_backward_step(copy.deepcopy(model), loss_fn, x, y) for _ in range(replicas)]
    alone = _backward_step(copy.deepcopy(model), loss_fn, x, y)
    return paired_slowdowns(alone, steps, threads, 2 * repeats + 1, cores)


def measure_optimizer_contention(
    profile: ModelProfile,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
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
    for _ in range(replicas + 1):  # the last one steps alone, paired with the others together
        replica = copy.deepcopy(model)
        _backward_step(replica, loss_fn, x, y)()
        steps.append(same_optimizer(optimizer, [p for p in replica.parameters() if p.requires_grad]).step)
    return paired_slowdowns(steps[-1], steps[:-1], threads, repeats, cores).each


def measure_in_process(
    profile: ModelProfile,
    model: nn.Module,
    loss_fn: LossFn,
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
    the strategy itself on a copy of ``model``; the factor is its forward+backward step over separate
    replicas: one replica's step alone, timed in the same rounds, times
    :meth:`ModelProfile.contention_factor`.
    """
    from spread.strategies.mirrored import MirroredStrategy  # plan sits above strategies

    previous = torch.get_num_threads()  # the strategy sets the process's thread count: restore it after
    strategy = MirroredStrategy(num_replicas=replicas)
    try:
        replica_model = strategy.prepare_model(copy.deepcopy(model))
        params = [p for p in replica_model.parameters() if p.requires_grad]
        data = strategy.distribute_dataset((inputs, targets), profile.batch, shuffle=False, prefetch=0)
        batch = next(iter(data))

        def replica_step(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
            forward_loss(replica_model, loss_fn, pair[0], pair[1]).backward()

        def step() -> None:
            for p in params:
                p.grad = None
            strategy.run(replica_step, args=(batch,))

        _, threads, x, y = _replica_share(profile, inputs, targets, replicas, cores)
        alone = _backward_step(copy.deepcopy(model), loss_fn, x, y)
        # Each replica gets ``threads`` intra-op threads, as the strategy's ``intra_op_threads="auto"``
        # gives it (at ``cores`` threads each, two replicas oversubscribed the cores and the factor
        # read high). The strategy and one separate replica alone run in the same rounds.
        torch.set_num_threads(threads)
        medians = interleaved_medians({"mirrored": step, "alone": alone}, repeats)
    finally:
        strategy.close()
        torch.set_num_threads(previous)
    separate = medians["alone"] * profile.contention_factor(replicas)
    return _beyond_time_slicing(medians["mirrored"] / separate, replicas, cores)
