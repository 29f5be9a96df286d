"""Checkpoints at an fsspec URL (:mod:`spread.checkpoint.remote`), against a real S3-compatible server
started here: moto's server mode on 127.0.0.1 (a random port), reached through s3fs.

Round trip, keep-last-k, a crash (SIGKILL) at every crash point leaves the previous checkpoint as
``latest``, a corrupt object is detected by its checksum and skipped for the previous checkpoint,
and a 2-process ``BackupAndRestore`` job resumed from S3 ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.checkpoint import CheckpointManager
from spread.checkpoint.remote import RemoteCheckpointManager, is_url
from spread.testing import run_ranks

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'spread[s3]')")
moto_server = pytest.importorskip("moto.server", reason="moto is not installed (the test extra has it)")

BUCKET = "spread-test"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a random local port, the environment pointing s3fs at it, one bucket."""
    import fsspec
    import s3fs

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {**ENV, "FSSPEC_S3_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # fsspec reads FSSPEC_* once, at import: this process imported it already (spawned ranks read it)
    conf_before = dict(fsspec.config.conf.get("s3", {}))
    fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.mkdir(BUCKET)
    try:
        yield {"endpoint": endpoint, "fs": fs, "env": env}
    finally:
        fsspec.config.conf["s3"] = conf_before
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def _url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((64, 64), value)}, "step": int(value)}


def test_urls_are_told_apart_from_paths():
    assert is_url("s3://bucket/run") and is_url("gs://b/x") and is_url("memory://x")
    assert not is_url("/tmp/run") and not is_url("file:///tmp/run") and not is_url(Path("/tmp/x"))


def test_a_round_trip_keeps_the_newest_k(s3):
    manager = CheckpointManager(_url("round-trip"), keep=2)
    assert isinstance(manager, RemoteCheckpointManager)
    assert manager.load_latest() is None
    for step in (1, 2, 3):
        manager.save(step, _state(float(step)))
    step, state = manager.load_latest()
    assert step == 3 and torch.equal(state["model"]["w"], torch.full((64, 64), 3.0)) and state["step"] == 3
    assert [n.split(".")[0] for n in manager.checkpoints()] == ["ckpt-0000000002", "ckpt-0000000003"]
    earlier = manager.load_latest(step=2)
    assert earlier is not None and earlier[0] == 2


