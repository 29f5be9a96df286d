"""Distributed datasets: every sample exactly once per epoch, split the same way on every process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from spread.data import DistributedDataset, ReplicaLayout, ShardPolicy, StepInfo, split_sizes
from spread.testing.threads import ThreadChannels, run_threads
from spread.values import PerReplica


def _ids(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n).float().unsqueeze(1), torch.arange(n)


def _process_batches(n, gbs, replicas, process, *, local=1, **kw):
    layout = ReplicaLayout(
        replicas, process * local, local, process_index=process, num_processes=replicas // local
    )
    infos: list[StepInfo] = []
    ds = DistributedDataset(_ids(n), gbs, layout, on_step=infos.append, **kw)
    return list(ds), infos


@pytest.mark.parametrize("total,parts", [(16, 2), (7, 3), (2, 3), (0, 2), (10, 4)])
def test_split_sizes_are_balanced(total, parts):
    sizes = split_sizes(total, parts)
    assert sum(sizes) == total and max(sizes) - min(sizes) <= 1 and len(sizes) == parts


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_in_global_batch_order(replicas):
    n, gbs = 37, 8
    per_process = [_process_batches(n, gbs, replicas, r, seed=3) for r in range(replicas)]
    steps = len(per_process[0][0])
    assert steps == 5
    seen = []
    for step in range(steps):
        for r in range(replicas):
            seen.extend(per_process[r][0][step][1].tolist())
            info = per_process[r][1][step]
            assert info.global_size == min(gbs, n - step * gbs)
    assert sorted(seen) == list(range(n))
    # Same global order as one replica: concatenating the replicas' slices gives one device's batch.
    single, _ = _process_batches(n, gbs, 1, 0, seed=3)
    assert seen == torch.cat([b[1] for b in single]).tolist()


def test_uneven_final_batch_sizes_and_drop_remainder():
    batches, infos = _process_batches(21, 8, 2, 1, shuffle=False)
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert [i.global_size for i in infos] == [8, 8, 5]
    assert infos[-1].local_sizes == (2,)
    dropped, _ = _process_batches(21, 8, 2, 1, shuffle=False, drop_remainder=True)
    assert len(dropped) == 2


def test_final_batch_smaller_than_replica_count_gives_an_empty_local_batch():
    batches, infos = _process_batches(9, 8, 4, 3, shuffle=False)
    assert infos[-1] == StepInfo((0,), 1)
    x, y = batches[-1]
    assert x.shape == (0, 1) and y.shape == (0,)


def test_shuffle_is_shared_and_changes_per_epoch():
    layout = ReplicaLayout(2, 0, 1, process_index=0, num_processes=2)
    ds = DistributedDataset(_ids(40), 10, layout, seed=5)
    epoch0 = torch.cat([b[1] for b in ds])
    epoch1 = torch.cat([b[1] for b in ds])
    again = DistributedDataset(_ids(40), 10, layout, seed=5)
    assert torch.equal(epoch0, torch.cat([b[1] for b in again]))
    assert not torch.equal(epoch0, epoch1)


def test_several_local_replicas_yield_per_replica_leaves():
    layout = ReplicaLayout(2, 0, 2)
    x, y = next(iter(DistributedDataset(_ids(10), 4, layout, shuffle=False)))
    assert isinstance(x, PerReplica) and isinstance(y, PerReplica)
    assert [v.tolist() for v in y.values] == [[0, 1], [2, 3]]


def test_resume_from_state_dict_continues_at_the_next_batch():
    layout = ReplicaLayout(1, 0, 1)
    ds = DistributedDataset(_ids(30), 4, layout, seed=1)
    full = [b[1].tolist() for b in ds]
    ds2 = DistributedDataset(_ids(30), 4, layout, seed=1)
    it = iter(ds2)
    first = [next(it)[1].tolist() for _ in range(3)]
    state = ds2.state_dict()
    assert state == {"epoch": 0, "batch": 3}
    ds3 = DistributedDataset(_ids(30), 4, layout, seed=1)
    ds3.load_state_dict(state)
    rest = [b[1].tolist() for b in ds3]
    assert first + rest == full


class _Squares(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.tensor([float(i)]), "y": i * i}


def test_generic_map_dataset_with_dict_samples():
    layout = ReplicaLayout(2, 1, 1, process_index=1, num_processes=2)
    batches = list(DistributedDataset(_Squares(), 4, layout, shuffle=False))
    assert [b["y"].tolist() for b in batches] == [[4, 9], [36, 49], [81]]


def test_a_dict_of_tensors_is_a_column_store_split_like_a_tuple():
    """Keras' ``fit(x={"input_ids": ...})``: named columns of equal length, batches are dicts."""
    x, y = _ids(10)
    layout = ReplicaLayout(2, 1, 1, process_index=1, num_processes=2)
    as_dict = list(DistributedDataset({"x": x, "y": y}, 4, layout, seed=3))
    as_tuple = list(DistributedDataset((x, y), 4, layout, seed=3))
    assert [sorted(b) for b in as_dict] == [["x", "y"]] * 3
    assert [b["y"].tolist() for b in as_dict] == [b[1].tolist() for b in as_tuple]


