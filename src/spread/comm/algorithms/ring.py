"""``ring``: reduce-scatter then all-gather over point-to-point sends, chunked and pipelined.

The buffer is split into ``N`` near-equal segments (:func:`segment_bounds`). In ``N-1``
reduce-scatter steps each rank sends one segment to its right neighbour and adds the segment
arriving from its left one; afterwards rank ``r`` holds the full sum of segment ``r+1``. ``N-1``
all-gather steps then pass the summed segments around. A reduce-scatter step moves its segment in
sub-chunks (default 1 MiB): all receives and sends of a step are posted at once and each arriving
sub-chunk is added while the next ones are still on the wire; an all-gather step, with nothing to
overlap, sends its segment as one message.

Traffic: rank ``r`` sends every segment but ``r+1`` during reduce-scatter and every segment but
``r+2`` during all-gather, so ``bytes_sent`` grows by ``(2*numel - seg[r+1] - seg[r+2]) *
itemsize`` per call: exactly ``2(N-1)/N`` of the buffer when ``N`` divides ``numel``; with uneven
segments the ranks differ by at most two elements, and the sum over ranks is exactly
``2(N-1) * numel * itemsize``.

Precision: fp16/bf16 chunks are added in fp32 (upcast both, add, round once per hop); the partial
sums travel in the buffer's dtype, so a sum is rounded ``N-1`` times, as with any ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.comm.algorithms.base import LOW_PRECISION, AllReduceAlgorithm, segment_bounds
from spread.comm.ops import Collectives

SUB_CHUNK_BYTES = 1 << 20


class RingAllReduce(AllReduceAlgorithm):
    """Bandwidth-optimal ring all-reduce over ``dist.isend``/``dist.irecv``."""

    name = "ring"

    def __init__(self, collectives: Collectives, *, sub_chunk_bytes: int = SUB_CHUNK_BYTES) -> None:
        super().__init__(collectives)
        if sub_chunk_bytes <= 0:
            raise ValueError(f"sub_chunk_bytes must be positive, got {sub_chunk_bytes!r}")
        self.sub_chunk_bytes = sub_chunk_bytes
        n = self.world_size
        self._right = self.peers[(self.rank + 1) % n]
        self._left = self.peers[(self.rank - 1) % n]

    def _all_reduce_flat(self, buffer: torch.Tensor) -> None:
        n, r = self.world_size, self.rank
        bounds = segment_bounds(buffer.numel(), n)

        def segment(i: int) -> torch.Tensor:
            i %= n
            return buffer[bounds[i] : bounds[i + 1]]

        scratch = self._scratch("ring", buffer.dtype, bounds[1] - bounds[0], buffer.device)
        sends: list = []
        for step in range(n - 1):  # reduce-scatter
            sends += self._exchange(segment(r - step), segment(r - step - 1), scratch)
        self._wait(sends)  # the all-gather overwrites segments sent above
        for step in range(n - 1):  # all-gather
            sends += self._exchange(segment(r + 1 - step), segment(r - step), None)
        self._wait(sends)

    @staticmethod
    def _wait(works: list) -> None:
        while works:
            works.pop(0).wait()

    def _exchange(self, send: torch.Tensor, recv: torch.Tensor, scratch: torch.Tensor | None) -> list:
        """Send ``send`` right while receiving ``recv``'s counterpart from the left; add it into
        ``recv`` (through ``scratch``) or, without scratch, receive straight into ``recv``. Returns
        the sends still in flight: a segment sent here is not written again in the same phase (a
        reduce-scatter step adds into the segment it received, an all-gather step receives into a
        segment no earlier step sent), so only the phase boundary has to wait for them."""
        # Sub-chunks only pay off where there is work to overlap with the wire (the additions of the
        # reduce-scatter); the all-gather sends each segment as one message (fewer wake-ups).
        whole = max(1, send.numel(), recv.numel())
        step = max(1, self.sub_chunk_bytes // max(1, send.element_size())) if scratch is not None else whole
        receives = []
        for k, start in enumerate(range(0, recv.numel(), step)):
            target = recv if scratch is None else scratch[: recv.numel()]
            piece = target[start : start + step]
            receives.append((start, piece, dist.irecv(piece, src=self._left, group=self.group, tag=k)))
        sends = []
        for k, start in enumerate(range(0, send.numel(), step)):
            sends.append(dist.isend(send[start : start + step], dst=self._right, group=self.group, tag=k))
        self.bytes_sent += send.numel() * send.element_size()
        for start, piece, work in receives:
            assert work is not None  # None only for a rank outside the group
            work.wait()
            if scratch is not None:
                _accumulate(recv[start : start + piece.numel()], piece)
        return sends


def _accumulate(into: torch.Tensor, part: torch.Tensor) -> None:
    if into.dtype in LOW_PRECISION:
        into.copy_(into.float().add_(part.float()))
    else:
        into.add_(part)
