"""``shm``: ranks on one machine sum through a shared-memory segment instead of loopback TCP.

Layout of the segment (created by the group's first rank under ``/dev/shm``, mapped by every
rank, and unlinked as soon as all have mapped it, so nothing is left behind even after a crash):
one int64 sequence counter per rank (64 bytes apart), then ``N + 1`` slots of ``chunk_bytes``:
one input slot per rank and one output slot. Per chunk of the buffer (default 8 MiB):

1. each rank copies its chunk into its input slot, then bumps its counter (barrier A);
2. rank ``r`` sums slice ``r`` of the chunk over all input slots into the output slot
   (fp16/bf16 in fp32, rounded once), then bumps its counter (barrier B);
3. each rank copies the output slot back into its buffer.

The next chunk's step 1 cannot overwrite an input another rank still reads (that rank has not passed
barrier B yet), and step 2 cannot overwrite an output another rank still copies (it would need that
rank's barrier A). A barrier spins on the counters (yielding, then sleeping briefly) and raises
:class:`~spread.errors.CollectiveTimeout` at the collective deadline. The counters rely on stores
becoming visible in program order (x86-64's memory model).

``bytes_sent`` counts what this rank writes into shared memory: its buffer plus its reduced slice.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import socket
import time

import torch

from spread.cluster.rendezvous import default_collective_timeout
from spread.comm.algorithms.base import LOW_PRECISION, AllReduceAlgorithm, segment_bounds
from spread.comm.ops import Collectives
from spread.errors import CollectiveTimeout

DEFAULT_CHUNK_BYTES = 8 << 20
_COUNTER_STRIDE = 8  # int64 slots: one counter per 64-byte cache line


def same_host(collectives: Collectives) -> bool:
    """Whether every rank of the group runs on this machine (collective: all ranks must call)."""
    if collectives.world_size == 1:
        return True
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "big")], dtype=torch.int64, device=collectives.device)
    lo, hi = mine.clone(), mine.clone()
    collectives.all_reduce(lo, "min", name="same_host")
    collectives.all_reduce(hi, "max", name="same_host")
    return bool(lo.item() == hi.item())


class ShmAllReduce(AllReduceAlgorithm):
    """Shared-memory all-reduce for CPU buffers of ranks on one machine."""

    name = "shm"

    def __init__(
        self,
        collectives: Collectives,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> None:
        super().__init__(collectives)
        if chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, got {chunk_bytes!r}")
        if not same_host(collectives):
            raise ValueError(
                "communication 'shm' needs every rank on one machine, but the ranks run on different "
                "hosts; use 'hierarchical' (shared memory inside each node) or 'native'"
            )
        self.chunk_bytes = chunk_bytes // 64 * 64
        self.timeout = default_collective_timeout() if timeout is None else timeout
        self._generation = 0
        self._views: dict[torch.dtype, torch.Tensor] = {}
        self._mm: mmap.mmap | None = None
        self._counters: torch.Tensor | None = None
        if self.world_size > 1:
            self._attach()

    def _attach(self) -> None:
        n = self.world_size
        self._header = n * _COUNTER_STRIDE * 8
        size = self._header + (n + 1) * self.chunk_bytes
        token = torch.zeros(16, dtype=torch.uint8, device=self.collectives.device)
        if self.rank == 0:
            token.copy_(torch.tensor(list(secrets.token_bytes(16)), dtype=torch.uint8))
        self.collectives.broadcast(token, src=self.peers[0], name="shm.token")
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        path = os.path.join(folder, f"spread-shm-{bytes(token.cpu().tolist()).hex()}")
        try:
            if self.rank == 0:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                os.ftruncate(fd, size)
                os.close(fd)
            self.collectives.barrier(name="shm.create")
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.collectives.barrier(name="shm.attach")
        finally:
            if self.rank == 0 and os.path.exists(path):
                os.unlink(path)  # every rank has it mapped (or the setup failed): nothing to leave behind
        self._counters = torch.frombuffer(self._mm, dtype=torch.int64, count=n * _COUNTER_STRIDE)[
            ::_COUNTER_STRIDE
        ]

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._views.get(dtype)
        if view is None:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            per_slot = self.chunk_bytes // itemsize
            n = self.world_size
            flat = torch.frombuffer(self._mm, dtype=dtype, count=(n + 1) * per_slot, offset=self._header)
            view = self._views[dtype] = flat.view(n + 1, per_slot)
        return view

    def _barrier(self, op: str) -> None:
        self._generation += 1
        generation, counters = self._generation, self._counters
        counters[self.rank] = generation
        start = time.monotonic()
        while int(counters.min()) < generation:
            waited = time.monotonic() - start
            if waited > self.timeout:
                behind = [r for r, c in enumerate(counters.tolist()) if c < generation]
                raise CollectiveTimeout(
                    self.rank, op, generation, f"ranks {behind} did not reach the shared-memory barrier"
                )
            time.sleep(0 if waited < 1e-4 else 2e-5 if waited < 1e-2 else 2e-4)

    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu":
            raise ValueError(f"communication 'shm' reduces CPU buffers, got one on {buffer.device}")
        n, r = self.world_size, self.rank
        slots = self._slots(buffer.dtype)
        chunk = slots.shape[1]
        for start in range(0, buffer.numel(), chunk):
            piece = buffer[start : start + chunk]
            m = piece.numel()
            slots[r, :m].copy_(piece)
            self._barrier("shm.all_reduce")
            bounds = segment_bounds(m, n)
            lo, hi = bounds[r], bounds[r + 1]
            if hi > lo:
                out = slots[n, lo:hi]
                if buffer.dtype in LOW_PRECISION:
                    acc = self._scratch("acc", torch.float32, hi - lo, buffer.device)
                    acc.copy_(slots[0, lo:hi])
                    for k in range(1, n):
                        acc.add_(slots[k, lo:hi])
                    out.copy_(acc)
                else:
                    torch.add(slots[0, lo:hi], slots[1, lo:hi], out=out)
                    for k in range(2, n):
                        out.add_(slots[k, lo:hi])
            self._barrier("shm.all_reduce")
            piece.copy_(slots[n, :m])
            self.bytes_sent += (m + hi - lo) * buffer.element_size()

    def broadcast_flat(self, buffer: torch.Tensor, src: int = 0) -> None:
        """Copy group rank ``src``'s 1-D contiguous CPU ``buffer`` to every rank (collective)."""
        if self.world_size == 1:
            return
        n = self.world_size
        slots = self._slots(buffer.dtype)
        for start in range(0, buffer.numel(), slots.shape[1]):
            piece = buffer[start : start + slots.shape[1]]
            if self.rank == src:
                slots[n, : piece.numel()].copy_(piece)
                self.bytes_sent += piece.numel() * piece.element_size()
            self._barrier("shm.broadcast")
            if self.rank != src:
                piece.copy_(slots[n, : piece.numel()])
            self._barrier("shm.broadcast")

    def close(self) -> None:
        super().close()
        self._views.clear()
        self._counters = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with it
                pass
            self._mm = None
