"""The state seam: how every strategy writes and reads training state, in one place.

A *state* is a mapping of names to objects, as in Lightning Fabric's ``save``/``load``:

* ``nn.Module`` and ``torch.optim.Optimizer``: laid out by the strategy's :class:`StateLayout`
  (whole on the chief, pieces per rank through DCP, gathered from pipeline stages, ...);
* objects with ``state_dict()``/``load_state_dict()`` (:class:`Stateful`: the Trainer, a callback,
  a distributed dataset): their ``state_dict()`` is called on every rank (it may be collective) and
  the chief's is written;
* anything else (numbers, strings, tensors, containers of them): written as it is, and put back
  into the mapping on load.

:func:`save` writes one checkpoint through :class:`~spread.checkpoint.CheckpointManager` (atomic
commit, checksums, ``keep`` newest, fallback past a corrupt one on load); :func:`load` restores in
place. What differs per strategy is only its layout's answers; nothing above the strategies knows a
layout. The format is versioned (``FORMAT``); a checkpoint of an older spread is refused by name.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from spread.checkpoint import CheckpointManager
from spread.checkpoint.background import BackgroundWriter
from spread.checkpoint.compat import optimizer_mismatches, raise_if, tensor_mismatches
from spread.checkpoint.manager import SHARDS_KEY
from spread.cluster.rendezvous import default_collective_timeout
from spread.comm.ops import destroy_group
from spread.errors import CheckpointMismatchError, PeerFailedError

if TYPE_CHECKING:  # pragma: no cover
    from spread.strategies.base import Strategy

FORMAT_KEY = "spread_checkpoint"
FORMAT = 2  # 1: the BackupAndRestore layout before the seam (no FORMAT_KEY)
OBJECTS = "objects"


@runtime_checkable
class Stateful(Protocol):
    """What a state's plain objects implement (torch's and Lightning's convention)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@dataclass
class Saved:
    """A module's or optimizer's part of a checkpoint. ``state`` is written once, by the chief;
    ``pieces`` are this rank's pieces of tensors split over the ranks (``DTensor``, ``Shard(0)`` of
    the flattened one-device tensor), written by every rank in parallel through DCP; ``shapes``
    holds each piece's one-device shape (a reader holding the whole tensor reads it whole);
    ``aliases`` names a module's tied weights saved once under another name (``{alias: name}``)."""

    state: dict[str, Any]
    pieces: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, list[int]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Restored:
    """What :meth:`Strategy.load_checkpoint` restored."""

    step: int  # the checkpoint's step
    resume_step: int  # the step this rank continues after (a parameter-server worker's own count)
    # False where only the modules' and optimizers' state reached this rank (an asynchronous
    # parameter-server worker: its Stateful objects must be advanced to ``resume_step`` by the caller).
    restored_objects: bool = True
    written_at_replicas: int | None = None  # the writer's num_replicas_in_sync, where recorded


