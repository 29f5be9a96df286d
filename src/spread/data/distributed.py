"""A dataset distributed over replicas: per-replica batches cut from one global batch.

What the strategy gets from it, besides the batches: for every step, how many samples each local
replica holds and how many the global batch holds (:class:`StepInfo`). Gradients are weighted by
those counts, which is what makes an uneven final batch give the same update as one device.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.dataloader import _InfiniteConstantSampler

from spread.data.dispatch import dispatched
from spread.data.prefetch import WaitClock, prefetch
from spread.data.sharding import ShardPolicy, epoch_order, global_batches, split_sizes
from spread.values import stack_replicas


class DataChannel(Protocol):
    """How the processes that read data talk while reading (collectives, on the loop's thread)."""

    def sum_over_processes(self, counts: torch.Tensor) -> torch.Tensor:
        """The sum of a small int64 CPU tensor over the processes (returned on the CPU)."""
        ...

    def broadcast_from_first_process(self, tensors: list[torch.Tensor]) -> None:
        """Make every process's CPU ``tensors`` equal to process 0's, in place."""
        ...


@dataclass(frozen=True, slots=True)
class StepInfo:
    """Sample counts of one step: per local replica, and for the whole global batch."""

    local_sizes: tuple[int, ...]
    global_size: int


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """Which replicas this process drives: ``local_replicas`` out of ``num_replicas`` in total."""

    num_replicas: int
    first_local_replica: int
    num_local_replicas: int
    process_index: int = 0
    num_processes: int = 1

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.num_local_replicas < 1:
            raise ValueError(f"replica counts must be >= 1, got {self}")
        if not 0 <= self.first_local_replica <= self.num_replicas - self.num_local_replicas:
            raise ValueError(f"local replicas out of range: {self}")


class _TensorBatches(Dataset):
    """Equal-length tensors (a tuple, or a dict of named columns as Keras' ``fit(x={...})`` takes),
    indexed by a whole batch at once: one gather per tensor, no Python loop."""

    def __init__(self, tensors: Sequence[torch.Tensor] | Mapping[str, torch.Tensor]) -> None:
        self.names = list(tensors) if isinstance(tensors, Mapping) else None
        self.tensors = tuple(tensors.values()) if isinstance(tensors, Mapping) else tuple(tensors)
        names = self.names or range(len(self.tensors))
        lengths = {name: t.shape[0] for name, t in zip(names, self.tensors, strict=True)}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"the data's tensors differ in length (their first dimension): {lengths}")

    def _pack(self, parts: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
        if self.names is None:
            return tuple(parts)
        return dict(zip(self.names, parts, strict=True))

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, i: int):
        return self._pack(t[i] for t in self.tensors)

    def __getitems__(self, indices: list[int]):
        idx = torch.as_tensor(indices, dtype=torch.long)
        # index on each tensor's own device: data already on a GPU is gathered there
        return self._pack(t.index_select(0, idx.to(t.device)) for t in self.tensors)


def _identity(batch: Any) -> Any:
    return batch


def _check_loader(loader: DataLoader, global_batch_size: int) -> None:
    """A DataLoader gives its dataset, ``collate_fn`` and ``num_workers``; spread batches, shards and
    shuffles (with a seed every replica shares) itself, so a batch size or sampler that would be
    ignored is refused instead."""
    if loader.batch_size is not None and loader.batch_size != global_batch_size:
        raise ValueError(
            f"the DataLoader's batch_size={loader.batch_size} differs from global_batch_size="
            f"{global_batch_size}: spread splits each global batch over the replicas itself; pass "
            f"global_batch_size={loader.batch_size} (the whole step's batch), or the dataset"
        )
    batches = loader.batch_sampler
    sampler = batches.sampler if isinstance(batches, BatchSampler) else loader.sampler
    if not isinstance(sampler, SequentialSampler | RandomSampler | _InfiniteConstantSampler):
        raise ValueError(
            f"the DataLoader's {type(sampler).__name__} would be ignored: spread shards and shuffles "
            f"the dataset itself (shuffle= and seed= of fit/distribute_dataset); pass the dataset, or "
            f"a DataLoader without a sampler"
        )
    if loader.batch_sampler is not None and not isinstance(loader.batch_sampler, BatchSampler):
        raise ValueError(
            f"the DataLoader's batch_sampler ({type(loader.batch_sampler).__name__}) would be ignored: "
            f"spread forms the global batches itself; pass the dataset"
        )


