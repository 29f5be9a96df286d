"""Asynchronous checkpoints (:mod:`spread.checkpoint.background` and ``save_checkpoint(blocking=False)``):
the snapshot is a copy taken at the call, one write in flight, a failure raised on the training
thread (never swallowed), and a SIGKILL during a background write leaves the previous checkpoint as
``latest``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import spread
from spread.checkpoint import CheckpointManager
from spread.checkpoint.background import BackgroundWriter, Stager


def test_a_snapshot_is_a_copy_taken_when_it_is_made():
    weight = torch.arange(6.0)
    state = {"model": {"w": weight, "tied": weight, "view": weight[2:4]}, "step": 3, "names": ["a", "b"]}
    snapshot = Stager().snapshot(state).ready()
    weight.add_(100.0)  # the next optimizer step, in place
    assert torch.equal(snapshot["model"]["w"], torch.arange(6.0))
    assert snapshot["model"]["tied"] is snapshot["model"]["w"]  # held twice, copied once
    assert torch.equal(snapshot["model"]["view"], torch.tensor([2.0, 3.0]))
    assert snapshot["model"]["view"].untyped_storage().nbytes() == 2 * 4  # not the whole storage
    assert snapshot["step"] == 3 and snapshot["names"] == ["a", "b"]


def test_a_failed_background_write_is_raised_at_the_next_submit_and_named():
    writer = BackgroundWriter("test")

    def fail(_):
        raise OSError(28, "No space left on device", "/ckpt/state.pt")

    writer.submit({}, fail, "the checkpoint of step 4 to /ckpt")
    with pytest.raises(OSError, match="No space left") as info:
        writer.submit({}, lambda _: None, "the checkpoint of step 8 to /ckpt")
    assert "(raised by the background write of the checkpoint of step 4 to /ckpt)" in info.value.__notes__
    writer.wait()  # the write of step 8 was not started: nothing in flight, nothing raised twice
    assert not writer.in_flight


def test_at_most_one_write_is_in_flight():
    writer = BackgroundWriter("test")
    release = threading.Event()
    order: list[str] = []

    def first(_):
        release.wait(10)
        order.append("first done")

    writer.submit({}, first, "first")
    second_submitted = threading.Event()

    def submit_second():
        writer.submit({}, lambda _: order.append("second"), "second")
        second_submitted.set()

    thread = threading.Thread(target=submit_second)
    thread.start()
    assert not second_submitted.wait(0.3)  # blocked behind the first write
    release.set()
    thread.join(10)
    writer.wait()
    assert order == ["first done", "second"]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_a_background_save_holds_the_state_of_the_call_not_of_later_steps(tmp_path):
    strategy = spread.OneDeviceStrategy("cpu")
    model, optimizer = _model_and_optimizer()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    path = strategy.save_checkpoint(
        tmp_path, {"model": model, "optimizer": optimizer}, step=1, blocking=False
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on while the write is in flight
    strategy.wait_for_checkpoint()
    assert path == tmp_path / "ckpt-0000000001" and (tmp_path / "latest").read_text() == path.name
    fresh, fresh_optimizer = _model_and_optimizer()
    restored = strategy.load_checkpoint(tmp_path, {"model": fresh, "optimizer": fresh_optimizer})
    assert restored is not None and restored.step == 1
    for key, value in at_save.items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_failed_background_save_is_raised_by_wait_for_checkpoint_and_the_next_save(tmp_path):
    strategy = spread.OneDeviceStrategy("cpu")
    model, _ = _model_and_optimizer()
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    strategy.save_checkpoint(blocked, {"model": model}, step=1, blocking=False)
    with pytest.raises(OSError) as info:
        strategy.wait_for_checkpoint()
    assert any("background write of the checkpoint of step 1" in note for note in info.value.__notes__)
    strategy.wait_for_checkpoint()  # raised once, not again
    strategy.save_checkpoint(blocked, {"model": model}, step=2, blocking=False)
    with pytest.raises(OSError):
        strategy.save_checkpoint(tmp_path / "ok", {"model": model}, step=3, blocking=False)


def test_model_checkpoint_writes_in_the_background_and_the_end_of_fit_waits(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    checkpoint = spread.callbacks.ModelCheckpoint(
        str(tmp_path / "e{epoch}.pt"), save_freq="epoch", async_save=True
    )
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), callbacks=[checkpoint])
    trainer.fit((x, y), epochs=3, global_batch_size=16, verbose=0)
    assert checkpoint.saved == [str(tmp_path / f"e{e}.pt") for e in (1, 2, 3)]
    last = torch.load(tmp_path / "e3.pt", weights_only=True)
    for key, value in model.state_dict().items():
        assert torch.equal(last[key], value), key
    assert not [t for t in threading.enumerate() if t.name.startswith("spread-model-checkpoint")]


def test_model_checkpoint_raises_a_failed_background_write_by_the_end_of_fit(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    (tmp_path / "blocked").write_text("a file where a directory is needed")
    checkpoint = spread.callbacks.ModelCheckpoint(
        str(tmp_path / "blocked" / "m.pt"), save_freq="epoch", async_save=True
    )
    trainer = spread.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), callbacks=[checkpoint]
    )
    with pytest.raises(OSError):
        trainer.fit(
            (torch.randn(16, 4), torch.randint(0, 2, (16,))), epochs=1, global_batch_size=8, verbose=0
        )
    assert checkpoint.saved == []


def test_the_end_of_fit_commits_the_last_backup_and_leaves_no_thread(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backup = spread.callbacks.BackupAndRestore(str(tmp_path), save_freq=2, delete_checkpoint=False)
    assert backup.async_save  # the default
    trainer = spread.Trainer(model, optimizer, nn.CrossEntropyLoss(), callbacks=[backup])
    trainer.fit((torch.randn(64, 4), torch.randint(0, 2, (64,))), epochs=1, global_batch_size=8, verbose=0)
    assert (tmp_path / "latest").read_text() == "ckpt-0000000008"  # the last step's backup
    assert not [t for t in threading.enumerate() if t.name.startswith("spread-checkpoint")]


def test_async_save_must_be_a_bool():
    with pytest.raises(ValueError, match="async_save"):
        spread.callbacks.BackupAndRestore("/tmp/x", async_save="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="async_save"):
        spread.callbacks.ModelCheckpoint("/tmp/x.pt", async_save=1)  # type: ignore[arg-type]


# A job that saves step 1, then saves step 2 in the background and trains on; the crash point named
# on its command line SIGKILLs it inside the background write of step 2.
_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    import spread

    directory, point = sys.argv[1], sys.argv[2]
    strategy = spread.OneDeviceStrategy("cpu")
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    strategy.save_checkpoint(directory, {"model": model}, step=1, blocking=False)
    strategy.wait_for_checkpoint()
    os.environ["SPREAD_CHECKPOINT_CRASH_AT"] = point
    with torch.no_grad():
        model.weight.add_(1.0)
    strategy.save_checkpoint(directory, {"model": model}, step=2, blocking=False)
    print("SUBMITTED", flush=True)
    for _ in range(200):  # training goes on until the background thread's crash point kills us
        model(torch.randn(64, 256)).sum()
        time.sleep(0.05)
    strategy.wait_for_checkpoint()
    print("NOT KILLED", flush=True)
    """
)


@pytest.mark.processes
@pytest.mark.parametrize(
    "point,latest",
    [("after_shard_write", 1), ("after_manifest", 1), ("after_rename", 1), ("after_pointer", 2)],
)
def test_a_sigkill_during_a_background_write_leaves_the_previous_checkpoint_latest(tmp_path, point, latest):
    script = tmp_path / "job.py"
    script.write_text(_CRASH_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(spread.__file__).parents[1])])}
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), point],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == -signal.SIGKILL, out.stdout + out.stderr
    assert "SUBMITTED" in out.stdout and "NOT KILLED" not in out.stdout
    found = CheckpointManager(tmp_path / "ckpt").load_latest()
    assert found is not None and found[0] == latest
    weight = found[1]["objects"]["model"]["state"]["weight"]
    torch.manual_seed(0)
    expected = nn.Linear(256, 256).weight.detach() + (1.0 if latest == 2 else 0.0)
    assert torch.equal(weight, expected)
