"""Checkpoints: atomic under SIGKILL, verified on load, fall back past corruption, refuse unsafe data."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from spread.checkpoint import CheckpointManager
from spread.checkpoint.atomic import CRASH_POINTS
from spread.errors import CheckpointCorruptError, NonFiniteLossError


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
