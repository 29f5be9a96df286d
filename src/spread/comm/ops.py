"""Collectives over a process group that fail loudly: every error names the rank, the operation and
its sequence number, and says whether a peer was lost or the deadline passed.

A hang is a bug: the deadline is the process group's timeout (set at rendezvous), and gloo raises
when it passes; this module turns gloo's and NCCL's messages into :class:`CollectiveTimeout` and
:class:`PeerLostError` so callers (and tests) can tell the two apart.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from spread.comm.flight import RECORDER, explain_wait
from spread.comm.peers import describe_gone
from spread.errors import CollectiveError, CollectiveTimeout, PeerLostError

# torch 2.13 named the flat collectives ``*_single`` (the old names warn there); torch before 2.13
# has only the old names, with the same signatures.
if hasattr(dist, "reduce_scatter_single"):
    _reduce_scatter_flat, _all_gather_flat = dist.reduce_scatter_single, dist.all_gather_single
else:  # pragma: no cover - older torch (the GPU machines' 2.11)
    _reduce_scatter_flat, _all_gather_flat = dist.reduce_scatter_tensor, dist.all_gather_into_tensor

BROADCAST_RUN_BYTES = 64 * 2**20  # Collectives.broadcast_tensors: the most one flat copy holds

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# gloo and NCCL report failures as text only: this is the one place it is read
_LOST_MARKERS = ("connection", "broken pipe", "eof", "socket")
_TIMEOUT_MARKERS = ("timed out", "timeout")


def classify_error(rank: int, op: str, seq: int, exc: BaseException) -> CollectiveError:
    """A backend error as :class:`CollectiveTimeout`, :class:`PeerLostError` or :class:`CollectiveError`."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    lower = str(exc).lower()
    if any(m in lower for m in _TIMEOUT_MARKERS):
        culprits = explain_wait()
        detail = f"no answer from a peer before the deadline ({text})"
        return CollectiveTimeout(rank, op, seq, f"{detail}: {culprits}" if culprits else detail)
    if any(m in lower for m in _LOST_MARKERS):
        return PeerLostError(rank, op, seq, f"{_who_went_away()} ({text})")
    return CollectiveError(rank, op, seq, text)


