"""ShardedStrategy's buddy copy: what lets its survivors recover without restart (``spread run --recover``).

Each rank holds the only copy of its shard of the optimizer state (and, at ``shard="parameters"``, of
the weights), so a lost rank would take its shard with it. Under ``--recover`` (and never otherwise),
after each optimizer step every rank also keeps a copy of its ring neighbour's shard: rank ``r`` sends
its parameter chunks and per-element optimizer state to rank ``r - 1`` and receives rank ``r + 1``'s
(one batch of point-to-point sends, 1/N more model state per rank). After a loss the survivors
rebuild every old rank's shard from their own and from the copies of the lost ranks' shards
(:func:`reassemble`), and the strategy cuts it again for the smaller world. Two ring neighbours lost
together took the only copies of one shard: refused by name (:func:`check_recoverable_loss`).

A loss inside the step boundary (after the step's last collective, before the exchange ended on every
rank) leaves the survivors' shards one optimizer step ahead of the lost rank's copy: the survivors have
stepped, its keeper still holds its shard of the step before. So every rank also keeps its own shard
as it was before its latest optimizer step (a :class:`RollbackPoint`, 1/N more model state): the
survivors then go back to that step, the lost rank's copy matches them, and the step is repeated like
any step in flight.

A process that joins the running job (a machine that came back) takes part in the same collective
with nothing of its own (zeros, the layout of a shard told by a survivor: :func:`entries_to_plain`),
so it receives every old rank's shard from the live ranks, and the strategy cuts the state for the
larger world the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spread.comm import Collectives
from spread.comm.buffers import BufferAverager
from spread.errors import SpreadError
from spread.strategies.sharded_block import ParameterBlock, is_per_element

PARAMETER = ""  # an entry's key for the parameter's own chunk (optimizer state keys are never empty)


@dataclass(frozen=True)
class Entry:
    """One chunk in a packed shard: block ``block``'s tensor ``index``, its parameter (``key`` empty)
    or one per-element optimizer state; at ``offset`` in the flat tensor of its ``dtype``."""

    block: int
    index: int
    key: str
    dtype: torch.dtype
    offset: int
    numel: int


def pack(
    blocks: Sequence[ParameterBlock], optimizer: torch.optim.Optimizer | None
) -> tuple[list[Entry], dict[torch.dtype, torch.Tensor]]:
    """This rank's shard: its parameter chunks and per-element optimizer state, one flat tensor per
    dtype (the same entries, in the same order, on every rank at the same step)."""
    entries: list[Entry] = []
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}

    def add(block: int, index: int, key: str, value: torch.Tensor) -> None:
        flat = value.detach().reshape(-1)
        entries.append(Entry(block, index, key, flat.dtype, sizes.get(flat.dtype, 0), flat.numel()))
        parts.setdefault(flat.dtype, []).append(flat)
        sizes[flat.dtype] = sizes.get(flat.dtype, 0) + flat.numel()

    for j, block in enumerate(blocks):
        for i, shard in enumerate(block.shards):
            add(j, i, PARAMETER, shard)
            state = optimizer.state.get(shard, {}) if optimizer is not None else {}
            for key in sorted(state):
                if is_per_element(key, state[key], shard.shape):
                    add(j, i, key, state[key])
    return entries, {dtype: torch.cat(flats) for dtype, flats in parts.items()}


class BuddyCopy:
    """This rank's copy of its right neighbour's shard, taken at a step boundary."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.flats: dict[torch.dtype, torch.Tensor] = {}
        self.step = -1  # optimizer steps applied when it was taken (-1: never)

    def refresh(
        self,
        collectives: Collectives,
        blocks: Sequence[ParameterBlock],
        optimizer: torch.optim.Optimizer | None,
        step: int,
    ) -> None:
        """Collective (point to point around the ring): send this rank's shard to its left neighbour,
        keep the right one's. Kept only once the exchange completed (``step`` then says which)."""
        entries, mine = pack(blocks, optimizer)
        received = {dtype: torch.empty_like(flat) for dtype, flat in mine.items()}
        collectives.ring_shift(list(mine.values()), list(received.values()), name="sharded.buddy_copy")
        self.entries, self.flats, self.step = entries, received, step