def _as_dataset(data: Any) -> tuple[Any, Callable[[Any], Any] | None, int]:
    """Accept a Dataset, an IterableDataset, a DataLoader, a tensor, a tuple or dict of tensors, or
    an iterable."""
    num_workers = 0
    collate: Callable[[Any], Any] | None = None
    if isinstance(data, DataLoader):
        num_workers, collate, data = data.num_workers, data.collate_fn, data.dataset
    if isinstance(data, Mapping):
        if not data or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in data.values()):
            kinds = {k: type(v).__name__ for k, v in data.items()}
            raise ValueError(
                f"a dict of data must map names to tensors with a batch dimension "
                f"(got {kinds or 'nothing'}); for a dict per sample, pass a Dataset whose items are dicts"
            )
        data = _TensorBatches(data)  # a column store: batches come out whole, already collated
        return data, _identity, num_workers
    if isinstance(data, tuple) and data and all(isinstance(t, torch.Tensor) for t in data):
        data = TensorDataset(*_TensorBatches(data).tensors)  # checks the lengths, clearly
    if isinstance(data, torch.Tensor):
        data = TensorDataset(data)
    if isinstance(data, TensorDataset) and collate in (None, default_collate):
        return _TensorBatches(data.tensors), _identity, num_workers
    return data, collate, num_workers


