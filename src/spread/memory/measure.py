"""Deterministic measures of activation memory: the bytes autograd saves for backward.

Why: peak-memory readings on a CPU depend on the allocator and on what else runs; the tensors a
forward pass saves for backward do not. :class:`SavedTensorBytes` counts them through a saved-tensor
hook (each storage once), which is what checkpointing and offload are meant to reduce. Tensors saved
inside a checkpointed block are dropped by the checkpoint and are not counted, by design.
:class:`ActivationMeter` follows the same tensors until backward releases them and keeps the peak:
what ``Strategy.measure_activations`` reports per replica and what ``spread plan`` profiles.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks


class SavedTensorBytes(saved_tensors_hooks):
    """Context manager counting the bytes saved for backward inside it (``.bytes``, ``.tensors``).

    ``exclude``: tensors not to count (pass ``model.parameters()`` to count activations only).
    Storages are counted once each, however many views of them are saved.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self.tensors = 0
        super().__init__(self._pack, _unpack)

    def __enter__(self) -> SavedTensorBytes:  # type: ignore[override]  # torch types it -> None
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._excluded and key not in self._seen:
            self._seen.add(key)
            self.bytes += storage.nbytes()
            self.tensors += 1
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class ActivationMeter(saved_tensors_hooks):
    """Context manager measuring the *peak* bytes of tensors autograd keeps for backward.

    Why a peak of what is alive, not a sum of what was saved: a step's activations are freed as its
    backward consumes them, then the next micro-batch (gradient accumulation) or pipeline micro-batch
    saves its own. Each saved tensor is packed into a small holder that autograd keeps in the graph;
    the storage counts from its first holder until the last one is released (after backward, or when
    the graph is dropped). So a window holding one forward gives the bytes that forward saved, and a
    window holding whole steps gives the most that were alive at once. Device-agnostic: storages and
    their byte sizes, no allocator statistics.

    Counted: of each storage, the byte range its saved tensors reach (a replica's slice of the global
    batch is its rows, not the whole batch; views of one storage count their union once).
    Not counted: parameters and views of them (tested at pack time, so parameters gathered into new
    storage during forward, as ``ShardedStrategy(shard="parameters")`` does, are excluded too),
    tensors in ``exclude`` (module buffers), and tensors saved under hooks entered inside this one
    (checkpointed blocks keep their inputs only; offloaded tensors live in host memory).

    ``group``: called at pack time, names whom a tensor belongs to (a strategy passes the replica id,
    so replicas computing at once on threads are measured apart); :attr:`peak_by_group` holds each
    group's peak, :attr:`peak_bytes` the largest of them. Thread-safe: replica threads carry the
    hooks (``spread.strategies.thread_state``). Costs one small Python object per saved tensor while
    active, nothing once left.
    """

    def __init__(
        self, exclude: Iterable[torch.Tensor] = (), group: Callable[[], Hashable] | None = None
    ) -> None:
        self._excluded = {_storage_key(t) for t in exclude} - {0}
        self._group = group
        self._lock = threading.RLock()
        # (group, storage) -> byte ranges its saved tensors reach (with how many hold each), and the
        # bytes of their union; per group the bytes alive now.
        self._live: dict[tuple[Hashable, int], Counter[tuple[int, int]]] = {}
        self._reached: dict[tuple[Hashable, int], int] = {}
        self._now: dict[Hashable, int] = {}
        self.peak_by_group: dict[Hashable, int] = {}
        super().__init__(self._pack, _unpack_held)

    def __enter__(self) -> ActivationMeter:  # type: ignore[override]  # torch types it -> None
        super().__enter__()
        return self

    @property
    def peak_bytes(self) -> int:
        """The largest group's peak (0 when nothing was saved)."""
        return max(self.peak_by_group.values(), default=0)

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, nn.Parameter):
            return tensor
        key = _storage_key(tensor)
        if key == 0 or key in self._excluded:
            return tensor
        held = _Held(tensor, self, (self._group() if self._group is not None else None, key), _extent(tensor))
        with self._lock:
            extents = self._live.setdefault(held.live_key, Counter())
            extents[held.extent] += 1
            self._update(held.live_key, extents)
        return held

    def _release(self, held: _Held) -> None:
        with self._lock:
            extents = self._live[held.live_key]
            extents[held.extent] -= 1
            if extents[held.extent] == 0:
                del extents[held.extent]
            self._update(held.live_key, extents)
            if not extents:
                del self._live[held.live_key]

    def _update(self, live_key: tuple[Hashable, int], extents: Counter[tuple[int, int]]) -> None:
        """Recount one storage's reached bytes and its group's total, keeping the group's peak."""
        group = live_key[0]
        now = self._now.get(group, 0) - self._reached.get(live_key, 0)
        reached = _union_length(extents)
        if reached:
            self._reached[live_key] = reached
        else:
            self._reached.pop(live_key, None)
        now += reached
        self._now[group] = now
        if now > self.peak_by_group.get(group, 0):
            self.peak_by_group[group] = now


class _Held:
    """A saved tensor as autograd keeps it under :class:`ActivationMeter`; its end is the release."""

    __slots__ = ("extent", "live_key", "meter", "tensor")

    def __init__(
        self,
        tensor: torch.Tensor,
        meter: ActivationMeter,
        live_key: tuple[Hashable, int],
        extent: tuple[int, int],
    ) -> None:
        self.tensor = tensor
        self.meter = meter
        self.live_key = live_key
        self.extent = extent

    def __del__(self) -> None:
        self.meter._release(self)


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` of its storage that ``tensor`` reaches (an expanded tensor
    reaches one copy of what it repeats)."""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    if tensor.numel() == 0:
        return start, start
    span = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + span * size


def _union_length(extents: Counter[tuple[int, int]]) -> int:
    total, reach = 0, -1
    for start, end in sorted(extents):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def _unpack_held(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Held) else packed


def _storage_key(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, subclasses)
        return 0