@pytest.mark.parametrize(
    "data,match",
    [
        ({"x": torch.zeros(10, 1), "y": torch.zeros(3)}, r"differ in length.*'x': 10, 'y': 3"),
        ((torch.zeros(10, 1), torch.zeros(3)), r"differ in length.*0: 10, 1: 3"),
        ({"x": [1, 2, 3]}, r"dict of data must map names to tensors.*'x': 'list'"),
        ({"x": torch.tensor(1.0)}, r"dict of data must map names to tensors with a batch dimension"),
        ({}, r"got nothing"),
    ],
)
def test_bad_column_data_is_refused_clearly(data, match):
    with pytest.raises(ValueError, match=match):
        DistributedDataset(data, 4, ReplicaLayout(1, 0, 1))


class _Stream(IterableDataset):
    def __iter__(self):
        for i in range(11):
            yield torch.tensor(i)


def test_iterable_dataset_split_by_sample():
    out = []
    for r in range(2):
        layout = ReplicaLayout(2, r, 1, process_index=r, num_processes=2)
        out.append([b.tolist() for b in DistributedDataset(_Stream(), 4, layout)])
    assert out[0] == [[0, 1], [4, 5], [8, 9]]
    assert out[1] == [[2, 3], [6, 7], [10]]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_size": 1}, "smaller than the 2 replicas"),
        ({"shard_policy": "rows"}, "shard_policy"),
        ({"shard_policy": "file"}, "shard"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    layout = ReplicaLayout(2, 0, 1, process_index=0, num_processes=2)
    args = {"global_batch_size": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        DistributedDataset(_ids(10), args.pop("global_batch_size"), layout, **args)


def test_dataset_smaller_than_replica_count_is_refused():
    layout = ReplicaLayout(4, 0, 1, process_index=0, num_processes=4)
    with pytest.raises(ValueError, match="holds 3 sample"):
        DistributedDataset(_ids(3), 8, layout)


def test_shard_policy_parse():
    assert ShardPolicy.parse("data") is ShardPolicy.DATA


def test_a_dataloader_gives_its_dataset_and_refuses_what_would_be_ignored():
    from torch.utils.data import DataLoader, WeightedRandomSampler

    ds = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(20, 1), torch.arange(20))
    layout = ReplicaLayout(1, 0, 1)
    assert len(DistributedDataset(DataLoader(ds, batch_size=4, shuffle=True), 4, layout)) == 5
    assert len(DistributedDataset(DataLoader(ds, batch_size=None), 4, layout)) == 5
    with pytest.raises(ValueError, match=r"batch_size=10 differs from global_batch_size=4"):
        DistributedDataset(DataLoader(ds, batch_size=10), 4, layout)
    with pytest.raises(ValueError, match=r"WeightedRandomSampler would be ignored"):
        DistributedDataset(
            DataLoader(ds, batch_size=4, sampler=WeightedRandomSampler([1.0] * 20, 20)), 4, layout
        )


class _Files(IterableDataset):
    """A stream of files, each a run of sample ids; ``shard`` keeps every ``n``-th file, as
    file-sharded input does (tf.data's FILE policy), so shards differ in size."""

    def __init__(self, files: list[range]) -> None:
        self.files = files

    def shard(self, num_shards: int, index: int) -> _Files:
        return _Files(self.files[index::num_shards])

    def __iter__(self):
        for file in self.files:
            for i in file:
                yield torch.tensor(i)


class _MapFiles(Dataset):
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def shard(self, num_shards: int, index: int) -> _MapFiles:
        return _MapFiles([i for i in self.ids if (i // 10) % num_shards == index])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return torch.tensor(self.ids[i])


def _run_processes(make_dataset, processes: int, gbs: int, epochs: int = 1):
    """Each process's (batches, step infos, len) with a threaded sum standing in for the all-reduce."""
    channels = ThreadChannels(processes)

    def run(p: int):
        infos: list[StepInfo] = []
        layout = ReplicaLayout(processes, p, 1, process_index=p, num_processes=processes)
        ds = DistributedDataset(
            make_dataset(), gbs, layout, on_step=infos.append, channel=channels.channel(p), shuffle=False
        )
        length = len(ds) if hasattr(ds.dataset, "__len__") else None
        return [b.tolist() for _ in range(epochs) for b in ds], infos, length

    return run_threads(run, processes, channels)


def test_uneven_file_shards_end_the_epoch_together_with_every_sample_once():
    # Files of 5, 7, 3, 9 samples; process 0 gets files 0 and 2 (8 samples), process 1 files 1, 3 (16).
    starts = [0, 5, 12, 15]
    files = [range(s, s + n) for s, n in zip(starts, [5, 7, 3, 9], strict=True)]
    (b0, i0, _), (b1, i1, _) = _run_processes(lambda: _Files(files), 2, gbs=6, epochs=2)
    assert len(b0) == len(b1) == 2 * 6  # 16 samples at 3 per step: 6 steps per epoch, on both
    assert [len(b) for b in b0[:6]] == [3, 3, 2, 0, 0, 0]  # ran out: empty batches, weighted zero
    seen = sorted(i for b in b0[:6] + b1[:6] for i in b)
    assert seen == list(range(24))  # every sample once per epoch, none counted twice
    assert [info.global_size for info in i0] == [info.global_size for info in i1]
    assert [info.global_size for info in i0[:6]] == [6, 6, 5, 3, 3, 1]  # exact, not sizes x 2


def test_uneven_map_style_shards_agree_on_the_length():
    ids = list(range(35))  # tens 0 and 2 -> process 0 (20 samples), tens 1 and 3 -> process 1 (15)
    (b0, _, n0), (b1, _, n1) = _run_processes(lambda: _MapFiles(ids), 2, gbs=4)
    assert n0 == n1 == 10 == len(b0) == len(b1)
    assert sorted(i for b in b0 + b1 for i in b) == ids
    assert [len(b) for b in b1] == [2] * 7 + [1, 0, 0]


def test_a_process_whose_shard_is_empty_gets_a_clear_error():
    files = [range(0, 4), range(4, 4)]
    with pytest.raises(ValueError, match="process 1 got no batch from its shard"):
        _run_processes(lambda: _Files(files), 2, gbs=2)


def test_a_stream_is_read_in_full_by_every_process_only_without_a_channel():
    """What the strategy refuses (``Strategy._check_data``): a stream, several processes, no channel
    to dispatch it. Map-style data, a stream with a channel, or one process are read once."""
    two = ReplicaLayout(2, 0, 1, process_index=0, num_processes=2)
    channel = ThreadChannels(2).channel(0)
    assert DistributedDataset(_Stream(), 4, two).read_in_full_by_every_process
    assert not DistributedDataset(_Stream(), 4, two, channel=channel).read_in_full_by_every_process
    assert not DistributedDataset(_Stream(), 4, ReplicaLayout(1, 0, 1)).read_in_full_by_every_process
    assert not DistributedDataset(torch.arange(8), 4, two).read_in_full_by_every_process
    assert not DistributedDataset(_Stream(), 4, two, shard_policy="off").read_in_full_by_every_process
