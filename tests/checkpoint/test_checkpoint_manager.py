"""Checkpoints: atomic under SIGKILL, verified on load, fall back past corruption, refuse unsafe data."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from spread.checkpoint import CheckpointManager
from spread.checkpoint.atomic import CRASH_POINTS
from spread.errors import CheckpointCorruptError, CheckpointMismatchError, NonFiniteLossError


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((3, 3), float(step))},
        "step": step,
        "data": {"epoch": 1, "batch": step},
    }


def test_round_trip_pointer_and_keep_last_k(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    assert [p.name for p in manager.checkpoints()] == ["ckpt-0000000002", "ckpt-0000000003"]
    assert (tmp_path / "latest").read_text() == "ckpt-0000000003"
    step, state = manager.load_latest()
    assert step == 3 and torch.equal(state["model"]["w"], torch.full((3, 3), 3.0))
    assert state["data"] == {"epoch": 1, "batch": 3}


def test_empty_directory_loads_nothing(tmp_path):
    assert CheckpointManager(tmp_path / "none").load_latest() is None


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,target",
    [
        (_truncate, "state.pt"),
        (_flip_byte, "state.pt"),
        (os.remove, "manifest.json"),
        (os.remove, "state.pt"),
    ],
)
def test_corruption_is_detected_named_and_skipped(tmp_path, damage, target):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    newest = manager.save(2, _state(2))
    damage(newest / target)
    with pytest.warns(RuntimeWarning, match=r"ckpt-0000000002.*unusable.*falling back"):
        step, state = manager.load_latest()
    assert step == 1 and state["step"] == 1


def test_every_checkpoint_corrupt_is_an_error_naming_the_directory(tmp_path):
    manager = CheckpointManager(tmp_path)
    for step in (1, 2):
        _flip_byte(manager.save(step, _state(step)) / "state.pt")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptError, match=str(tmp_path)):
        manager.load_latest()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_pickle_is_refused_and_never_executed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    manager = CheckpointManager(tmp_path / "ckpts")
    manager.save(1, _state(1))
    evil = manager.save(2, _state(2))
    (evil / "state.pt").write_bytes(pickle.dumps({"model": _Payload()}))
    from spread.checkpoint.atomic import write_manifest  # a well-formed manifest: only weights_only stops it

    (evil / "manifest.json").unlink()
    write_manifest(evil, {"step": 2})
    with pytest.warns(RuntimeWarning, match="ckpt-0000000002"):
        step, _ = manager.load_latest()
    assert step == 1
    assert not (tmp_path / "PWNED").exists()


def test_non_finite_state_is_never_written(tmp_path):
    manager = CheckpointManager(tmp_path)
    bad = {"model": {"w": torch.tensor([1.0, float("nan")])}}
    with pytest.raises(NonFiniteLossError, match="step 5"):
        manager.save(5, bad)
    assert manager.checkpoints() == []


def test_bad_keep_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


@pytest.mark.parametrize("point", CRASH_POINTS)
@pytest.mark.processes
def test_sigkill_during_a_save_leaves_a_loadable_latest(tmp_path, point):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    script = textwrap.dedent(
        f"""
        import torch
        from spread.checkpoint import CheckpointManager
        CheckpointManager({str(tmp_path)!r}).save(2, {{"model": {{"w": torch.full((3, 3), 2.0)}}, "step": 2}})
        """
    )
    env = {**os.environ, "SPREAD_CHECKPOINT_CRASH_AT": point}
    result = subprocess.run([sys.executable, "-c", script], env=env, timeout=60, capture_output=True)
    assert result.returncode == -9, result.stderr.decode()[-2000:]
    step, state = manager.load_latest()
    expected = 2 if point == "after_pointer" else 1  # the pointer is the commit point
    assert step == expected and state["step"] == expected
    manager.save(3, _state(3))  # the next save cleans what the crash left behind
    assert not list(tmp_path.glob(".tmp-*"))


# -- C6: a checkpoint loaded into something else -------------------------------------------------------
def test_mismatched_state_is_refused_listing_every_key(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"model": {"w": torch.zeros(3, 3), "b": torch.zeros(3), "old": torch.zeros(1)}})
    like = {
        "model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64), "new": torch.zeros(2)}
    }
    with pytest.raises(CheckpointMismatchError) as info:
        manager.load_latest(like=like)
    message = str(info.value)
    assert "ckpt-0000000001" in message
    assert "missing key 'model.new'" in message and "unexpected key 'model.old'" in message
    assert "'model.w': saved (3, 3) float32, expected (4, 3) float32" in message
    assert "'model.b': saved (3,) float32, expected (3,) float64" in message
    assert len(info.value.problems) == 4
    step, _ = manager.load_latest(
        like={"model": {"w": torch.zeros(3, 3), "b": torch.zeros(3), "old": torch.ones(1)}}
    )
    assert step == 1


# -- sharded (per-rank) state through torch.distributed.checkpoint --------------------------------------
def _shards(rank: int, step: int) -> dict:
    return {
        "momentum": torch.full((4, 2), float(10 * rank + step)),
        "counter": torch.tensor([rank, step], dtype=torch.int64),
    }


def _sharded_round_trip(directory: str) -> dict:
    import torch.distributed as dist

    from spread.cluster import resolve_cluster
    from spread.cluster.rendezvous import rendezvous

    rdzv = rendezvous(resolve_cluster())
    try:
        rank = dist.get_rank()
        manager = CheckpointManager(directory, keep=2)
        for step in (1, 2, 3):
            manager.save(
                step,
                {"model": {"w": torch.full((2,), float(step))}, "step": step},
                shards=_shards(rank, step),
            )
        step, state = manager.load_latest(shards_like=_shards(rank, 0))
        shards = state["shards"]
        wrong = {"momentum": torch.zeros(5, 2), "extra": torch.zeros(1)}
        try:
            manager.load_latest(shards_like=wrong)
            mismatch = None
        except CheckpointMismatchError as exc:
            mismatch = exc.problems
        return {
            "step": step,
            "model": state["model"]["w"].tolist(),
            "momentum_equal": torch.equal(shards["momentum"], _shards(rank, 3)["momentum"]),
            "counter": shards["counter"].tolist(),
            "mismatch": mismatch,
        }
    finally:
        rdzv.close()


@pytest.mark.processes
def test_sharded_state_round_trip_under_two_ranks(tmp_path):
    from spread.testing import run_ranks

    values = run_ranks(_sharded_round_trip, 2, args=(str(tmp_path),), timeout=120)
    for rank, value in enumerate(values):
        assert value["step"] == 3 and value["model"] == [3.0, 3.0]
        assert value["momentum_equal"] and value["counter"] == [rank, 3]
        assert value["mismatch"] == [
            f"missing shard 'extra' for rank {rank}",
            f"shard 'momentum' for rank {rank}: saved (4, 2) torch.float32, expected (5, 2) torch.float32",
            f"unexpected shard 'counter' for rank {rank}",
        ]
    newest = tmp_path / "ckpt-0000000003"
    files = sorted(p.name for p in newest.iterdir())
    assert files == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.json",
        "manifest.sha256",
        "state.pt",
    ]
    import json

    manifest = json.loads((newest / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    assert [p.name for p in CheckpointManager(tmp_path).checkpoints()] == [
        "ckpt-0000000002",
        "ckpt-0000000003",
    ]
    assert not list(tmp_path.glob(".tmp-*"))


def test_sharded_state_in_one_process_and_a_flipped_shard_falls_back(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"step": 1}, shards=_shards(0, 1))
    newest = manager.save(2, {"step": 2}, shards=_shards(0, 2))
    step, state = manager.load_latest(shards_like=_shards(0, 0))
    assert step == 2 and torch.equal(state["shards"]["momentum"], _shards(0, 2)["momentum"])
    _flip_byte(newest / "__0_0.distcp")
    with pytest.warns(RuntimeWarning, match=r"__0_0\.distcp does not match its checksum"):
        step, state = manager.load_latest(shards_like=_shards(0, 0))
    assert step == 1 and torch.equal(state["shards"]["counter"], torch.tensor([0, 1]))


def test_the_shards_to_read_can_follow_from_each_checkpoints_replicated_state(tmp_path):
    """A callable ``shards_like`` sees each candidate's replicated state: a checkpoint says itself
    what it holds per rank (or nothing: None), and a corrupt one still falls back."""
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"per_rank": torch.tensor(False)})
    newest = manager.save(2, {"per_rank": torch.tensor(True)}, shards=_shards(0, 2))
    seen = []

    def like(state):
        seen.append(bool(state["per_rank"]))
        return _shards(0, 0) if state["per_rank"] else None

    step, state = manager.load_latest(shards_like=like)
    assert step == 2 and seen == [True]
    assert torch.equal(state["shards"]["momentum"], _shards(0, 2)["momentum"])
    _flip_byte(newest / "__0_0.distcp")
    with pytest.warns(RuntimeWarning, match="falling back"):
        step, state = manager.load_latest(shards_like=like)
    assert step == 1 and "shards" not in state and seen == [True, False]


def test_a_checkpoint_without_shards_is_a_mismatch_when_shards_are_asked_for(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    with pytest.raises(CheckpointMismatchError, match="holds no per-rank shards"):
        manager.load_latest(shards_like=_shards(0, 0))


def test_only_tensors_are_saved_per_rank(tmp_path):
    with pytest.raises(TypeError, match="only tensors"):
        CheckpointManager(tmp_path).save(1, {}, shards={"note": "text"})


def _rewrite_metadata(directory, mutate) -> None:
    from spread.checkpoint.atomic import write_manifest
    from spread.checkpoint.sharded import RestrictedUnpickler

    path = directory / ".metadata"
    with open(path, "rb") as f:
        metadata = RestrictedUnpickler(f).load()
    path.write_bytes(mutate(metadata))
    (directory / "manifest.json").unlink()
    write_manifest(directory, {"step": 2})  # a consistent manifest: only the trust boundary stops it


def _payload_pickle(metadata) -> bytes:
    return pickle.dumps(_Payload())


def _escaping_path(metadata) -> bytes:
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    return pickle.dumps(metadata)


@pytest.mark.parametrize(
    "mutate,reason",
    [(_payload_pickle, r"refers to posix\.system|refers to os\.system"), (_escaping_path, "storage path")],
)
def test_dcp_metadata_outside_the_trust_boundary_is_refused(tmp_path, monkeypatch, mutate, reason):
    monkeypatch.chdir(tmp_path)
    manager = CheckpointManager(tmp_path / "ckpts")
    manager.save(1, {"step": 1}, shards=_shards(0, 1))
    evil = manager.save(2, {"step": 2}, shards=_shards(0, 2))
    _rewrite_metadata(evil, mutate)
    with pytest.warns(RuntimeWarning, match=rf"ckpt-0000000002 is unusable .*({reason}).*never unpickled"):
        step, state = manager.load_latest(shards_like=_shards(0, 0))
    assert step == 1 and torch.equal(state["shards"]["counter"], torch.tensor([0, 1]))
    assert not (tmp_path / "PWNED").exists()


def _sharded_save_where_the_chief_dies(directory: str) -> None:
    from spread.cluster import resolve_cluster
    from spread.cluster.rendezvous import rendezvous

    rdzv = rendezvous(resolve_cluster())
    try:
        rank = rdzv.rank
        manager = CheckpointManager(directory)
        manager.save(1, {"step": 1}, shards=_shards(rank, 1))
        if rank == 0:
            os.environ["SPREAD_CHECKPOINT_CRASH_AT"] = "after_shard_write"
        manager.save(2, {"step": 2}, shards=_shards(rank, 2))
    finally:
        rdzv.close()


@pytest.mark.processes
def test_chief_killed_during_a_sharded_save_others_fail_and_latest_still_loads(tmp_path):
    from spread.testing import launch_ranks

    results = launch_ranks(
        _sharded_save_where_the_chief_dies, 2, args=(str(tmp_path),), collective_timeout=10, timeout=120
    )
    assert results[0].exitcode == -9, results[0].describe()
    worker = results[1]
    assert worker.error and worker.error.startswith(("PeerLostError", "CollectiveTimeout")), worker.describe()
    assert "rank 1: checkpoint.commit" in worker.error
    manager = CheckpointManager(tmp_path)
    step, state = manager.load_latest(shards_like=_shards(0, 0))
    assert step == 1 and torch.equal(state["shards"]["momentum"], _shards(0, 1)["momentum"])
    assert list(tmp_path.glob(".tmp-*"))  # the half-written step 2 ...
    manager.save(3, {"step": 3}, shards=_shards(0, 3))
    assert not list(tmp_path.glob(".tmp-*"))  # ... is removed by the next save


def test_load_latest_of_one_step(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        manager.save(step, {"w": torch.full((2,), float(step))})
    step, state = manager.load_latest(step=2)
    assert step == 2 and torch.equal(state["w"], torch.full((2,), 2.0))
    assert manager.load_latest(step=7) is None


FILE_SIZE_LIMIT = r"""
import resource, signal, sys
import torch
from spread.checkpoint import CheckpointManager
from spread.checkpoint.atomic import atomic_save

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as a full disk does
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
state = {"w": torch.zeros(1_000_000)}
saves = {
    "manager": lambda: CheckpointManager(sys.argv[1]).save(1, state),
    "file": lambda: atomic_save(state, sys.argv[1] + "/model.pt"),
}
for what, save in saves.items():
    try:
        save()
    except OSError as exc:
        print(what, exc.errno, exc.filename, exc.strerror, flush=True)
"""


@pytest.mark.processes
def test_a_write_the_disk_refuses_names_the_cause_and_the_file(tmp_path):
    """A full disk (or a file-size limit) used to read ``[enforce fail at inline_container.cc:672]
    ... unexpected pos``: the OS error is raised as itself, naming the file, and nothing is left."""
    run = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines == [
        f"manager {errno.EFBIG} {tmp_path / 'ckpt-0000000001' / 'state.pt'} File too large",
        f"file {errno.EFBIG} {tmp_path / 'model.pt'} File too large",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary file, no checkpoint