@dataclass
class RollbackPoint:
    """This rank's own state as it was before its latest optimizer step (version ``step``): its packed
    shard, each shard's optimizer state that is not per element (Adam's step count), every parameter
    group's hyperparameters (a schedule moves the learning rate after the step) and the model's
    buffers as averaged after the step before (:meth:`BufferAverager.starting_point`; None: none)."""

    step: int
    entries: list[Entry]
    flats: dict[torch.dtype, torch.Tensor]
    scalars: dict[tuple[int, int], dict[str, Any]]
    groups: list[dict[str, Any]]
    buffers: torch.Tensor | None
    steps_with_buffers: int

    def optimizer_states(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Each shard's optimizer state by its place ``(block, index)``, per-element entries None (they
        come with the rebuilt shards); shards without state left out."""
        states = {place: dict(scalars) for place, scalars in self.scalars.items()}
        for e in self.entries:
            if e.key:
                states[(e.block, e.index)][e.key] = None
        return {place: state for place, state in states.items() if state}


def _copied(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def take_rollback_point(
    blocks: Sequence[ParameterBlock],
    optimizer: torch.optim.Optimizer,
    step: int,
    averager: BufferAverager | None,
    steps_with_buffers: int,
) -> RollbackPoint:
    """Local: this rank's state before the optimizer step that makes ``step + 1`` (taken in the step's
    pre-hook; the buffers from ``averager``, as its last sync left them)."""
    entries, flats = pack(blocks, optimizer)
    scalars: dict[tuple[int, int], dict[str, Any]] = {}
    for j, block in enumerate(blocks):
        for i, shard in enumerate(block.shards):
            state = optimizer.state.get(shard, {})
            scalars[(j, i)] = {
                key: _copied(value)
                for key, value in state.items()
                if not is_per_element(key, value, shard.shape)
            }
    groups = [{k: _copied(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    buffers = averager.starting_point() if averager is not None else None
    return RollbackPoint(step, entries, flats, scalars, groups, buffers, steps_with_buffers)


def restore_rollback_settings(
    optimizer: torch.optim.Optimizer, point: RollbackPoint, averager: BufferAverager | None
) -> None:
    """Put back what a rollback point kept besides the shards: the groups' hyperparameters and the
    buffers (the shards and their optimizer state are rebuilt by the caller)."""
    for group, settings in zip(optimizer.param_groups, point.groups, strict=True):
        group.update({k: _copied(v) for k, v in settings.items()})
    if averager is not None and point.buffers is not None:  # the same buffers: the regroup rebuilt it
        averager.restore(point.buffers)


def entries_to_plain(entries: Sequence[Entry]) -> list[list[Any]]:
    """A shard's layout as plain values (JSON-safe, for a process that joins: it holds no shard yet)."""
    return [
        [e.block, e.index, e.key, str(e.dtype).removeprefix("torch."), e.offset, e.numel] for e in entries
    ]


def entries_from_plain(rows: Sequence[Sequence[Any]]) -> list[Entry]:
    """:func:`entries_to_plain` read back; a dtype torch does not name is refused."""
    entries = []
    for block, index, key, dtype_name, offset, numel in rows:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise SpreadError(f"ShardedStrategy: a peer described a shard of unknown dtype {dtype_name!r}")
        entries.append(Entry(int(block), int(index), str(key), dtype, int(offset), int(numel)))
    return entries


