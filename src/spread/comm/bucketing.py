"""Gradient all-reduce packed into flat buckets, overlapped with backward.

Why flat buckets: one all-reduce per ~25 MB instead of one per parameter (gloo and NCCL pay a fixed
cost per call), into buffers allocated once (a fresh large tensor costs page faults every step).
Buckets follow the reverse of parameter registration (roughly the order backward produces
gradients); each bucket's all-reduce starts as soon as it is full and every earlier bucket has
started (the same launch order on every rank), and the end of backward waits for all of them.

Contract (the same as DDP's, so PyTorch users keep their habits):

* after ``loss.backward()`` returns, every parameter's ``.grad`` holds the weighted sum over ranks of
  the gradients that backward produced, ``sum_r scale_r * g_r``. With ``scale_r = n_r / N`` (local
  samples over global samples, set by the strategy from the data pipeline) and a per-replica *mean*
  loss, that is exactly the gradient of the mean loss over the global batch, uneven batches included;
* gradients accumulated *before* this backward are kept and not reduced again, so several backward
  passes without ``zero_grad`` accumulate the same way as on one device;
* inside :meth:`no_sync` backward passes accumulate locally; the next synchronised backward reduces
  everything accumulated since the last exchange (use it for gradient accumulation);
* a parameter that gets no gradient on some rank contributes zeros; one that gets no gradient on any
  rank keeps ``grad is None`` (so optimizers skip it, as on one device). No hang either way;
* a tensor-parallel parameter (``DTensor``) is exchanged by its local shard
  (:mod:`spread.comm.local_parts`): the group is the data axis, whose ranks hold the same shard.

Reentrant activation checkpointing (``use_reentrant=True``) runs nested backward passes and is not
supported, as with DDP; use ``use_reentrant=False``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function

from spread.comm.algorithms import AllReduceAlgorithm
from spread.comm.flight import RECORDER
from spread.comm.local_parts import like_parameter, local_part
from spread.comm.ops import Collectives

DEFAULT_BUCKET_CAP_MB = 25.0
COMPRESSIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor | None = None  # numel gradient slots, then one presence flag per parameter
    wire: torch.Tensor | None = None  # the low-precision copy that is exchanged, with compression
    pending: object = field(default=None, repr=False)
    ready: int = 0  # parameters of this bucket whose gradient arrived in the current backward pass

    def flat(self) -> torch.Tensor:
        if self.buffer is None:
            p0 = self.params[0]
            self.buffer = torch.zeros(self.numel + len(self.params), dtype=p0.dtype, device=p0.device)
        return self.buffer


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Group parameters (in reverse registration order, roughly the order backward produces their
    gradients) into buckets of one device and dtype, each at most ``cap_bytes`` unless one parameter
    alone is larger."""
    buckets: list[_Bucket] = []
    open_by_key: dict[tuple, _Bucket] = {}
    for p in reversed(params):
        key = (p.device, p.dtype)
        bucket = open_by_key.get(key)
        numel = local_part(p).numel()
        nbytes = numel * p.element_size()
        if bucket is None or (bucket.numel * p.element_size() + nbytes > cap_bytes and bucket.params):
            bucket = _Bucket(params=[], offsets=[], numel=0)
            buckets.append(bucket)
            open_by_key[key] = bucket
        bucket.params.append(p)
        bucket.offsets.append(bucket.numel)
        bucket.numel += numel
    return buckets