def _who_went_away() -> str:
    """Names the ranks on this host whose process exited, when the job's processes were recorded."""
    gone = describe_gone()
    return f"a peer process went away: {gone} exited" if gone else "a peer process went away"


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a subgroup this process made with ``dist.new_group``; a no-op for ``None`` (the default
    group is its creator's to destroy), for a group this rank is not a member of, and for one already
    gone with the default group.

    Its C++ object, and the worker threads it joins when destroyed, live on while any Python object
    still refers to it: drop those references too (:meth:`Collectives.close`).
    """
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # torch no longer knows the group: destroyed already
        pass


class Collectives:
    """The collectives a strategy needs, over one process group, with counted, named failures."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            nccl = dist.get_backend(group) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = device  # where small bookkeeping tensors live (NCCL needs them on the GPU)
        # gloo's reduce-scatter all-reduces a copy of its input and writes through one more buffer
        # (1.5x the input in temporaries, measured in torch 2.13); an all-reduce in place moves the
        # same bytes there and allocates nothing, so on gloo a reduce-scatter is that all-reduce and
        # a copy of this rank's row (the input is scratch either way).
        self._reduce_scatter_in_place = dist.get_backend(group) == "gloo"
        self._seq = itertools.count()
        self._closed = False
        # Seconds the training loop's thread spent in collectives: synchronous ones whole,
        # asynchronous ones in wait() (waiting for its peers, or for the network: not computing).
        self.wait_seconds = 0.0

    def close(self) -> None:
        """Let go of the process group (see :func:`destroy_group`); later calls raise."""
        self.group = None
        self._closed = True

    def _check_open(self, op: str, seq: int) -> None:
        if self._closed:
            raise CollectiveError(self.rank, op, seq, "used after close() (the strategy was closed)")

    @staticmethod
    def _on_training_thread() -> bool:
        """Whether a collective here holds up the training loop (its waits are counted and recorded):
        an algorithm exchanging on a thread of its own overlaps the loop's computing instead (the
        gradient reducer counts the loop's wait for it)."""
        return threading.current_thread() is threading.main_thread()

    def _count_wait(self, seconds: float) -> None:
        if self._on_training_thread():
            self.wait_seconds += seconds

    @contextmanager
    def _guard(self, op: str):
        seq = next(self._seq)
        self._check_open(op, seq)
        started = time.perf_counter()
        recorded = self._on_training_thread()
        if recorded:
            RECORDER.begin(op)
        try:
            with record_function(f"spread.{op}"):  # a span in traces (spread run --trace)
                yield seq
        except CollectiveError:
            raise
        except (RuntimeError, dist.DistError) as exc:
            raise classify_error(self.rank, op, seq, exc) from exc
        finally:
            if recorded:
                RECORDER.end()
                self.wait_seconds += time.perf_counter() - started

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, name: str = "all_reduce") -> torch.Tensor:
        """Reduce ``tensor`` in place across ranks (``op`` in sum, max, min) and return it."""
        if self.world_size == 1:
            return tensor
        with self._guard(name):
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=self.group)
        return tensor

    def all_reduce_async(self, tensor: torch.Tensor, *, name: str = "all_reduce") -> PendingCollective:
        """Start a sum all-reduce; call ``wait()`` on the result before reading ``tensor``."""
        seq = next(self._seq)
        if self.world_size == 1:
            return PendingCollective(None, self.rank, name, seq)
        self._check_open(name, seq)
        try:
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        except (RuntimeError, dist.DistError) as exc:
            raise classify_error(self.rank, name, seq, exc) from exc
        return PendingCollective(work, self.rank, name, seq, self._count_wait)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, name: str = "broadcast") -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        with self._guard(name):
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def broadcast_tensors(
        self,
        tensors: Sequence[torch.Tensor],
        src: int = 0,
        *,
        name: str = "broadcast",
        max_bytes: int = BROADCAST_RUN_BYTES,
    ) -> None:
        """Make every rank's ``tensors`` equal to rank ``src``'s in place: one flat broadcast per run
        of (device, dtype)-alike tensors up to ``max_bytes``, a larger tensor in place on its own. The
        cap bounds the copy: one flat buffer of a whole model doubled its memory at the scope's end."""
        if self.world_size == 1:
            return
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        with torch.no_grad():
            for group in groups.values():
                for run in _runs_of_at_most(group, max_bytes):
                    if len(run) == 1 and run[0].is_contiguous():
                        self.broadcast(run[0].detach(), src=src, name=name)
                        continue
                    flat = torch.cat([t.detach().reshape(-1) for t in run])
                    self.broadcast(flat, src=src, name=name)
                    offset = 0
                    for t in run:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()

    def all_gather(self, tensor: torch.Tensor, *, name: str = "all_gather") -> list[torch.Tensor]:
        """Gather equally shaped tensors from every rank, in rank order."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._guard(name):
            dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def all_gather_uneven(self, tensor: torch.Tensor, *, name: str = "all_gather") -> list[torch.Tensor]:
        """Gather tensors whose first dimension differs across ranks (sizes exchanged first)."""
        if self.world_size == 1:
            return [tensor]
        size = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        sizes = [int(s.item()) for s in self.all_gather(size, name=f"{name}.sizes")]
        longest = max(sizes)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = self.all_gather(padded, name=name)
        return [part[:n] for part, n in zip(parts, sizes, strict=True)]

    def reduce_scatter(
        self, output: torch.Tensor, tensor: torch.Tensor, *, name: str = "reduce_scatter"
    ) -> torch.Tensor:
        """Sum ``tensor`` (``world_size`` equal rows, flat) over ranks; this rank's row lands in
        ``output``. ``tensor`` is scratch: on gloo it is all-reduced in place (see ``__init__``)."""
        if self.world_size == 1:
            return output.copy_(tensor.view(-1))
        with self._guard(name):
            if self._reduce_scatter_in_place:
                dist.all_reduce(tensor, group=self.group)
                output.copy_(self._own_row(tensor))
            else:
                _reduce_scatter_flat(output, tensor, group=self.group)
        return output

    def _own_row(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(self.world_size, -1)[self.rank]

    def all_gather_into(
        self, output: torch.Tensor, tensor: torch.Tensor, *, name: str = "all_gather_into"
    ) -> torch.Tensor:
        """Every rank's ``tensor``, in rank order, into the flat ``output`` (``world_size`` times
        its size): one collective, no list of tensors."""
        if self.world_size == 1:
            return output.copy_(tensor.view(-1))
        with self._guard(name):
            _all_gather_flat(output, tensor, group=self.group)
        return output

    def reduce_scatter_async(
        self, output: torch.Tensor, tensor: torch.Tensor, *, name: str = "reduce_scatter"
    ) -> PendingCollective:
        """Start :meth:`reduce_scatter`; ``wait()`` before reading ``output`` (and before reusing
        ``tensor``, scratch as there)."""
        if self._reduce_scatter_in_place and self.world_size > 1:
            pending = self.all_reduce_async(tensor, name=name)
            pending.then(lambda: output.copy_(self._own_row(tensor)))
            return pending
        return self._start_into(_reduce_scatter_flat, output, tensor, name)

    def all_gather_into_async(
        self, output: torch.Tensor, tensor: torch.Tensor, *, name: str = "all_gather_into"
    ) -> PendingCollective:
        """Start :meth:`all_gather_into`; ``wait()`` before reading ``output``."""
        return self._start_into(_all_gather_flat, output, tensor, name)

    def _start_into(
        self, collective: Callable[..., Any], output: torch.Tensor, tensor: torch.Tensor, name: str
    ) -> PendingCollective:
        """Start ``collective(output, tensor)`` (a flat reduce-scatter or all-gather) asynchronously;
        one rank: a copy."""
        seq = next(self._seq)
        if self.world_size == 1:
            output.copy_(tensor.view(-1))
            return PendingCollective(None, self.rank, name, seq)
        self._check_open(name, seq)
        try:
            work = collective(output, tensor, group=self.group, async_op=True)
        except (RuntimeError, dist.DistError) as exc:
            raise classify_error(self.rank, name, seq, exc) from exc
        return PendingCollective(work, self.rank, name, seq, self._count_wait)

    def ring_shift(
        self, send: Sequence[torch.Tensor], receive: Sequence[torch.Tensor], *, name: str = "ring_shift"
    ) -> None:
        """Point to point around the ring: ``send`` goes to rank ``rank - 1``, ``receive`` is filled
        from rank ``rank + 1`` (both modulo the world size; shapes alike on every rank). One batch of
        sends and receives, so no rank waits for its left neighbour before serving its right one."""
        if self.world_size == 1:
            for out, value in zip(receive, send, strict=True):
                out.copy_(value)
            return
        left, right = (self.rank - 1) % self.world_size, (self.rank + 1) % self.world_size
        ops = [dist.P2POp(dist.isend, t.contiguous(), group=self.group, group_peer=left) for t in send]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=right) for t in receive]
        with self._guard(name):
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def barrier(self, *, name: str = "barrier") -> None:
        if self.world_size == 1:
            return
        flag = torch.zeros(1, device=self.device)
        self.all_reduce(flag, name=name)

    def check_same(self, values: Sequence[int], *, what: str) -> None:
        """Raise on every rank if ``values`` differ across ranks (e.g. a model signature)."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        lo, hi = mine.clone(), mine.clone()
        self.all_reduce(lo, "min", name=f"check_same[{what}]")
        self.all_reduce(hi, "max", name=f"check_same[{what}]")
        if not torch.equal(lo, hi):
            raise CollectiveError(self.rank, f"check_same[{what}]", -1, f"ranks disagree on {what}")


