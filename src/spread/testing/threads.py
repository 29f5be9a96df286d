"""Threads standing in for processes in data-layer tests: a :class:`~spread.data.DataChannel` whose
collectives meet at a barrier, and a runner that raises the first thread's error."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class ThreadChannels:
    """One :class:`~spread.data.DataChannel` per thread (:meth:`channel`); a failing thread calls
    :meth:`abort` so the others' waits end instead of timing out."""

    def __init__(self, threads: int, timeout: float = 10.0) -> None:
        self.barrier = threading.Barrier(threads)
        self.timeout = timeout
        self.slots: list[Any] = [None] * threads

    def abort(self) -> None:
        self.barrier.abort()

    def channel(self, index: int) -> _ThreadChannel:
        return _ThreadChannel(self, index)


class _ThreadChannel:
    def __init__(self, shared: ThreadChannels, index: int) -> None:
        self.shared, self.index = shared, index

    def _meet(self) -> None:
        self.shared.barrier.wait(timeout=self.shared.timeout)

    def sum_over_processes(self, counts: torch.Tensor) -> torch.Tensor:
        self.shared.slots[self.index] = counts.clone()
        self._meet()
        total = torch.stack(self.shared.slots).sum(0)
        self._meet()
        return total

    def broadcast_from_first_process(self, tensors: list[torch.Tensor]) -> None:
        if self.index == 0:
            self.shared.slots[0] = [t.clone() for t in tensors]
        self._meet()
        if self.index != 0:
            for t, sent in zip(tensors, self.shared.slots[0], strict=True):
                t.copy_(sent)
        self._meet()


def run_threads(
    fn: Callable[[int], Any], threads: int, channels: ThreadChannels, timeout: float = 30.0
) -> list:
    """``fn(i)`` on ``threads`` threads; their results in order, or the first error raised."""
    results: list[Any] = [None] * threads
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:
            errors.append(exc)
            channels.abort()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=timeout)
    if errors:
        raise errors[0]
    return results
