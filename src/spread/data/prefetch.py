"""Prepare the next batches on a background thread so the training step never waits for data.

Loading runs on one producer thread (PyTorch's loading and indexing release the GIL for the heavy
parts); the consumer measures how long it actually waited, which is the number to watch: if the wait
is a large fraction of the step time, raise ``prefetch`` or use ``num_workers`` processes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from torch.profiler import record_function

T = TypeVar("T")

_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class WaitClock:
    """Seconds the consumer spent blocked waiting for the next batch."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.batches = 0

    def reset(self) -> None:
        self.seconds, self.batches = 0.0, 0


def prefetch(source: Iterator[T], depth: int, clock: WaitClock | None = None) -> Iterator[T]:
    """Iterate ``source`` on a background thread, keeping up to ``depth`` items ready.

    Exceptions raised by ``source`` are re-raised in the consumer. Abandoning the iterator (break,
    garbage collection) stops the producer thread promptly.
    """
    if depth < 1:
        yield from _timed(source, clock)
        return
    items: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in source:
                while not stop.is_set():
                    try:
                        items.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            items.put(_DONE)
        except BaseException as exc:  # handed to the consumer
            items.put(_Failure(exc))

    thread = threading.Thread(target=produce, name="spread-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            started = time.perf_counter()
            with record_function("spread.data_wait"):  # a span in traces (spread run --trace)
                item = items.get()
            if clock is not None:
                clock.seconds += time.perf_counter() - started
                clock.batches += 1
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:
                items.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.05)


def _timed(source: Iterator[T], clock: WaitClock | None) -> Iterator[T]:
    while True:
        started = time.perf_counter()
        try:
            with record_function("spread.data_wait"):
                item = next(source)
        except StopIteration:
            return
        if clock is not None:
            clock.seconds += time.perf_counter() - started
            clock.batches += 1
        yield item