def _plain_allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype, device=device)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class GradientReducer:
    """Hooks ``params`` so that each backward pass ends with a bucketed, weighted all-reduce."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        collectives: Collectives,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        algorithm: AllReduceAlgorithm | None = None,
        compression: str | None = None,
    ) -> None:
        """``algorithm``: the all-reduce to use (default: ``collectives.all_reduce_async``, the
        backend's own). ``compression``: ``"bf16"`` or ``"fp16"`` to exchange fp32/fp64 buckets as a
        half-precision copy (half the bytes); buckets are packed and unpacked in full precision, and
        the ring, reduce_to_one and shm algorithms add the halves in fp32, but gloo's native
        all-reduce adds them in the low precision itself."""
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(
                f"compression must be None or one of {sorted(COMPRESSIONS)}, got {compression!r}"
            )
        self.algorithm = algorithm
        self.wire_dtype = None if compression is None else COMPRESSIONS[compression]
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        self.collectives = collectives
        self.buckets = _make_buckets(self.params, int(bucket_cap_mb * 2**20))
        self._allocate_buffers()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0  # buckets are launched strictly in index order, the same on every rank
        self.grad_scale = 1.0 / collectives.world_size
        self.sync_enabled = True
        self.reductions = 0  # completed exchanges, for tests and stats
        self.wait_seconds = 0.0  # time spent finishing exchanges (waiting for peers included)
        self._ready: set[int] = set()
        self._fresh: dict[int, torch.Tensor] = {}
        self._local_pending = False  # backward passes ran under no_sync since the last exchange
        self._queued = False
        self._handles = []
        for p in self.params:
            self._handles.append(p.register_hook(self._make_pre_hook(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._post_hook))

    def _allocate_buffers(self) -> None:
        """One arena per (device, dtype) from the algorithm's allocator (collective, the same on every
        rank), sliced into the buckets' flat buffers (and their half-precision wire copies): with
        ``shm`` they live in shared memory and the exchange copies nothing."""
        allocate = self.algorithm.allocate if self.algorithm is not None else _plain_allocate
        groups: dict[tuple, list[_Bucket]] = {}
        for bucket in self.buckets:
            p0 = bucket.params[0]
            groups.setdefault((p0.device, p0.dtype), []).append(bucket)
        for (device, dtype), buckets in groups.items():
            sizes = [_round_up(b.numel + len(b.params), 16) for b in buckets]
            arena = allocate(sum(sizes), dtype, device)
            wire_dtype = self.wire_dtype if dtype in (torch.float32, torch.float64) else None
            wire = allocate(sum(sizes), wire_dtype, device) if wire_dtype is not None else None
            offset = 0
            for bucket, size in zip(buckets, sizes, strict=True):
                n = bucket.numel + len(bucket.params)
                bucket.buffer = arena[offset : offset + n]
                if wire is not None:
                    bucket.wire = wire[offset : offset + n]
                offset += size

    @property
    def overlaps_backward(self) -> bool:
        """Whether an exchange can overlap backward at all: more than one bucket (one bucket starts
        when the last gradient arrives) and an algorithm that runs while backward computes. Where it
        cannot, cutting a compiled graph at bucket boundaries would cost fusion for nothing."""
        overlapping = self.algorithm is None or self.algorithm.overlaps_caller
        return len(self.buckets) > 1 and overlapping

    # -- hooks -----------------------------------------------------------------------------------
    def _make_pre_hook(self, p: nn.Parameter):
        key = id(p)

        def pre_hook(grad: torch.Tensor) -> None:
            # Gradient arriving on top of an already-exchanged one: remember the fresh part only.
            if p.grad is not None and not self._local_pending:
                self._fresh[key] = grad
            else:
                self._fresh.pop(key, None)

        return pre_hook

    def _post_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if key not in self._ready:
            self._ready.add(key)
            self._bucket_of[key].ready += 1
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.sync_enabled:
            # Overlap: start each bucket's all-reduce as soon as it (and every bucket before it) is full,
            # while backward goes on computing the gradients of earlier layers.
            while self._next_launch < len(self.buckets):
                bucket = self.buckets[self._next_launch]
                if bucket.ready < len(bucket.params):
                    break
                self._launch(bucket)
                self._next_launch += 1

    def _end_of_backward(self) -> None:
        self._queued = False
        if not self.sync_enabled:
            self._local_pending = True
            self._ready.clear()
            self._fresh.clear()
            for bucket in self.buckets:
                bucket.ready = 0
            return
        self.reduce_now()

    # -- the exchange ----------------------------------------------------------------------------
    def reduce_now(self) -> None:
        """Finish the exchange: launch the buckets not started during backward (some parameters got
        no gradient), then wait for every bucket in order and write the results into ``.grad``."""
        ready, fresh = self._ready, self._fresh
        started = time.perf_counter()
        RECORDER.begin("gradient_exchange")
        try:
            with record_function("spread.gradient_exchange"):  # a span in traces
                for bucket in self.buckets[self._next_launch :]:
                    self._launch(bucket)
                for bucket in self.buckets:
                    bucket.pending.wait()  # type: ignore[attr-defined]
                    bucket.pending = None
                    if bucket.wire is not None:
                        bucket.flat().copy_(bucket.wire)
                    self._unpack(bucket, ready, fresh)
        finally:
            for bucket in self.buckets:
                bucket.pending, bucket.ready = None, 0
            self._next_launch = 0
            self._ready, self._fresh = set(), {}
            self._local_pending = False
            self.wait_seconds += time.perf_counter() - started
            RECORDER.end()
        self.reductions += 1

    def _launch(self, bucket: _Bucket) -> None:
        self._pack(bucket, self._ready, self._fresh)
        flat = bucket.flat()
        if bucket.wire is not None:
            bucket.wire.copy_(flat)
            flat = bucket.wire
        if self.algorithm is not None:
            bucket.pending = self.algorithm.all_reduce_async(flat)
        else:
            bucket.pending = self.collectives.all_reduce_async(flat, name="grad_all_reduce")

    def _pack(self, bucket: _Bucket, ready: set[int], fresh: dict[int, torch.Tensor]) -> None:
        flat = bucket.flat()
        flags = flat[bucket.numel :]
        scale = self.grad_scale

        def put(slot: torch.Tensor, grad: torch.Tensor) -> None:  # scaled while copied: one pass
            if scale == 1.0:
                slot.copy_(grad)
            else:
                torch.mul(grad, scale, out=slot)

        for i, (p, off) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
            local = local_part(p)
            slot = flat[off : off + local.numel()].view_as(local)
            key = id(p)
            if key in ready and key in fresh:
                put(slot, local_part(fresh[key]))
                assert p.grad is not None  # it has a fresh part, so it has a gradient
                # back to the already-exchanged part; the fresh part is added below
                local_part(p.grad).sub_(local_part(fresh[key]))
                flags[i] = 1
            elif p.grad is not None and (key in ready or self._local_pending):
                put(slot, local_part(p.grad))
                flags[i] = 1
            else:
                slot.zero_()
                flags[i] = 0

    def _unpack(self, bucket: _Bucket, ready: set[int], fresh: dict[int, torch.Tensor]) -> None:
        flat = bucket.flat()
        flags = flat[bucket.numel :].tolist()
        for i, (p, off) in enumerate(zip(bucket.params, bucket.offsets, strict=True)):
            if flags[i] <= 0:
                continue  # no rank produced a gradient for p: leave it as it was
            local = local_part(p)
            slot = flat[off : off + local.numel()].view_as(local)
            key = id(p)
            replaces = p.grad is not None and (key in ready or self._local_pending) and key not in fresh
            if p.grad is None:
                p.grad = like_parameter(slot.clone(), p)
            elif replaces:
                local_part(p.grad).copy_(slot)
            else:
                local_part(p.grad).add_(slot)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in this block; the next synchronised backward exchanges them."""
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def close(self) -> None:
        """Remove the hooks; the parameters behave as plain local parameters again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