class StateLayout:
    """How a strategy lays out modules and optimizers in a checkpoint; this base is the one-device
    layout (every rank holds the whole model, the chief writes it). Strategies that hold state
    otherwise subclass it; every method may be collective where its docstring says so, and is then
    called on every rank in the same order."""

    family = "data_parallel"  # checkpoints of the same family resume under each other

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def writer(self) -> dict[str, Any]:
        """Who wrote a checkpoint: what :meth:`refusal` compares against."""
        strategy = self.strategy
        return {
            "strategy": type(strategy).__name__,
            "num_replicas_in_sync": strategy.num_replicas_in_sync,
            "family": self.family,
        }

    def refusal(self, writer: Mapping[str, Any]) -> str | None:
        """Why a checkpoint of ``writer`` cannot resume here, or None. Default: any strategy of the
        same family at any replica count (the one-device state, data counted in global batches)."""
        if writer.get("family") != self.family:
            return (
                f"written by {writer.get('strategy')} ({writer.get('family')} state), which "
                f"{type(self.strategy).__name__} ({self.family}) cannot continue exactly"
            )
        return None

    # -- the one-device state ----------------------------------------------------------------------
    def full_state_dict(self, obj: nn.Module | torch.optim.Optimizer) -> dict[str, Any]:
        """The one-device ``state_dict`` of a module or optimizer (shares storage where it can)."""
        return obj.state_dict()

    def load_full_state_dict(self, obj: nn.Module | torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
        obj.load_state_dict(dict(state))

    def module_signature(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The one-device state's names, shapes and dtypes (tensors whose values are not read)."""
        return dict(self.full_state_dict(model))

    def optimizer_shapes(self, optimizer: torch.optim.Optimizer) -> list[torch.Size]:
        """The one-device shape of each parameter ``optimizer`` steps, in group order."""
        return [p.shape for group in optimizer.param_groups for p in group["params"]]

    # -- checkpoints -------------------------------------------------------------------------------
    def module_state(self, model: nn.Module) -> Saved:
        return Saved(self.full_state_dict(model))

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> Saved:
        return Saved(self.full_state_dict(optimizer))

    def pieces_like(
        self,
        obj: nn.Module | torch.optim.Optimizer,
        shapes: Mapping[str, list[int]],
        dtypes: Mapping[str, str],
    ) -> dict[str, torch.Tensor]:
        """What this rank reads of a saved object's pieces (``shapes``: their one-device shapes):
        default, each whole, flat (the tensor was split over the ranks that wrote it)."""
        return {
            name: torch.empty(math.prod(shape), dtype=dtype_named(dtypes[name]))
            for name, shape in shapes.items()
        }

    def load_module(
        self,
        model: nn.Module,
        state: Mapping[str, Any],
        pieces: Mapping[str, torch.Tensor],
        shapes: Mapping[str, list[int]],
        aliases: Mapping[str, str],
    ) -> None:
        """Load a saved module: ``state`` (the chief's part), this rank's ``pieces`` as
        :meth:`pieces_like` asked for them, of one-device ``shapes``; ``aliases`` as in :class:`Saved`."""
        full = dict(state)
        full.update({name: piece.view(shapes[name]) for name, piece in pieces.items()})
        full.update({alias: full[name] for alias, name in aliases.items()})
        self.load_full_state_dict(model, full)

    def load_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        state: Mapping[str, Any],
        pieces: Mapping[str, torch.Tensor],
        shapes: Mapping[str, list[int]],
    ) -> None:
        full = {
            "state": {i: dict(s) for i, s in state["state"].items()},
            "param_groups": state["param_groups"],
        }
        for name, piece in pieces.items():
            index, key = name.split("/", 1)
            full["state"].setdefault(int(index), {})[key] = piece.view(shapes[name])
        self.load_full_state_dict(optimizer, full)


# -- writing -----------------------------------------------------------------------------------------
def save(
    strategy: Strategy,
    path: str | Path,
    state: Mapping[str, Any],
    *,
    step: int,
    keep: int,
    writes: bool | None = None,
    blocking: bool = True,
) -> Path | str:
    """Write ``state`` as the checkpoint of ``step`` under ``path`` (collective: every rank calls it
    with the same keys in the same order); returns on every rank once it is durable, and raises on
    every rank when it could not be written. ``writes``: whether this rank writes the replicated
    state (default: the chief; a parameter-server task writing its own part passes True).

    ``blocking=False``: gather the state and copy it off the training state here (the step
    boundary), write and commit it on a background thread (:class:`AsyncCheckpoints`), and return
    the checkpoint's final path at once. A write still in flight from an earlier call finishes
    first, and its failure is raised here, on every rank (as a blocking save's would be)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    background = strategy._async_checkpoints
    background.confirm(strategy)  # the previous background write, if any, committed on every rank
    payload, pieces = _collect(strategy, state)
    manager = CheckpointManager(path, keep=keep)
    final = manager.location(step)
    if not blocking:
        background.submit(strategy, manager, step, payload, pieces, writes=writes)
        return final
    if pieces:  # every rank writes its pieces, the chief the rest, one commit (DCP: collective)
        return manager.save(step, payload, shards=pieces)
    failure: Exception | None = None
    if strategy.is_chief if writes is None else writes:
        try:
            final = manager.save(step, payload)
        except Exception as exc:  # told to the other ranks first, then raised
            failure = exc
    agree(strategy, failure, f"the checkpoint of step {step} to {path}")
    return final


def _collect(strategy: Strategy, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checkpoint's replicated payload and this rank's pieces, from the strategy's layout (may be
    collective). Tensors may share the training state's storage."""
    layout = strategy._state_layout()
    objects: dict[str, Any] = {}
    pieces: dict[str, torch.Tensor] = {}
    for key, obj in _checked(state).items():
        kind = _kind(obj)
        if kind in ("module", "optimizer"):
            saved = layout.module_state(obj) if kind == "module" else layout.optimizer_state(obj)
            objects[key] = {
                "kind": kind,
                "state": saved.state,
                "pieces": {name: list(shape) for name, shape in saved.shapes.items()},
                "dtypes": {name: _dtype_name(t.dtype) for name, t in saved.pieces.items()},
                "aliases": dict(saved.aliases),
            }
            pieces.update({f"{key}/{name}": t for name, t in saved.pieces.items()})
        elif kind == "stateful":
            objects[key] = {"kind": "stateful", "state": obj.state_dict()}
        else:
            objects[key] = {"kind": "value", "value": obj}
    return {FORMAT_KEY: FORMAT, "writer": layout.writer(), OBJECTS: objects}, pieces


def agree(strategy: Strategy, failure: BaseException | None, what: str) -> None:
    """Raise on every rank when writing ``what`` failed on some rank (collective): the failing rank
    its own error, the others :class:`~spread.errors.PeerFailedError` naming it."""
    flags = strategy.gather_from_every_rank(torch.tensor([[0.0 if failure else 1.0]]))
    if failure is not None:
        raise failure
    if bool((flags < 1).any()):
        writer = int((flags.flatten() < 1).nonzero()[0].item())
        raise PeerFailedError(
            strategy.rank,
            writer,
            f"it could not write {what} (its log says why); stopping so that no rank runs ahead of it",
        )


class AsyncCheckpoints:
    """A strategy's background checkpoint writes (``save(..., blocking=False)``): at most one in
    flight per process, its failure raised on every rank at the next save or :meth:`confirm`.

    Replicated state (no pieces): the chief alone writes; no collective runs on the background
    thread. Pieces (ShardedStrategy): every rank's DCP write and the commit are collective, so they
    run over a gloo process group of their own (:meth:`_group`, made on the training thread at the
    first such save, as torch recommends for DCP's ``async_save``): collectives of the background
    thread never interleave with the training loop's on the same group, which would deadlock or
    mismatch them. The snapshot itself (gathering pieces, copying tensors) stays on the training
    thread, at the step boundary.

    Holds no reference to the strategy (it is released with the strategy's resources).
    """

    def __init__(self) -> None:
        self._writer: BackgroundWriter | None = None
        self._group: dist.ProcessGroup | None = None
        self._registered = False  # release() is among the strategy's resources
        self.unconfirmed: str | None = None  # what the last background write wrote, until confirmed

    @property
    def writer(self) -> BackgroundWriter:
        if self._writer is None:
            self._writer = BackgroundWriter("checkpoint")
        return self._writer

    def submit(
        self,
        strategy: Strategy,
        manager: CheckpointManager,
        step: int,
        payload: dict[str, Any],
        pieces: dict[str, torch.Tensor],
        *,
        writes: bool | None,
    ) -> None:
        what = f"the checkpoint of step {step} to {manager.directory}"
        if not self._registered:  # released before the groups made earlier (newest first)
            strategy._resources.push(self.release)
            self._registered = True
        group = self._checkpoint_group() if pieces else None
        writer = self.writer
        if pieces or (strategy.is_chief if writes is None else writes):

            def write(copy: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> None:
                state, shards = copy
                manager.save(step, state, shards=shards or None, group=group)

            writer.submit((payload, pieces), write, what)
        self.unconfirmed = what  # on every rank, writer or not: confirm() is collective

    def confirm(self, strategy: Strategy) -> None:
        """Wait for the background write in flight; raise on every rank if it failed on one
        (collective when a write was submitted since the last confirmation; a no-op otherwise)."""
        what, self.unconfirmed = self.unconfirmed, None
        if what is None:
            return
        failure = self._writer.finish() if self._writer is not None else None
        agree(strategy, failure, what)

    def _checkpoint_group(self) -> dist.ProcessGroup | None:
        """The background writes' own gloo group over every rank (made once, collectively, on the
        training thread: every rank saves at the same step boundary)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if self._group is None:
            timeout = timedelta(seconds=default_collective_timeout())
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def finish(self) -> None:
        """Wait for the write in flight without a collective (leaving ``fit`` by an exception, when
        peers may be gone): its failure is warned about, not raised over the exception in flight."""
        self.unconfirmed = None
        if self._writer is None:
            return
        failure = self._writer.finish(timeout=default_collective_timeout() + 60)
        if failure is not None:
            notes = " ".join(getattr(failure, "__notes__", []))
            warnings.warn(f"{type(failure).__name__}: {failure} {notes}", RuntimeWarning, stacklevel=3)

    def release(self) -> None:
        """:meth:`finish`, then destroy the background group (at ``close()``, a regroup, or exit)."""
        self._registered = False
        self.finish()
        group, self._group = self._group, None
        destroy_group(group)


def _checked(state: Mapping[str, Any]) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(f"a checkpoint's state is a mapping of names to objects, got {type(state).__name__}")
    for key in state:
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"state keys are non-empty strings without '/', got {key!r}")
    return state


# -- reading -----------------------------------------------------------------------------------------
def load(
    strategy: Strategy, path: str | Path, state: MutableMapping[str, Any], *, step: int | None
) -> Restored | None:
    """Restore ``state`` in place from the newest valid checkpoint under ``path`` (of ``step`` if
    given); None when there is none. Everything is checked before anything is overwritten, then
    plain objects are restored first (one that refuses the checkpoint, as the Trainer does for
    another batch size, does so before any weight changes), then values, modules and optimizers."""
    layout = strategy._state_layout()
    manager = CheckpointManager(path)

    def pieces_like(payload: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        where = str(path)
        objects = _objects_of(payload, where)
        refusal = layout.refusal(payload.get("writer") or {})
        if refusal is not None:
            raise CheckpointMismatchError(where, "strategy", [refusal])
        problems, like = _compare(layout, _checked(state), objects)
        raise_if(problems, where, "given state")
        return like or None

    found = manager.load_latest(shards_like=pieces_like, step=step)
    if found is None:
        return None
    saved_step, payload = found
    where = manager.location(saved_step)
    try:
        restore(layout, state, payload[OBJECTS], payload.get(SHARDS_KEY) or {})
    except CheckpointMismatchError as exc:  # a plain object refused it (the Trainer's configuration)
        raise CheckpointMismatchError(str(where), exc.what, exc.problems) from None
    replicas = (payload.get("writer") or {}).get("num_replicas_in_sync")
    return Restored(step=saved_step, resume_step=saved_step, written_at_replicas=replicas)


def restore(
    layout: StateLayout,
    state: MutableMapping[str, Any],
    objects: Mapping[str, Any],
    pieces: Mapping[str, Any],
) -> None:
    """Put a checked checkpoint's ``objects`` (and this rank's ``pieces``) into ``state``."""
    for key, obj in list(state.items()):
        record = objects[key]
        if record["kind"] == "stateful":
            obj.load_state_dict(record["state"])
        elif record["kind"] == "value":
            state[key] = record["value"]
    for key, obj in state.items():
        record = objects[key]
        if record["kind"] not in ("module", "optimizer"):
            continue
        own = {name: pieces[f"{key}/{name}"] for name in record["pieces"]}
        if record["kind"] == "module":
            layout.load_module(obj, record["state"], own, record["pieces"], record["aliases"])
        else:
            layout.load_optimizer(obj, record["state"], own, record["pieces"])


def _objects_of(payload: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    version = payload.get(FORMAT_KEY)
    if version is None:
        raise CheckpointMismatchError(
            where,
            "format",
            [
                "written by an earlier spread (checkpoint format 1: BackupAndRestore's layout "
                "before the state seam of November 2026), which this version does not read: resume "
                "with the spread that wrote it, or start afresh (delete the directory)"
            ],
        )
    if version != FORMAT:
        raise CheckpointMismatchError(
            where, "format", [f"checkpoint format {version!r}; this spread reads format {FORMAT}"]
        )
    return payload[OBJECTS]


def _compare(
    layout: StateLayout, state: Mapping[str, Any], objects: Mapping[str, Any]
) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Every difference between the checkpoint's ``objects`` and ``state``, and the pieces this rank
    reads (keyed as saved)."""
    problems: list[str] = []
    like: dict[str, torch.Tensor] = {}
    for key, obj in state.items():
        record = objects.get(key)
        kind = _kind(obj)
        if record is None:
            problems.append(f"missing {kind} {key!r} (the checkpoint holds {sorted(objects)})")
            continue
        if record["kind"] != kind:
            problems.append(f"{key!r}: saved a {record['kind']}, given a {kind}")
            continue
        if kind == "module":
            saved = {**record["state"], **_meta(record)}
            problems += [f"{key}: {p}" for p in tensor_mismatches(saved, layout.module_signature(obj))]
        elif kind == "optimizer":
            problems += [
                f"{key}: {p}"
                for p in optimizer_mismatches(record["state"], obj, layout.optimizer_shapes(obj))
            ]
        if kind in ("module", "optimizer") and record["pieces"]:
            wanted = layout.pieces_like(obj, record["pieces"], record["dtypes"])
            like.update({f"{key}/{name}": t for name, t in wanted.items()})
    return problems, like


def _kind(obj: Any) -> str:
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "stateful" if isinstance(obj, Stateful) else "value"


def _meta(record: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A module record's pieces (and their aliases) as tensors of their one-device shape and dtype,
    holding no data."""
    meta = {
        name: torch.empty(shape, dtype=dtype_named(record["dtypes"][name]), device="meta")
        for name, shape in record["pieces"].items()
    }
    meta.update({alias: meta[name] for alias, name in record["aliases"].items() if name in meta})
    return meta


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointMismatchError("the checkpoint", "dtypes", [f"unknown dtype {name!r}"])
    return dtype
