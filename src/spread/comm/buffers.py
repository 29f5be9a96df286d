"""Keep a model's buffers (BatchNorm running statistics, counters) identical across ranks.

Each rank updates its buffers from its own slice of the batch (BatchNorm's running mean and variance
move towards that slice's statistics), so without an exchange the ranks drift apart: a saved model
would hold rank 0's statistics alone and ranks would evaluate with different ones. Called after each
optimizer step, :meth:`BufferAverager.sync` makes them equal again:

* floating-point buffers become the average of every rank's, weighted by each rank's share of the
  global batch. Running statistics are linear in the batch statistics, so the result is the update
  one device would make from the replicas' weighted statistics (for the running mean, exactly the
  global batch's mean). Averaging keeps every rank's information; broadcasting rank 0's (what DDP's
  ``broadcast_buffers`` does) throws the others' away for the same cost;
* integer buffers (``num_batches_tracked``) are counts every rank advances alike: they are not
  averaged; each becomes the largest value over the ranks (equal to every rank's when they agree,
  and no rank can fall behind when one did not run a forward), so they cannot drift either.

Cost: one all-reduce of all floating buffers packed in one flat tensor per dtype (BatchNorm: two
values per channel), plus one small max all-reduce for the integer ones, once per step.

The exchange carries each rank's change since the last sync (``w_r * (b_r - last)``, summed, added
to ``last``), not the buffers themselves: a buffer nobody changed (a constant mask, positional
table) stays bit for bit what it was, instead of drifting by rounding each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spread.comm.ops import Collectives


class BufferAverager:
    """Weighted average of float buffers, and the largest value of integer ones, over a process group."""

    def __init__(self, buffers: Sequence[torch.Tensor], collectives: Collectives) -> None:
        self.collectives = collectives
        self._floats: list[list[torch.Tensor]] = []
        self._integers: list[torch.Tensor] = []
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for b in buffers:
            if b.is_floating_point() or b.is_complex():
                groups.setdefault((b.device, b.dtype), []).append(b)
            else:
                self._integers.append(b)
        self._floats = list(groups.values())
        self._last = [self._flatten(group) for group in self._floats]

    @property
    def num_elements(self) -> int:
        """Floating elements exchanged per sync (what the all-reduce carries)."""
        return sum(flat.numel() for flat in self._last)

    @staticmethod
    def _flatten(group: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in group])

    def reset(self) -> None:
        """Take the buffers as they are now as the common starting point (after they were made
        equal some other way, e.g. a broadcast or a checkpoint loaded on every rank)."""
        self._last = [self._flatten(group) for group in self._floats]

    @torch.no_grad()
    def sync(self, weight: float) -> None:
        """Collective: every rank's float buffers become ``sum_r weight_r * buffer_r`` (``weight`` is
        this rank's; the weights must sum to 1 over the ranks), integer buffers their largest value."""
        if self.collectives.world_size == 1:
            return
        for i, group in enumerate(self._floats):
            last = self._last[i]
            delta = self._flatten(group).sub_(last).mul_(weight)
            self.collectives.all_reduce(delta, name="sync_buffers")
            merged = last.add_(delta)
            offset = 0
            for t in group:
                t.copy_(merged[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        if self._integers:
            flat = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in self._integers])
            self.collectives.all_reduce(flat, "max", name="sync_integer_buffers")
            offset = 0
            for t in self._integers:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
