"""ShardedStrategy's models built on the meta device: each rank materialises its shards only, with the
values one device would have drawn.

Built inside ``ShardedStrategy(shard="parameters").scope()`` (under ``torch.device("meta")``),
every operation on meta tensors is recorded (:mod:`spread.memory.meta_init`; a Hugging Face model's
initialisation, which transformers skips on the meta device, is recorded where one device runs it:
:mod:`spread.memory.hf_meta_init`). At the scope's end each rank replays the recording from the
chief's generator states, one tensor at a time: a parameter's final value leaves this rank's chunk
in its block and is freed, a buffer is kept whole. Peak memory is the shards plus about the largest
tensor, and the values are one device's bit for bit, so the equivalence with one device holds from
the first step. The generator ends where one device's would after building the model.

Given to :meth:`~spread.strategies.ShardedStrategy.prepare_model` on the meta device (built
outside the scope, as for FSDP2), nothing was recorded: each module holding meta tensors of its own
is materialised and initialised in turn, in ``model.modules()`` order, by ``init_fn(module)`` or
its ``reset_parameters()`` (FSDP's rule), from the chief's generator state; its parameters then
leave their chunks and are freed. That is one device's values when each module's construction drew
exactly its own ``reset_parameters()`` in that order (torch's layers); a module with neither is
refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from spread.errors import SpreadError
from spread.memory.hf_meta_init import record_skipped_init
from spread.memory.meta_init import MetaInitRecorder, become, default_generator

if TYPE_CHECKING:  # pragma: no cover
    from spread.strategies.sharded import ShardedStrategy

InitFn = Callable[[nn.Module], None]


def materialise(
    strategy: ShardedStrategy,
    recorder: MetaInitRecorder | None,
    modules: Sequence[nn.Module],
    init_fn: InitFn | None,
) -> None:
    """Give every managed parameter and buffer of ``modules`` still on the meta device its value:
    parameters their chunks (their blocks exist), buffers whole. Collective (the chief's generator
    states are broadcast) on every rank alike."""
    targets = _meta_tensors(strategy, modules)
    if not targets:  # the same on every rank: the scope's signature check counts meta tensors
        return
    if strategy.awaiting_state:
        # Joined a running job (spread run --recover): the values come from the live ranks at its
        # admission (broadcast_training_state); they are training, so no collective here.
        for t in targets:
            _take(strategy, t, torch.zeros(t.shape, dtype=t.dtype, device=strategy.device))
        return
    recording = recorder.recording if recorder is not None else None
    if recording is not None and recording.real_draws:
        drawn = ", ".join(sorted(set(recording.real_draws)))
        raise SpreadError(
            f"inside ShardedStrategy.scope(), random numbers were drawn on {recording.device} ({drawn}) "
            "after a draw on the meta device with no seed set in between: one device would have drawn "
            "them after the meta-built tensors' values, from another state. Draw them before building "
            "on the meta device, after torch.manual_seed, or outside the scope"
        )
    if recorder is not None and recording is not None:
        record_skipped_init(recorder, modules)
        recorded = [t for t in targets if recording.created(t)]
    else:
        recorded = []
    recorded_ids = {id(t) for t in recorded}
    rest = [t for t in targets if id(t) not in recorded_ids]
    if recording is not None and recorded:
        states = _chief_states(strategy, recording.states)
        recording.replay(recorded, lambda i, value: _take(strategy, recorded[i], value), states=states)
    _initialise_by_module(strategy, modules, rest, init_fn)


def _meta_tensors(strategy: ShardedStrategy, modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """The managed parameters and buffers of ``modules`` on the meta device, each once."""
    found: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in (*module._parameters.values(), *module._buffers.values()):
            if (
                t is not None
                and t.is_meta
                and (id(t) in strategy._block_of or id(t) in strategy._managed_buffers)
            ):
                found.setdefault(id(t), t)
    return list(found.values())


def _take(strategy: ShardedStrategy, t: torch.Tensor, value: torch.Tensor) -> None:
    if id(t) in strategy._block_of:
        block, i = strategy._block_of[id(t)]
        block.materialise(i, value)
    else:
        become(t, value.clone())


def _chief_states(strategy: ShardedStrategy, states: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank 0's generator states in place of this rank's: every rank replays the chief's draws (as the
    scope's broadcast makes the chief's values win for a model built on a real device)."""
    collectives = strategy.collectives
    collectives.check_same([len(states)], what="random draws while building on the meta device")
    if collectives.world_size == 1 or not states:
        return states
    stacked = torch.stack(states).to(collectives.device)
    collectives.broadcast(stacked, src=0, name="broadcast_initial_rng_states")
    return list(stacked.cpu().unbind(0))


def _initialise_by_module(
    strategy: ShardedStrategy,
    modules: Sequence[nn.Module],
    tensors: list[torch.Tensor],
    init_fn: InitFn | None,
) -> None:
    wanted = {id(t) for t in tensors}
    if not wanted:
        return
    owners = []
    for module in {id(m): m for m in modules}.values():
        own = [
            (name, t)
            for name, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None and id(t) in wanted
        ]
        if not own:
            continue
        if init_fn is None and not callable(getattr(module, "reset_parameters", None)):
            names = ", ".join(name for name, _ in own)
            raise SpreadError(
                f"{type(module).__name__} holds {names} on the meta device, built outside "
                "ShardedStrategy.scope() and without reset_parameters(): nothing says what the values "
                "are. Build the model inside ShardedStrategy(shard='parameters').scope() (every "
                "operation on the meta device is recorded and replayed exactly), or pass "
                "prepare_model(model, init_fn=...) a function initialising one module's own "
                "parameters and buffers"
            )
        owners.append((module, own))
    generator = default_generator(strategy.device)
    [state] = _chief_states(strategy, [generator.get_state()])
    generator.set_state(state)
    for module, own in owners:
        for _, t in own:
            become(t, torch.empty(t.shape, dtype=t.dtype, device=strategy.device))
        with torch.no_grad():
            if init_fn is not None:
                init_fn(module)
            else:
                reset: Callable[[], None] = module.reset_parameters  # type: ignore[assignment]
                reset()
        for _, t in own:
            if id(t) in strategy._block_of:
                block, i = strategy._block_of[id(t)]
                block.materialise(i, t.detach())
