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
* integer and boolean buffers (``num_batches_tracked``) are not averaged: they travel in the same
  exchange and come back as the weighted average of their changes *rounded to an integer*, which
  is every rank's change when the ranks agree (they advance alike), so they cannot drift either.

Cost: one all-reduce per step of every buffer packed into one flat float64 tensor (BatchNorm: two
values per channel and a counter per layer; float64 holds float32/float16/bfloat16 values and
counts below 2**53 exactly), the same number of collectives as a broadcast of rank 0's.

The exchange carries each rank's change since the last sync (``w_r * (b_r - last)``, summed, added
to ``last``), not the buffers themselves: a buffer nobody changed (a constant mask, positional
table) stays bit for bit what it was, instead of drifting by rounding each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spread.comm.ops import Collectives


class BufferAverager:
    """Weighted average of a set of buffers over a process group, one all-reduce per :meth:`sync`."""

    def __init__(self, buffers: Sequence[torch.Tensor], collectives: Collectives) -> None:
        self.collectives = collectives
        self.buffers = [b for b in buffers if not b.is_complex()]
        if len(self.buffers) != len(buffers):
            raise TypeError("BufferAverager does not average complex buffers")
        self._last = self._flatten()

    @property
    def num_elements(self) -> int:
        """Elements exchanged per sync (what the all-reduce carries, as float64)."""
        return self._last.numel()

    def _flatten(self) -> torch.Tensor:
        if not self.buffers:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in self.buffers])

    def reset(self) -> None:
        """Take the buffers as they are now as the common starting point (after they were made
        equal some other way, e.g. a broadcast or a checkpoint loaded on every rank)."""
        self._last = self._flatten()

    @torch.no_grad()
    def sync(self, weight: float) -> None:
        """Collective: every rank's buffers become ``sum_r weight_r * buffer_r`` (``weight`` is this
        rank's; the weights must sum to 1 over the ranks); integer buffers rounded."""
        if self.collectives.world_size == 1 or not self.buffers:
            return
        delta = self._flatten().sub_(self._last).mul_(weight)
        self.collectives.all_reduce(delta, name="sync_buffers")
        self._last.add_(delta)
        self._write_back()

    def starting_point(self) -> torch.Tensor:
        """A copy of the buffers as the last :meth:`sync` (or :meth:`reset`) left them, equal on every
        rank (a step's forward moves the buffers, not this)."""
        return self._last.clone()

    @torch.no_grad()
    def restore(self, point: torch.Tensor) -> None:
        """Put the buffers back to a :meth:`starting_point` of theirs, and start from it."""
        self._last = point.clone()
        self._write_back()

    def _write_back(self) -> None:
        offset = 0
        for t in self.buffers:
            part = self._last[offset : offset + t.numel()].view_as(t)
            t.copy_(part.round_() if not t.is_floating_point() else part)
            part.copy_(t)  # what the buffer holds after rounding to its dtype: the next starting point
            offset += t.numel()
