"""Bind each pipeline stage process on a node to its own CPUs (Linux; CPU pipelines).

Why: stages hand work to each other. When a stage sends to a neighbour that is blocked waiting for
it, Linux tends to wake the neighbour's threads on the *sender's* CPU (a synchronous wake-up pulls
the wakee towards the waker), so for a few milliseconds both stages share one CPU while the other
sits idle, until the load balancer separates them (our reading of the measurements below).
Measured on a 2-core VM with two stages of a deep MLP: a 256 KB ``isend`` to a waiting peer took
2.4-4.3 ms unbound and 0.26 ms bound, and 1F1B steps took less time bound
(docs/results/2026-11-23-pipelines.md, run 5).
Binding keeps every stage on its own cores.

:func:`bind_local_cpus` splits the CPUs this process may use into ``local_world_size`` equal
contiguous parts and binds every thread of the process (the gloo transport thread, the heartbeat,
intra-op threads) to part ``local_rank``; threads created later inherit it. It does nothing where a
launcher or the user already narrowed the process's CPUs (its mask is smaller than the CPUs the
node's cgroup allows), where there are fewer CPUs than local processes, or off Linux. The cost:
a bound stage cannot move away from a CPU that other busy jobs load, so on a shared, oversubscribed
machine binding can lose (``PipelineStrategy(bind_cpus=False)``).
"""

from __future__ import annotations

import os

import torch

_CGROUP_CPUS = "/sys/fs/cgroup/cpuset.cpus.effective"


def _parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _allowed_cpus() -> set[int] | None:
    """The CPUs this node lets the job use (its cgroup's cpuset), or None when unknown."""
    try:
        with open(_CGROUP_CPUS) as f:
            return _parse_cpu_list(f.read())
    except (OSError, ValueError):
        return None


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _set_all_threads(cpus: set[int]) -> None:
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass


class CpuBinding:
    """This process's binding: ``cpus`` (sorted) and :meth:`restore` to undo it."""

    def __init__(self, cpus: tuple[int, ...], previous: set[int], previous_threads: int) -> None:
        self.cpus, self._previous, self._previous_threads = cpus, previous, previous_threads
        self._restored = False

    def restore(self) -> None:
        """Give every thread its former CPUs back, and torch its former intra-op thread count."""
        if self._restored:
            return
        self._restored = True
        _set_all_threads(self._previous)
        if torch.get_num_threads() != self._previous_threads:
            torch.set_num_threads(self._previous_threads)

    def __repr__(self) -> str:
        return f"CpuBinding(cpus={list(self.cpus)})"


def plan_binding(
    local_rank: int, local_world_size: int, mask: set[int], allowed: set[int] | None
) -> tuple[int, ...] | None:
    """The CPUs local rank ``local_rank`` should use, or None to leave the process alone."""
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        return None
    if allowed is not None and not allowed <= mask:
        return None  # someone already narrowed this process: respect their placement
    cpus = sorted(mask)
    share = len(cpus) // local_world_size
    if share < 1:
        return None  # more local processes than CPUs: binding would only stack them
    return tuple(cpus[local_rank * share : (local_rank + 1) * share])


def bind_local_cpus(local_rank: int, local_world_size: int) -> CpuBinding | None:
    """Bind this process (every thread) to its share of the node's CPUs; None when not bound.

    Also lowers torch's intra-op threads to the bound CPU count (never raises it) unless
    ``OMP_NUM_THREADS`` is set, so a stage does not run more compute threads than it has CPUs.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        mask = os.sched_getaffinity(0)
    except OSError:
        return None
    cpus = plan_binding(local_rank, local_world_size, mask, _allowed_cpus())
    if cpus is None or set(cpus) == mask:
        return None
    previous_threads = torch.get_num_threads()
    _set_all_threads(set(cpus))
    if "OMP_NUM_THREADS" not in os.environ and previous_threads > len(cpus):
        torch.set_num_threads(len(cpus))
    return CpuBinding(cpus, mask, previous_threads)
