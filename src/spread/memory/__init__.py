"""Memory tools: train a model whose activations do not fit, on any strategy.

* gradient accumulation (:func:`micro_batches`, ``Trainer(accumulation_steps=k)``): one update from
  ``k`` smaller passes, equal to the whole global batch, one gradient exchange per step;
* activation checkpointing (:func:`checkpoint_blocks`, :func:`checkpoint_module` for a pipeline
  stage, :func:`checkpoint_chunks` for a head and loss computed slice by slice): recompute
  activations in backward instead of keeping them;
* activation offload (:class:`OffloadActivations`, :func:`offload_module`): keep saved activations
  in host memory until backward;
* :class:`SavedTensorBytes`: count the bytes saved for backward (a deterministic memory measure);
  :class:`ActivationMeter`: the peak of those bytes alive at once, per replica
  (``Strategy.measure_activations``).
"""

from spread.memory.accumulation import MicroBatch, micro_batches, no_sync_context, split_batch
from spread.memory.checkpointing import (
    checkpoint_blocks,
    checkpoint_chunks,
    checkpoint_module,
    checkpoint_stage,
    is_checkpointed,
    remove_checkpointing,
)
from spread.memory.measure import ActivationMeter, SavedTensorBytes
from spread.memory.offload import OffloadActivations, offload_module, remove_offload

__all__ = [
    "ActivationMeter",
    "MicroBatch",
    "OffloadActivations",
    "SavedTensorBytes",
    "checkpoint_blocks",
    "checkpoint_chunks",
    "checkpoint_module",
    "checkpoint_stage",
    "is_checkpointed",
    "micro_batches",
    "no_sync_context",
    "offload_module",
    "remove_checkpointing",
    "remove_offload",
    "split_batch",
]
