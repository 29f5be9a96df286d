"""A checkpoint pruned or replaced while it is read is "gone" (read the new latest), never "corrupt"."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import spread.checkpoint.manager as manager_module
from spread.checkpoint import CheckpointManager
from spread.errors import CheckpointCorruptError


def _state(step: int, numel: int = 9) -> dict:
    return {"w": torch.full((numel,), float(step)), "step": step}


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _once_while_reading(monkeypatch, where: str, action) -> list:
    """Run ``action(path)`` the first time load_latest reaches ``where`` ("verify" or "torch.load")
    for a checkpoint, then carry on with the real call; return the paths that were read."""
    seen: list = []
    if where == "verify":
        real = manager_module.verify

        def hooked(path):
            seen.append(path)
            if len(seen) == 1:
                action(path)
            return real(path)

        monkeypatch.setattr(manager_module, "verify", hooked)
    else:
        real_load = torch.load

        def hooked_load(file, *args, **kwargs):
            if isinstance(file, Path) and file.name == "state.pt":  # not DCP's own reads
                seen.append(file.parent)
                if len(seen) == 1:
                    action(file.parent)
            return real_load(file, *args, **kwargs)

        monkeypatch.setattr(torch, "load", hooked_load)
    return seen


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("where", ["verify", "torch.load"])
def test_a_checkpoint_pruned_while_read_is_gone_and_the_new_latest_is_read(tmp_path, where, monkeypatch):
    reader, writer = CheckpointManager(tmp_path, keep=1), CheckpointManager(tmp_path, keep=1)
    writer.save(1, _state(1))
    seen = _once_while_reading(monkeypatch, where, lambda path: writer.save(2, _state(2)))  # prunes 1
    step, state = reader.load_latest()
    assert step == 2 and torch.equal(state["w"], _state(2)["w"])
    assert [p.name for p in seen] == ["ckpt-0000000001", "ckpt-0000000002"]  # read 1, gone, read 2


@pytest.mark.filterwarnings("error")
def test_a_sharded_checkpoint_pruned_before_its_shards_are_read_is_gone_not_a_mismatch(tmp_path, monkeypatch):
    shards = {"momentum": torch.arange(4.0)}
    reader, writer = CheckpointManager(tmp_path, keep=1), CheckpointManager(tmp_path, keep=1)
    writer.save(1, {"step": 1}, shards=shards)
    # Pruned after state.pt was read: its shard index is missing, which alone would mean "saved
    # without shards", a mismatch with no fallback.
    _once_while_reading(monkeypatch, "torch.load", lambda path: writer.save(2, {"step": 2}, shards=shards))
    step, state = reader.load_latest(shards_like={"momentum": torch.zeros(4)})
    assert step == 2 and torch.equal(state["shards"]["momentum"], shards["momentum"])


@pytest.mark.filterwarnings("error")
def test_a_checkpoint_replaced_under_its_own_name_is_read_again(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, _state(1))
    replacement = {"w": torch.full((9,), 7.0), "step": 1}
    _once_while_reading(monkeypatch, "torch.load", lambda path: manager.save(1, replacement))
    step, state = manager.load_latest()
    assert step == 1 and torch.equal(state["w"], replacement["w"])


@pytest.mark.filterwarnings("error")
def test_a_listing_that_missed_every_checkpoint_still_finds_what_latest_names(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    # Both renames happened while the directory was read: the listing holds neither.
    monkeypatch.setattr(CheckpointManager, "checkpoints", lambda self: [])
    step, _ = manager.load_latest()
    assert step == 2


def test_latest_naming_a_deleted_checkpoint_loads_nothing(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, _state(1))
    manager._remove(tmp_path / "ckpt-0000000001")  # deleted by hand; ``latest`` is left behind
    assert manager.load_latest() is None


def test_corrupt_is_still_corrupt_and_warned_about_once_across_relistings(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    _flip_byte(tmp_path / "ckpt-0000000003" / "state.pt")
    # Step 2 disappears while it is read (after 3 was found corrupt): the reader lists again,
    # skips 3 without a second warning, and falls back to 1.
    real = manager_module.verify
    calls = []

    def hooked(path):
        calls.append(path.name)
        if path.name == "ckpt-0000000002":
            manager._remove(path)
        return real(path)

    monkeypatch.setattr(manager_module, "verify", hooked)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, _ = manager.load_latest()
    assert step == 1
    assert calls == ["ckpt-0000000003", "ckpt-0000000002", "ckpt-0000000001"]
    assert [str(w.message) for w in caught] == [
        f"checkpoint {tmp_path / 'ckpt-0000000003'} is unusable ({tmp_path / 'ckpt-0000000003' / 'state.pt'} "
        "does not match its checksum); falling back to an older one"
    ]


def test_a_deleted_file_in_a_checkpoint_that_is_still_there_is_corrupt(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(1, _state(1))
    (tmp_path / "ckpt-0000000001" / "state.pt").unlink()
    with pytest.warns(RuntimeWarning, match="state.pt is missing"), pytest.raises(CheckpointCorruptError):
        manager.load_latest()


def test_a_save_of_an_older_step_is_never_pruned_by_itself(tmp_path):
    manager = CheckpointManager(tmp_path, keep=1)
    manager.save(5, _state(5))
    manager.save(3, _state(3))  # e.g. after restoring an older checkpoint
    assert (tmp_path / "latest").read_text() == "ckpt-0000000003"
    assert manager.load_latest()[0] == 3
    assert not list(tmp_path.glob(".trash-*"))


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from spread.checkpoint import CheckpointManager
    manager, step = CheckpointManager(sys.argv[1], keep=1), 0
    while True:
        step += 1
        manager.save(step, {"w": torch.full((65536,), float(step)), "step": step})
    """
)


@pytest.mark.processes
def test_a_reader_beside_a_writer_saving_back_to_back_never_fails(tmp_path):
    """Without the gone/corrupt distinction about 2% of these reads fail or warn."""
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)])
    reader = CheckpointManager(tmp_path, keep=1)
    steps, nones, calls = set(), 0, 0
    try:
        deadline = time.monotonic() + 60
        while reader.load_latest() is None:
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never saved"
            time.sleep(0.01)
        start = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning about a healthy checkpoint fails the test
            while (time.monotonic() - start < 3 or len(steps) < 50) and time.monotonic() < deadline:
                got = reader.load_latest()
                calls += 1
                if got is None:
                    nones += 1
                    continue
                step, state = got
                assert torch.equal(state["w"], torch.full((65536,), float(step)))
                steps.add(step)
        assert writer.poll() is None, "the writer died"
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert nones == 0
    assert len(steps) >= 50, f"the writer published only {len(steps)} checkpoints in {calls} reads"
