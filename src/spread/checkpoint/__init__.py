"""Atomic, verified checkpoints: all-or-nothing writes, checksums, keep-last-k, safe loading.

Replicated state is written once (``state.pt``, loaded with ``weights_only=True``); per-rank state
goes through ``torch.distributed.checkpoint`` (:mod:`spread.checkpoint.sharded`), read back by a
restricted unpickler. Mismatches with what a checkpoint is loaded into are listed in full
(:mod:`spread.checkpoint.compat`).
"""

from spread.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
