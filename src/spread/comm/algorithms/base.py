"""The all-reduce template: one public call that validates and short-cuts, one hook per algorithm.

Every algorithm sums a flat, contiguous buffer in place over the ranks of a :class:`Collectives`'
group. :meth:`AllReduceAlgorithm.all_reduce` checks the buffer, returns at once for one rank or an
empty buffer, optionally checks that every rank passes the same number of elements (set
``SPREAD_DEBUG_COLLECTIVES=1``; it costs two small collectives per call), and turns backend errors
into the named :class:`~spread.errors.CollectiveError` family. Subclasses implement
:meth:`_all_reduce_flat` only.

Asynchronous calls: algorithms that drive the exchange from Python run it on one dedicated
background thread per instance, so calls complete in the order they were made on every rank (the
condition for point-to-point exchanges to match up across ranks).
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

import torch
import torch.distributed as dist

from spread.comm.ops import Collectives, classify_error

__all__ = ["AllReduceAlgorithm", "PendingAllReduce", "classify_error", "segment_bounds"]
from spread import env
from spread.errors import CollectiveError

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LOW_PRECISION = (torch.float16, torch.bfloat16)


def debug_collectives() -> bool:
    """Whether ``SPREAD_DEBUG_COLLECTIVES=1`` asks for cross-rank checks of every call."""
    return os.environ.get(env.DEBUG_COLLECTIVES, "") == "1"


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 partial sums are computed in fp32; fp32 and fp64 in their own precision."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def segment_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` offsets splitting ``numel`` elements into near-equal segments; the first
    ``numel % parts`` segments hold one element more."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class PendingAllReduce:
    """An all-reduce in flight; ``wait()`` returns once the buffer holds the sum (or raises)."""

    def __init__(
        self,
        future: Future | None = None,
        work: dist.Work | None = None,
        *,
        run: Callable[[], None] | None = None,
        rank=0,
        op="",
        seq=0,
    ):
        self._future, self._work, self._run = future, work, run
        self._rank, self._op, self._seq = rank, op, seq

    def wait(self) -> None:
        if self._run is not None:  # a deferred call: do the work now, on this thread
            run, self._run = self._run, None
            run()
        if self._future is not None:
            future, self._future = self._future, None
            future.result()
        if self._work is not None:
            work, self._work = self._work, None
            try:
                work.wait()
            except (RuntimeError, dist.DistError) as exc:
                raise classify_error(self._rank, self._op, self._seq, exc) from exc


class AllReduceAlgorithm(ABC):
    """Sum a flat buffer in place across the ranks of ``collectives.group``.

    Contract: every rank of the group calls :meth:`all_reduce` / :meth:`all_reduce_async` the same
    number of times, in the same order, with buffers of the same numel and dtype. Buffers passed to
    :meth:`all_reduce_async` must not be read or written until ``wait()`` returns. ``bytes_sent``
    counts the payload bytes this rank sent (see each algorithm for what it counts).
    """

    name: ClassVar[str] = "?"
    #: whether :meth:`all_reduce_async` makes progress while the caller goes on computing (on a thread
    #: or in the backend); ``False`` where it is deferred to ``wait()``. Read by the gradient reducer:
    #: cutting a compiled model's graph into pieces only pays where the exchange can overlap them.
    overlaps_caller: ClassVar[bool] = True

    def __init__(self, collectives: Collectives) -> None:
        self.collectives = collectives
        self.group = collectives.group
        self.rank = collectives.rank
        self.world_size = collectives.world_size
        self.bytes_sent = 0
        # global ranks of the group's members, for point-to-point calls
        self.peers = (
            dist.get_process_group_ranks(self.group)
            if self.group is not None
            else list(range(self.world_size))
        )
        self.debug = debug_collectives()
        self._seq = itertools.count()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # -- public template ---------------------------------------------------------------------------
    def all_reduce(self, buffer: torch.Tensor) -> torch.Tensor:
        """Sum ``buffer`` over the ranks, in place, and return it."""
        seq = next(self._seq)
        if self._validate(buffer):
            self._run(buffer, seq)
        return buffer

    def all_reduce_async(self, buffer: torch.Tensor) -> PendingAllReduce:
        """Start the sum of ``buffer`` over the ranks; call ``wait()`` before reading it."""
        seq = next(self._seq)
        if not self._validate(buffer):
            return PendingAllReduce()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"spread-{self.name}")
        return PendingAllReduce(self._executor.submit(self._run, buffer, seq))

    def close(self) -> None:
        """Finish queued work and release threads and other resources; safe to call twice. Later calls
        raise (the process group is let go, see :func:`spread.comm.ops.destroy_group`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.group = None
        self._closed = True

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled 1-D buffer that this algorithm all-reduces fastest (collective: every rank
        allocates the same sizes in the same order). Default: a plain tensor; ``shm`` places it in
        shared memory so that the exchange needs no copy."""
        return torch.zeros(numel, dtype=dtype, device=device)

    # -- the hook ---------------------------------------------------------------------------------
    @abstractmethod
    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        """Sum the 1-D contiguous, non-empty ``buffer`` in place over ``world_size >= 2`` ranks."""

    # -- shared machinery -------------------------------------------------------------------------
    def _op(self, seq: int) -> str:
        return f"{self.name}.all_reduce"

    def _scratch(self, key: str, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """A reusable work buffer of at least ``numel`` elements (grown, never shrunk)."""
        cache = self.__dict__.setdefault("_scratch_cache", {})
        have = cache.get((key, dtype, device))
        if have is None or have.numel() < numel:
            have = cache[(key, dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
        return have[:numel]

    def _validate(self, buffer: torch.Tensor) -> bool:
        """Raise on a malformed buffer or a closed algorithm; return False when there is nothing to
        exchange."""
        if self._closed:
            raise CollectiveError(self.rank, f"{self.name}.all_reduce", -1, "the algorithm was closed")
        if not isinstance(buffer, torch.Tensor):
            raise TypeError(f"{self.name} all_reduce expects a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(
                f"{self.name} all_reduce expects a 1-D contiguous buffer, got shape {tuple(buffer.shape)}"
            )
        if buffer.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"{self.name} all_reduce supports {names}; got {buffer.dtype}")
        return self.world_size > 1 and (buffer.numel() > 0 or self.debug)

    def _run(self, buffer: torch.Tensor, seq: int) -> None:
        op = self._op(seq)
        try:
            if self.debug:
                code = SUPPORTED_DTYPES.index(buffer.dtype)
                self.collectives.check_same([buffer.numel(), code], what=f"{op} buffer numel and dtype")
                if buffer.numel() == 0:
                    return
            self._all_reduce_flat(buffer)
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            raise classify_error(self.rank, op, seq, exc) from exc