class PendingCollective:
    """An asynchronous collective in flight; ``wait()`` raises the same named errors as the sync ones,
    and reports how long it waited to ``on_wait``."""

    def __init__(
        self,
        work: dist.Work | None,
        rank: int,
        name: str,
        seq: int,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self._work, self._rank, self._name, self._seq = work, rank, name, seq
        self._on_wait = on_wait
        self._then: Callable[[], Any] | None = None

    def then(self, finish: Callable[[], Any]) -> None:
        """Run ``finish`` once the collective has completed, inside :meth:`wait` (a copy out of
        the collective's buffer, for example)."""
        self._then = finish

    def done(self) -> bool:
        """Whether :meth:`wait` would return at once (the collective completed, or failed)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            started = time.perf_counter()
            # Recorded where it is waited for: every rank waits for its collectives in the same order.
            recorded = threading.current_thread() is threading.main_thread()
            if recorded:
                RECORDER.begin(self._name)
            try:
                self._work.wait()
            except (RuntimeError, dist.DistError) as exc:
                self._then = None
                raise classify_error(self._rank, self._name, self._seq, exc) from exc
            finally:
                if recorded:
                    RECORDER.end()
                self._work = None
                if self._on_wait is not None:
                    self._on_wait(time.perf_counter() - started)
        finish, self._then = self._then, None
        if finish is not None:
            finish()


def _runs_of_at_most(tensors: list[torch.Tensor], max_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` in order, in consecutive runs of at most ``max_bytes`` (a larger one alone)."""
    runs: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not runs or size + nbytes > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(t)
        size += nbytes
    return runs