@pytest.mark.parametrize("damage", ["state", "manifest", "extra object", "missing state"])
def test_a_corrupt_object_is_detected_and_the_previous_checkpoint_loads(s3, damage):
    url = _url(f"corrupt-{damage.replace(' ', '-')}")
    manager = CheckpointManager(url, keep=3)
    manager.save(1, _state(1.0))
    manager.save(2, _state(2.0))
    fs, newest = s3["fs"], f"{BUCKET}/{url.split('/')[-1]}/{manager.checkpoints()[-1]}"
    if damage == "state":
        data = bytearray(fs.cat_file(f"{newest}/state.pt"))
        data[len(data) // 2] ^= 0xFF
        fs.pipe_file(f"{newest}/state.pt", bytes(data))
        reason = "does not match its checksum"
    elif damage == "manifest":
        fs.pipe_file(f"{newest}/manifest.json", fs.cat_file(f"{newest}/manifest.json").replace(b"2", b"3", 1))
        reason = "manifest.json does not match its checksum"
    elif damage == "extra object":
        fs.pipe_file(f"{newest}/planted.pt", b"not listed")
        reason = "is not listed"
    else:
        fs.rm(f"{newest}/state.pt")
        reason = "state.pt is missing"
    with pytest.warns(RuntimeWarning, match=reason):
        step, state = manager.load_latest()
    assert step == 1 and torch.equal(state["model"]["w"], torch.full((64, 64), 1.0))


_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from spread.checkpoint import CheckpointManager

    url, point = sys.argv[1], sys.argv[2]
    manager = CheckpointManager(url, keep=3)
    manager.save(1, {"w": torch.full((64,), 1.0)})
    os.environ["SPREAD_CHECKPOINT_CRASH_AT"] = point
    manager.save(2, {"w": torch.full((64,), 2.0)})
    print("NOT KILLED", flush=True)
    """
)


@pytest.mark.processes
@pytest.mark.parametrize(
    "point,latest",
    [("after_shard_write", 1), ("after_manifest", 1), ("after_rename", 1), ("after_pointer", 2)],
)
def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_latest(s3, tmp_path, point, latest):
    script = tmp_path / "save.py"
    script.write_text(_CRASH_SCRIPT)
    url = _url(f"crash-{point}")
    env = {**os.environ, **s3["env"], "PYTHONPATH": str(Path(spread.__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, str(script), url, point], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == -signal.SIGKILL, out.stdout + out.stderr
    manager = CheckpointManager(url, keep=3)
    found = manager.load_latest()
    assert found is not None and found[0] == latest
    assert torch.equal(found[1]["w"], torch.full((64,), float(latest)))
    manager.save(3, {"w": torch.full((64,), 3.0)})  # the crashed writer's objects are cleaned up
    names = [n for n, _ in manager._listing()]
    assert all(done for _, done in manager._listing()), names
    assert manager.load_latest()[0] == 3


def test_sharded_pieces_are_refused_for_object_storage_before_anything_is_written(s3):
    manager = CheckpointManager(_url("pieces"))
    with pytest.raises(ValueError, match="cannot be written to s3://"):
        manager.save(1, {"step": 1}, shards={"w": torch.zeros(2)})
    assert manager.checkpoints() == []


def test_model_checkpoint_writes_a_url(s3):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    checkpoint = spread.callbacks.ModelCheckpoint(_url("models/e{epoch}.pt"), save_freq="epoch")
    trainer = spread.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), callbacks=[checkpoint]
    )
    trainer.fit((torch.randn(16, 4), torch.randn(16, 2)), epochs=2, global_batch_size=8, verbose=0)
    import io

    saved = torch.load(io.BytesIO(s3["fs"].cat_file(f"{BUCKET}/models/e2.pt")), weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(saved[key], value), key


class _Crash(spread.callbacks.Callback):
    def on_train_batch_end(self, step, logs=None):
        if self.trainer.global_step == 10:
            raise RuntimeError("simulated crash")


def _fit(strategy, backup, *, crash: bool = False) -> dict:
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(96, 16, generator=g), torch.randint(0, 4, (96,), generator=g))
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    callbacks = [backup, *([_Crash()] if crash else [])]
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), strategy=strategy, callbacks=callbacks)
    trainer.fit(data, epochs=2, global_batch_size=16, seed=7, verbose=0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _resume_from_s3(root: str) -> dict:
    strategy = spread.MultiWorkerMirroredStrategy()
    try:
        BackupAndRestore = spread.callbacks.BackupAndRestore
        reference = _fit(strategy, BackupAndRestore(f"{root}/ref", save_freq=3))
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit(strategy, BackupAndRestore(f"{root}/run", save_freq=3), crash=True)
        backup = BackupAndRestore(f"{root}/run", save_freq=3)
        resumed = _fit(strategy, backup)
        return {"restored": backup.restored_step, "reference": reference, "resumed": resumed}
    finally:
        strategy.close()


@pytest.mark.processes
def test_a_2_process_job_resumes_from_s3_equal_to_the_uninterrupted_run(s3):
    root = _url("backup-job")
    per_rank = run_ranks(_resume_from_s3, 2, args=(root,), env=s3["env"], timeout=240)
    for rank, result in enumerate(per_rank):
        assert result["restored"] == 9, f"rank {rank}"
        for key, value in result["reference"].items():
            assert torch.equal(result["resumed"][key], value), f"rank {rank}: {key}"
    assert not s3["fs"].exists(f"{BUCKET}/backup-job/run")  # delete_checkpoint=True: removed at the end
