"""Activation checkpointing: keep a block's inputs, recompute its activations during backward.

Why: a checkpointed block keeps only its inputs alive between forward and backward instead of every
intermediate tensor; backward runs the block's forward once more to get them back. Memory for
activations drops to about one block's worth plus the block inputs, for roughly one extra forward.

Built on ``torch.utils.checkpoint`` with ``use_reentrant=False`` (the variant that works with
gradient hooks, hence with spread's overlapped all-reduce, and with keyword arguments) and
``preserve_rng_state=True``: the recomputation replays the random draws of the first pass, so dropout
masks are the same and training gives the same weights as without checkpointing.

The module is changed in place (an instance ``forward``), so its type, parameters and state_dict
keys stay the same: checkpoints load both ways. In evaluation (no gradients) nothing is recomputed.

Caveat, replicas on threads (MirroredStrategy, CentralStorageStrategy) with dropout inside
checkpointed blocks: the CPU random generator is one for the whole process, and a recomputation
restores its saved state while other replica threads may be drawing from it, so a replica's replayed
masks are not guaranteed to match its first pass. Use dropout-free checkpointed blocks there, or one
process per replica (MultiWorkerMirroredStrategy), where the replay is exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from spread.memory.forward_wrap import has_wrapper, unwrap_forward, wrap_forward

KIND = "activation_checkpoint"


def _checkpointed(inner: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Checkpoint ``module`` as a whole: only its inputs are kept for backward. Returns ``module``.

    This is checkpointing *per pipeline stage*: call it on a stage's module and each micro-batch keeps
    just the stage input until its backward. Idempotent.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"checkpoint_module expects an nn.Module, got {type(module).__name__}")
    wrap_forward(module, KIND, _checkpointed)
    return module


checkpoint_stage = checkpoint_module  # the name the pipeline code uses for a stage's module


def checkpoint_chunks(fn: Callable[..., Any], *tensors: torch.Tensor, chunks: int, dim: int = 0) -> list[Any]:
    """``[fn(*slice_i) for each of chunks slices of tensors along dim]``, each call checkpointed.

    For computations whose intermediate tensors dwarf their inputs and outputs, such as a language
    model's head and loss (the logits hold tokens x vocabulary numbers): only one slice's
    intermediates exist at a time, in forward and during the recomputation in backward. Tensors
    ``fn`` uses without slicing (weights) are simply captured by ``fn``. The caller combines the
    results (sum the per-slice loss sums, concatenate outputs, ...).
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if not tensors:
        raise ValueError("checkpoint_chunks needs at least one tensor to slice")
    sizes = {t.shape[dim] for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"the tensors disagree on the size of dimension {dim}: {sorted(sizes)}")
    sliced = [t.chunk(chunks, dim=dim) for t in tensors]
    return [_checkpointed(fn, *parts) for parts in zip(*sliced, strict=True)]


def is_checkpointed(module: nn.Module) -> bool:
    return has_wrapper(module, KIND)


def repeated_blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The model's longest ``nn.ModuleList`` / ``nn.Sequential`` (its name and children): the stack
    of repeated blocks of a typical network (transformer layers, residual stages)."""
    best: tuple[str, list[nn.Module]] = ("", [])
    for name, sub in model.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) > len(best[1]):
            best = (name, list(sub))
    if not best[1]:
        raise ValueError(
            f"{type(model).__name__} holds no nn.ModuleList or nn.Sequential of blocks; "
            "name the blocks to checkpoint with blocks=[...]"
        )
    return best


def _select(model: nn.Module, blocks: Any) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(blocks, nn.ModuleList):
        blocks = list(blocks)  # a list of blocks, not a block
    elif isinstance(blocks, (str, type, nn.Module)) or not isinstance(blocks, Iterable):
        blocks = [blocks]
    chosen: dict[int, tuple[str, nn.Module]] = {}
    for item in blocks:
        if isinstance(item, str):
            try:
                module = model.get_submodule(item)
            except AttributeError:
                raise ValueError(f"blocks names {item!r}, which is not a submodule of the model") from None
            chosen.setdefault(id(module), (item, module))
        elif isinstance(item, type) and issubclass(item, nn.Module):
            matches = [(n, m) for n, m in model.named_modules() if isinstance(m, item)]
            if not matches:
                raise ValueError(
                    f"blocks names the type {item.__name__}, but the model has no such submodule"
                )
            for n, m in matches:
                chosen.setdefault(id(m), (n, m))
        elif isinstance(item, nn.Module):
            if id(item) not in names:
                raise ValueError(f"blocks holds a {type(item).__name__} that is not part of the model")
            chosen.setdefault(id(item), (names[id(item)], item))
        else:
            raise TypeError(
                f"blocks items must be submodule names, modules or module types; got {type(item).__name__}"
            )
    return list(chosen.values())


def checkpoint_blocks(
    model: nn.Module,
    blocks: str | nn.Module | type | Sequence[str | nn.Module | type] | None = None,
    *,
    every: int | None = None,
) -> list[str]:
    """Checkpoint chosen blocks of ``model`` (in place); returns their qualified names.

    Args:
        blocks: submodule names (``"layers.0"``), submodules, or module types (every submodule of
            that type, e.g. ``nn.TransformerEncoderLayer``).
        every: instead of ``blocks``: checkpoint blocks 0, every, 2*every, ... of the model's longest
            ``nn.ModuleList``/``nn.Sequential`` (``every=1``: all of them). Fewer checkpointed blocks
            trade memory back for speed.

    Checkpointing a block nested in another checkpointed block gains nothing; choose one level.
    """
    if (blocks is None) == (every is None):
        raise ValueError("checkpoint_blocks needs exactly one of blocks=[...] or every=N")
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer, got {every!r}")
        prefix, children = repeated_blocks(model)
        base = f"{prefix}." if prefix else ""
        selected = [(f"{base}{i}", children[i]) for i in range(0, len(children), every)]
    else:
        selected = _select(model, blocks)
    for _, module in selected:
        checkpoint_module(module)
    return [name for name, _ in selected]


def remove_checkpointing(model: nn.Module) -> int:
    """Undo :func:`checkpoint_blocks` / :func:`checkpoint_module` on ``model`` and its submodules;
    returns how many modules were restored."""
    return sum(unwrap_forward(m, KIND) for m in model.modules())