class DistributedDataset:
    """Iterable over the local part of each global batch; one pass is one epoch.

    Batches are prepared ``prefetch`` steps ahead on a background thread, except tensors already in
    memory and trained on the CPU (see :meth:`_prefetch_depth`); ``wait_clock`` records how long the
    loop waited for them. Each ``iter()`` starts the next epoch (reshuffled with the
    shared seed) unless :meth:`set_epoch` chose it. Yields a batch for a process with one replica,
    and a structure of :class:`~spread.values.PerReplica` leaves for several. ``state_dict()``
    records the epoch and the batches already consumed, so a restarted run resumes at the exact
    next sample.
    """

    def __init__(
        self,
        data: Any,
        global_batch_size: int,
        layout: ReplicaLayout,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
        shard_policy: str | ShardPolicy = ShardPolicy.AUTO,
        devices: Sequence[torch.device] | None = None,
        num_workers: int | None = None,
        prefetch: int = 2,
        on_step: Callable[[StepInfo], None] | None = None,
        channel: DataChannel | None = None,
    ) -> None:
        if not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
        if global_batch_size < layout.num_replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size} is smaller than the {layout.num_replicas} replicas: "
                f"every replica needs at least one sample per step"
            )
        if isinstance(data, DataLoader):
            _check_loader(data, global_batch_size)
        self.dataset, collate, loader_workers = _as_dataset(data)
        self.collate_fn = collate or default_collate
        self.num_workers = loader_workers if num_workers is None else num_workers
        self.global_batch_size = global_batch_size
        self.layout = layout
        self.shuffle, self.seed, self.drop_remainder = shuffle, seed, drop_remainder
        self.devices = list(devices) if devices else [torch.device("cpu")] * layout.num_local_replicas
        self.on_step = on_step
        # With a channel, processes reading their own shards (FILE and OFF policies) agree on every
        # step: the exact global sample count, and an epoch that ends when the last shard does (a
        # process whose shard ran out takes part with empty batches, weighted zero), as DDP's Join
        # does; and a stream without shard() under the DATA policy is read by process 0 alone, its
        # global batches broadcast (spread.data.dispatch): each sample read once, not once per process.
        self.channel = channel if layout.num_processes > 1 else None
        self._local_length: int | None = None
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        self.prefetch = prefetch
        self.wait_clock = WaitClock()  # time the training loop spent waiting for batches
        policy = ShardPolicy.parse(shard_policy)
        if policy is ShardPolicy.AUTO:
            policy = ShardPolicy.FILE if hasattr(self.dataset, "shard") else ShardPolicy.DATA
        if policy is ShardPolicy.FILE and not hasattr(self.dataset, "shard"):
            raise ValueError("shard_policy='file' needs a dataset with a shard(num_shards, index) method")
        self.shard_policy = policy
        self._map_style = not isinstance(self.dataset, IterableDataset) and hasattr(self.dataset, "__len__")
        if self._map_style and policy is ShardPolicy.DATA:
            n = len(self.dataset)
            if n < layout.num_replicas:
                raise ValueError(
                    f"the dataset holds {n} sample(s) but there are {layout.num_replicas} replicas: "
                    f"every replica needs at least one sample"
                )
        self._epoch = 0
        self._batch = 0  # batches consumed in the current epoch
        self._resume_batch = 0

    @property
    def read_in_full_by_every_process(self) -> bool:
        """A stream under the DATA policy, several processes and no channel to dispatch it: every
        process would read all of it to keep its slice (the strategy refuses this)."""
        return (
            not self._map_style
            and self.shard_policy is ShardPolicy.DATA
            and self.layout.num_processes > 1
            and self.channel is None
        )

    # -- epochs and state --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (and so the shuffle) of the next iteration."""
        self._epoch = epoch
        self._resume_batch = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batch": self._batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration continues epoch ``state['epoch']`` after ``state['batch']`` batches."""
        self._epoch = int(state["epoch"])
        self._resume_batch = int(state["batch"])

    def __len__(self) -> int:
        if not self._map_style:
            raise TypeError("the length of a distributed iterable dataset is unknown")
        if self.shard_policy is ShardPolicy.DATA:
            return global_batches(len(self.dataset), self.global_batch_size, self.drop_remainder)
        if self._local_length is None:
            local = self.dataset if self.shard_policy is ShardPolicy.OFF else self._file_shard()
            per_replica = self.global_batch_size // self.layout.num_replicas
            length = global_batches(
                len(local), per_replica * self.layout.num_local_replicas, self.drop_remainder
            )
            if self.channel is not None:  # the longest shard's (collective, computed once)
                lengths = torch.zeros(self.layout.num_processes, dtype=torch.int64)
                lengths[self.layout.process_index] = length
                length = int(self.channel.sum_over_processes(lengths).max())
            self._local_length = length
        return self._local_length

    # -- iteration -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        epoch, start = self._epoch, self._resume_batch
        self._resume_batch = 0
        self._batch = start
        if self._map_style and self.shard_policy is ShardPolicy.DATA:
            plan = self._data_plan(epoch, start)
            source = self._map_source(plan)
        elif self._map_style:
            plan = self._local_plan(epoch, start)
            source = self._map_source(plan)
        elif self.shard_policy is ShardPolicy.DATA and self.channel is not None:
            source = None
        else:
            source = self._iterable_source(start)
        steps: Iterator[tuple[Any, list[int], int]]
        if source is None:  # dispatched: the broadcast runs on this (the loop's) thread
            first = self.layout.process_index == 0
            reader = (
                prefetch(self._global_stream(start), self._prefetch_depth(), self.wait_clock)
                if first
                else None
            )
            assert self.channel is not None
            steps = dispatched(reader, self.channel.broadcast_from_first_process, self._local_part)
        else:
            ready = ((self._per_replica(batch, sizes), sizes, total) for batch, sizes, total in source)
            steps = prefetch(ready, self._prefetch_depth(), self.wait_clock)
        if self.channel is not None and self.shard_policy is not ShardPolicy.DATA:
            steps = self._joined(steps)
        try:
            for batch, sizes, global_size in steps:
                self._batch += 1
                if self.on_step is not None:
                    self.on_step(StepInfo(tuple(sizes), global_size))
                yield batch
        finally:  # finished or abandoned: the next iteration is the next epoch (as in tf.data)
            if isinstance(steps, Generator):  # stop the reading thread behind it now
                steps.close()
            self._epoch = epoch + 1
            self._batch = 0

    def _prefetch_depth(self) -> int:
        """How many batches the reading thread keeps ready; 0: no thread.

        Tensors held in memory for CPU replicas are gathered in a fraction of a millisecond, and on a
        second thread that gather runs its own OpenMP team beside the training step's, whose spinning
        threads take the step's cores: a one-device ResNet step at 2 threads on 2 cores, 64 ms with
        the thread, 47 without (docs/results/2026-11-27-planner-allocator.md). Accelerators keep the
        thread: it overlaps the copy to the device.
        """
        in_memory = isinstance(self.dataset, _TensorBatches) and self.num_workers == 0
        if in_memory and all(device.type == "cpu" for device in self.devices):
            return 0
        return self.prefetch

    def _joined(self, steps: Iterator[tuple[Any, list[int], int]]) -> Iterator[tuple[Any, list[int], int]]:
        """This process's steps, agreed with the others': the global count of each step is summed,
        and once this shard is done it yields empty batches until every shard is (one small
        all-reduce per step)."""
        try:
            yield from self._join(steps)
        finally:  # abandoned or failed: the reading thread behind ``steps`` must stop too
            if isinstance(steps, Generator):
                steps.close()

    def _join(self, steps: Iterator[tuple[Any, list[int], int]]) -> Iterator[tuple[Any, list[int], int]]:
        empty: Any = None
        assert self.channel is not None
        exchange = self.channel.sum_over_processes
        for batch, sizes, _ in steps:
            counts = exchange(torch.tensor([sum(sizes), 1], dtype=torch.int64))
            if empty is None:
                empty = pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, batch)
            yield batch, sizes, int(counts[0])
        zeros = [0] * self.layout.num_local_replicas
        while True:
            counts = exchange(torch.tensor([0, 0], dtype=torch.int64))
            if int(counts[1]) == 0:  # every shard is done: the epoch ends on every process together
                return
            if empty is None:
                raise ValueError(
                    f"process {self.layout.process_index} got no batch from its shard this epoch while "
                    f"others did, so it cannot form an empty batch of the same structure to take part "
                    f"with; give every process at least one sample (or use shard_policy='data')"
                )
            yield empty, zeros, int(counts[0])

    def _data_plan(self, epoch: int, start: int) -> list[tuple[list[int], list[int], int]]:
        n, gbs, lay = len(self.dataset), self.global_batch_size, self.layout
        order = epoch_order(n, shuffle=self.shuffle, seed=self.seed, epoch=epoch)
        plan = []
        for b in range(start, global_batches(n, gbs, self.drop_remainder)):
            chunk = order[b * gbs : min((b + 1) * gbs, n)]
            sizes = split_sizes(len(chunk), lay.num_replicas)
            lo = sum(sizes[: lay.first_local_replica])
            local_sizes = sizes[lay.first_local_replica : lay.first_local_replica + lay.num_local_replicas]
            plan.append((chunk[lo : lo + sum(local_sizes)].tolist(), local_sizes, len(chunk)))
        return plan

    def _file_shard(self) -> Any:
        lay = self.layout
        return self.dataset.shard(lay.num_processes, lay.process_index)

    def _local_plan(self, epoch: int, start: int) -> list[tuple[list[int], list[int], int]]:
        """FILE and OFF policies: batches from this process's own (shard of the) data."""
        lay = self.layout
        if self.shard_policy is ShardPolicy.FILE:
            self.dataset = self._file_shard()
            self.shard_policy = ShardPolicy.OFF  # the dataset is now the local shard
        per_replica = self.global_batch_size // lay.num_replicas
        local_bs = per_replica * lay.num_local_replicas
        n = len(self.dataset)
        order = epoch_order(n, shuffle=self.shuffle, seed=self.seed + 7919 * lay.process_index, epoch=epoch)
        plan = []
        for b in range(start, global_batches(n, local_bs, self.drop_remainder)):
            chunk = order[b * local_bs : min((b + 1) * local_bs, n)]
            sizes = split_sizes(len(chunk), lay.num_local_replicas)
            plan.append((chunk.tolist(), sizes, -1))
        return plan

    def _map_source(
        self, plan: list[tuple[list[int], list[int], int]]
    ) -> Iterator[tuple[Any, list[int], int]]:
        nonempty = [indices for indices, _, _ in plan if indices]
        # A private generator: iterating must not draw from the global RNG (that would make dropout
        # depend on when the background thread starts an epoch, and break exact resume).
        loader = DataLoader(
            self.dataset,
            batch_sampler=nonempty,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            persistent_workers=False,
            generator=torch.Generator().manual_seed(self.seed * 7_919 + self._epoch),
        )
        batches = iter(loader)
        for indices, sizes, global_size in plan:
            batch = next(batches) if indices else self._empty_batch()
            if global_size < 0:  # local policies: the global count is the sum over processes; unknown
                global_size = sum(sizes) * self.layout.num_processes
            yield batch, sizes, global_size

    def _empty_batch(self) -> Any:
        one = (
            self.collate_fn(self.dataset.__getitems__([0]))
            if hasattr(self.dataset, "__getitems__")
            else (self.collate_fn([self.dataset[0]]))
        )
        return pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, one)

    def _global_stream(self, start: int) -> Iterator[tuple[Any, int]]:
        """Process 0 of a dispatched stream: each global batch, collated whole, with its count."""
        buffer: list[Any] = []
        index = 0
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == self.global_batch_size:
                if index >= start:
                    yield self.collate_fn(buffer), len(buffer)
                index += 1
                buffer = []
        if buffer and not self.drop_remainder and index >= start:
            yield self.collate_fn(buffer), len(buffer)

    def _local_part(self, global_batch: Any, count: int) -> tuple[Any, list[int]]:
        """This process's replicas' slice of a whole global batch (the same split as every path)."""
        lay = self.layout
        sizes = split_sizes(count, lay.num_replicas)
        lo = sum(sizes[: lay.first_local_replica])
        local_sizes = sizes[lay.first_local_replica : lay.first_local_replica + lay.num_local_replicas]
        hi = lo + sum(local_sizes)
        local = pytree.tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, global_batch)
        return self._per_replica(local, local_sizes), local_sizes

    def _iterable_source(self, start: int) -> Iterator[tuple[Any, list[int], int]]:
        lay, gbs = self.layout, self.global_batch_size
        data: Iterable[Any] = self.dataset
        if self.shard_policy is ShardPolicy.FILE:
            data = self._file_shard()
            per = gbs // lay.num_replicas * lay.num_local_replicas
            step_size, keep_all = per, True
        else:
            step_size, keep_all = gbs, self.shard_policy is ShardPolicy.OFF
            if keep_all:
                step_size = gbs // lay.num_replicas * lay.num_local_replicas
        buffer: list[Any] = []
        index = 0
        for item in data:
            buffer.append(item)
            if len(buffer) == step_size:
                if index >= start:
                    yield self._cut(buffer, keep_all)
                index += 1
                buffer = []
        if buffer and not self.drop_remainder and index >= start:
            yield self._cut(buffer, keep_all)

    def _cut(self, items: list[Any], keep_all: bool) -> tuple[Any, list[int], int]:
        lay = self.layout
        if keep_all:
            sizes = split_sizes(len(items), lay.num_local_replicas)
            return self.collate_fn(items), sizes, len(items) * lay.num_processes
        sizes = split_sizes(len(items), lay.num_replicas)
        lo = sum(sizes[: lay.first_local_replica])
        local_sizes = sizes[lay.first_local_replica : lay.first_local_replica + lay.num_local_replicas]
        local = items[lo : lo + sum(local_sizes)]
        batch = self.collate_fn(local) if local else self._empty_from(items[:1])
        return batch, local_sizes, len(items)

    def _empty_from(self, sample: list[Any]) -> Any:
        return pytree.tree_map(lambda t: t[:0] if isinstance(t, torch.Tensor) else t, self.collate_fn(sample))

    def _per_replica(self, local_batch: Any, sizes: Sequence[int]) -> Any:
        """Split the process's batch into its local replicas' batches and move each to its device."""
        if len(sizes) == 1:
            return _to_device(local_batch, self.devices[0])
        parts = [
            _to_device(part, dev)
            for part, dev in zip(_split_structure(local_batch, list(sizes)), self.devices, strict=True)
        ]
        return stack_replicas(parts)


def _split_structure(batch: Any, sizes: list[int]) -> list[Any]:
    leaves, spec = pytree.tree_flatten(batch)
    split_leaves = [
        torch.split(leaf, sizes) if isinstance(leaf, torch.Tensor) else [leaf] * len(sizes) for leaf in leaves
    ]
    return [pytree.tree_unflatten([parts[i] for parts in split_leaves], spec) for i in range(len(sizes))]


def _to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    return pytree.tree_map(
        lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch
    )
