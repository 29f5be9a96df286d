"""Time step functions in forked one-thread processes, as the processes of a data-parallel job run.

Replicas that are threads of one process slow each other more than separate processes do (they
share one allocator and one address space; which of those costs it was not measured). On
this 2-core VM two one-thread copies of a CNN ran 1.21-1.31x slower as threads and 1.12-1.16x as
processes; a ResNet-style model 1.26x and 0.97x. A forked child starts with the model already in
its memory (copy-on-write), so nothing is pickled or rebuilt. Only at one intra-op thread per child:
GNU OpenMP hangs a forked child's first parallel region with more threads (measured here: a 2-thread
matmul after fork never returned), so callers fall back to threads above one.

Each child waits on its own pipe for a start byte, runs its step, and writes the seconds (or its
error) as one text line back: no pickling. Children are killed and reaped on every exit path.
:func:`busy_processes` forks children that only keep a core busy (the calibration's load).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Iterator, Sequence

import torch

START = b"s"  # any other byte, or the parent closing the pipe, ends the child


class ForkedStepError(RuntimeError):
    """A forked replica's step raised; the message is the child's exception."""


def can_fork() -> bool:
    """Whether steps may run in forked children here (POSIX, and no CUDA context to inherit)."""
    return hasattr(os, "fork") and not torch.cuda.is_initialized()


def _child(step: Callable[[], None], start: int, result: int) -> None:
    """The child's loop: run ``step`` on every start byte, answer its seconds; never returns."""
    code = 0
    try:
        torch.set_num_threads(1)
        while os.read(start, 1) == START:
            began = time.perf_counter()
            step()
            os.write(result, f"{time.perf_counter() - began!r}\n".encode())
    except BaseException as exc:  # reported to the parent, which raises it there
        message = f"error {type(exc).__name__}: {exc}".replace("\n", " ")
        os.write(result, (message[:2000] + "\n").encode())
        code = 1
    finally:
        os._exit(code)


class _Replica:
    """One forked child running one step function, driven through two pipes."""

    def __init__(self, step: Callable[[], None], index: int) -> None:
        self.index = index
        start_read, self.start = os.pipe()
        self.result, result_write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.start)
            os.close(self.result)
            _child(step, start_read, result_write)
        os.close(start_read)
        os.close(result_write)
        self._pending = b""

    def signal(self) -> None:
        os.write(self.start, START)

    def answer(self, deadline: float, what: str) -> float:
        """The seconds of the step just signalled; raises on the child's error or at ``deadline``."""
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.result], [], [], max(left, 0.0))
            if not ready:
                raise TimeoutError(f"forked replica {self.index} did not finish {what} in time")
            chunk = os.read(self.result, 4096)
            if not chunk:
                raise ForkedStepError(f"forked replica {self.index} exited during {what}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        text = line.decode()
        if text.startswith("error "):
            raise ForkedStepError(f"replica {self.index} during {what}: {text[len('error ') :]}")
        return float(text)

    def close(self) -> None:
        for fd in (self.start, self.result):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)


def forked_rounds(
    alone: Callable[[], None],
    together: Sequence[Callable[[], None]],
    repeats: int,
    step_timeout: float = 120.0,
) -> tuple[list[float], list[list[float]]]:
    """``(alone seconds, together seconds)`` per round, each step in its own forked one-thread child.

    Every round runs ``alone``'s child by itself, then all of ``together``'s children at once (a
    start byte to each); one warm-up round first, not returned. Raises :class:`ForkedStepError`
    when a step raises and :class:`TimeoutError` when one takes longer than ``step_timeout``.
    """
    replicas: list[_Replica] = []
    try:
        for index, step in enumerate([alone, *together]):
            replicas.append(_Replica(step, index))
        solo, group = replicas[0], replicas[1:]
        alone_times: list[float] = []
        rounds: list[list[float]] = []
        for r in range(repeats + 1):
            solo.signal()
            seconds_alone = solo.answer(time.monotonic() + step_timeout, f"round {r}'s step alone")
            for replica in group:
                replica.signal()
            deadline = time.monotonic() + step_timeout * max(1, len(group))
            times = [replica.answer(deadline, f"round {r}'s step together") for replica in group]
            if r > 0:  # round 0 warms up: allocator, lazy optimizer state
                alone_times.append(seconds_alone)
                rounds.append(times)
        return alone_times, rounds
    finally:
        for replica in replicas:
            replica.close()


def _spin(parent: int) -> None:
    """A busy child's loop: one-thread matmuls until killed, or until its parent is gone."""
    try:
        torch.set_num_threads(1)
        a = torch.ones(256, 256)
        while os.getppid() == parent:
            a @ a
    finally:
        os._exit(0)


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[int]:
    """``count`` forked one-thread children computing for as long as the block runs.

    Yields how many were started (0 where this platform cannot fork). They are killed and reaped
    when the block ends, however it ends; one whose parent died ends by itself.
    """
    pids: list[int] = []
    parent = os.getpid()
    try:
        if can_fork():
            for _ in range(count):
                pid = os.fork()
                if pid == 0:
                    _spin(parent)
                pids.append(pid)
        yield len(pids)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
