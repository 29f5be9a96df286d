"""``reduce_to_one``: gather every buffer on the group's first rank, sum there, broadcast the sum
(TensorFlow's ``ReductionToOneDevice``). Simple and exact-order; the root's link carries
``N-1`` buffers each way, so it is for small groups and as a reference.

Precision: the root sums in fp32 for fp16/bf16 buffers (fp32/fp64 in their own dtype), in rank
order, and rounds once. ``bytes_sent``: a non-root rank sends its buffer once; the root counts the
broadcast as ``N-1`` buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.comm.algorithms.base import AllReduceAlgorithm, accumulation_dtype


class ReduceToOneAllReduce(AllReduceAlgorithm):
    """Gather to rank 0 of the group (point-to-point), reduce there, broadcast."""

    name = "reduce_to_one"

    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        n, numel, nbytes = self.world_size, buffer.numel(), buffer.numel() * buffer.element_size()
        root = self.peers[0]
        if self.rank == 0:
            parts = self._scratch("gather", buffer.dtype, (n - 1) * numel, buffer.device).view(n - 1, numel)
            works = [dist.irecv(parts[i - 1], src=self.peers[i], group=self.group) for i in range(1, n)]
            acc_dtype = accumulation_dtype(buffer.dtype)
            acc = buffer if acc_dtype == buffer.dtype else buffer.to(acc_dtype)
            for work, part in zip(works, parts, strict=True):
                assert work is not None  # None only for a rank outside the group
                work.wait()
                acc.add_(part)
            if acc is not buffer:
                buffer.copy_(acc)
            self.bytes_sent += (n - 1) * nbytes
        else:
            dist.send(buffer, dst=root, group=self.group)
            self.bytes_sent += nbytes
        dist.broadcast(buffer, src=root, group=self.group)