def _zeros_of(entries: Sequence[Entry], device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    """Flat zeros the size of a packed shard of this layout, per dtype in :func:`pack`'s order."""
    sizes: dict[torch.dtype, int] = {}
    for e in entries:
        sizes[e.dtype] = max(sizes.get(e.dtype, 0), e.offset + e.numel)
    return {dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}


def check_recoverable_loss(old_world: int, lost: Sequence[int]) -> None:
    """Refuse a loss that took both copies of a shard: rank ``l``'s is kept by rank ``l - 1``."""
    gone = set(lost)
    for rank in sorted(gone):
        keeper = (rank - 1) % old_world
        if keeper in gone and keeper != rank:
            raise SpreadError(
                f"ShardedStrategy cannot recover without restart from losing ranks {keeper} and {rank} "
                f"of {old_world} together: rank {rank}'s shard of the model state was kept (as a buddy "
                f"copy) only by rank {keeper}, so it exists nowhere any more. The job fails as without "
                f"--recover (--max-restarts with BackupAndRestore restarts it from the last backup)"
            )


def reassemble(
    collectives: Collectives,
    old_rank: int | None,
    old_world: int,
    lost: Sequence[int],
    blocks: Sequence[ParameterBlock],
    optimizer: torch.optim.Optimizer | None,
    buddy: BuddyCopy,
    steps_applied: int,
    rollback: RollbackPoint | None = None,
    joiner_entries: Sequence[Entry] = (),
) -> tuple[dict[tuple[int, int, str], torch.Tensor], int]:
    """Collective over the new group: every old rank's shard, from its owner or (a lost rank's) from
    the buddy copy its left neighbour kept, as the whole one-device tensors ``{(block, index, key):
    tensor}`` (``key`` empty: the parameter), and the number of optimizer steps they are of. A
    survivor one step ahead of the lost rank's copy contributes its ``rollback`` point instead (the
    caller then restores the rest of it). A process that joined (``old_rank`` None) holds no shard:
    it adds zeros laid out as ``joiner_entries`` (a survivor's :func:`pack` layout) and receives the
    rest. Refused, naming why, when no common step can be rebuilt."""
    holds = old_rank is not None and (old_rank + 1) % old_world in lost  # it kept a lost rank's shard
    has_shard = int(old_rank is not None)
    progress = torch.tensor(
        [
            [
                steps_applied,
                buddy.step if holds else -1,
                rollback.step if rollback is not None else -1,
                has_shard,
            ]
        ],
        dtype=torch.int64,
    )
    gathered = collectives.all_gather(progress.to(collectives.device), name="sharded.recover_versions")
    reported = [row.tolist() for part in gathered for row in part.reshape(-1, 4)]
    version = agreed_version(reported, lost)
    behind = old_rank is not None and steps_applied != version  # it goes back to its rollback point
    if old_rank is None:
        entries, mine = list(joiner_entries), _zeros_of(joiner_entries, collectives.device)
    elif behind:
        assert rollback is not None, "agreed_version checked every survivor can reach the version"
        entries, mine = rollback.entries, rollback.flats
    else:
        entries, mine = pack(blocks, optimizer)
    if holds and entries != buddy.entries:
        raise SpreadError("ShardedStrategy: the buddy copy's layout differs from this rank's shard")
    tables: dict[torch.dtype, torch.Tensor] = {}
    for dtype, flat in mine.items():
        table = flat.new_zeros(old_world, flat.numel())
        if old_rank is not None:
            table[old_rank] = flat
        if holds and old_rank is not None:
            table[(old_rank + 1) % old_world] = buddy.flats[dtype]
        # Each row is written by exactly one survivor (zeros elsewhere): the sum is the row, exact.
        tables[dtype] = collectives.all_reduce(table, name="sharded.recover_shards")
    whole: dict[tuple[int, int, str], torch.Tensor] = {}
    for e in entries:
        layout = blocks[e.block].layout
        rows = tables[e.dtype][:, e.offset : e.offset + e.numel]
        numel = layout.numel(e.index)
        whole[(e.block, e.index, e.key)] = rows.reshape(-1)[:numel].view(layout.shapes[e.index]).clone()
    return whole, version


def agreed_version(reported: Sequence[Sequence[int]], lost: Sequence[int]) -> int:
    """The optimizer step every shard can be rebuilt at, from each rank's ``[steps applied, step of
    the lost neighbour's copy it keeps (-1: none), step of its rollback point (-1: none), has a
    shard]``: the lost ranks' copies fix it (the survivors may have stepped past it: they go back);
    without a loss (admitting a joiner), the survivors' own. Refused by name when a copy is of
    another step than the others, or a survivor can reach it neither way."""
    kept = {int(row[1]) for row in reported if row[3] and row[1] >= 0}
    applied = {int(row[0]) for row in reported if row[3]}
    version = min(kept) if kept else min(applied)
    unreachable = [row for row in reported if row[3] and version not in (row[0], row[2])]
    if len(kept) > 1 or unreachable:
        raise SpreadError(
            "ShardedStrategy cannot recover without restart: the buddy copies of the lost rank(s) "
            f"{sorted(lost)} are of optimizer step(s) {sorted(kept)}, the survivors' shards of step(s) "
            f"{sorted(applied)}, and a survivor can go back one step only. The job fails as without "
            "--recover (--max-restarts with BackupAndRestore restarts it from the last backup)"
        )
    return version
