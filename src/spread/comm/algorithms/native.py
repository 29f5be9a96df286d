"""``native``: the backend's own all-reduce (gloo on CPU, NCCL on GPU), the baseline."""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.comm.algorithms.base import AllReduceAlgorithm, PendingAllReduce, classify_error


class NativeAllReduce(AllReduceAlgorithm):
    """``dist.all_reduce``; asynchronous calls use the backend's own async work, no extra thread.

    ``bytes_sent`` counts what a ring would send, ``2(N-1)/N`` of the buffer per call (rounded
    down): the backend does not report its traffic, so this is the nominal figure.
    """

    name = "native"

    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        dist.all_reduce(buffer, group=self.group)
        self._count(buffer)

    def all_reduce_async(self, buffer: torch.Tensor) -> PendingAllReduce:
        seq = next(self._seq)
        if not self._validate(buffer):
            return PendingAllReduce()
        if self.debug:
            self._run(buffer, seq)  # the debug check is a blocking collective anyway
            return PendingAllReduce()
        op = self._op(seq)
        try:
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
        except (RuntimeError, dist.DistError) as exc:
            raise classify_error(self.rank, op, seq, exc) from exc
        self._count(buffer)
        return PendingAllReduce(work=work, rank=self.rank, op=op, seq=seq)

    def _count(self, buffer: torch.Tensor) -> None:
        n = self.world_size
        self.bytes_sent += 2 * (n - 1) * buffer.numel() * buffer.element_size() // n
