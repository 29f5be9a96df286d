"""Atomic, verified checkpoints: all-or-nothing writes, checksums, keep-last-k, safe loading."""

from spread.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager"]
