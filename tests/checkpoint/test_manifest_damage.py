"""A damaged manifest is corruption: every single-byte change of ``manifest.json`` (or of its
checksum) falls back to the previous checkpoint with a warning, never a KeyError, never an
unverified load, never a wrong step."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spread.checkpoint import CheckpointManager
from spread.checkpoint.atomic import write_manifest

MANIFEST = "manifest.json"
MANIFEST_CHECKSUM = "manifest.sha256"


def _state(step: int) -> dict:
    return {"w": torch.arange(4.0) + step}


def _two_checkpoints(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(1, _state(1))
    return manager, manager.save(2, _state(2))


def _load(manager: CheckpointManager) -> tuple[tuple[int, dict] | None, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = manager.load_latest()
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def _substitute(byte: int) -> int:
    """Another character of the same kind: a digit for a digit, else a digit for a letter, else a letter."""
    char = chr(byte)
    if char.isdigit():
        return ord(str((int(char) + 1) % 10))
    return ord("7") if char.isalpha() else ord("x")


def _replacements(byte: int) -> list[int]:
    """Every single-bit flip, and a substitution of the same kind."""
    return sorted(({byte ^ (1 << bit) for bit in range(8)} | {_substitute(byte)}) - {byte})


def _outcome(manager: CheckpointManager) -> str:
    """ "harmless" (step 2, exact state, no warning), "fallback" (step 1, exact state, a warning
    naming step 2), or what went wrong."""
    try:
        result, messages = _load(manager)
    except Exception as exc:  # the bug: a bare KeyError instead of a fallback
        return f"raised {type(exc).__name__}: {exc}"
    if result is None:
        return "loaded nothing"
    step, state = result
    if step == 2 and torch.equal(state["w"], _state(2)["w"]) and not messages:
        return "harmless"
    fell_back = [m for m in messages if "ckpt-0000000002" in m and "falling back" in m]
    if step == 1 and torch.equal(state["w"], _state(1)["w"]) and fell_back:
        return "fallback"
    return f"step {step} with w={state['w'].tolist()} and warnings {messages}"


def _every_byte_change(manager: CheckpointManager, path: Path) -> tuple[Counter, list[str]]:
    """Apply each single-byte change to ``path`` in turn (restoring it after each); count outcomes."""
    good = path.read_bytes()
    counts: Counter = Counter()
    wrong: list[str] = []
    try:
        for position, byte in enumerate(good):
            for value in _replacements(byte):
                damaged = bytearray(good)
                damaged[position] = value
                path.write_bytes(bytes(damaged))
                outcome = _outcome(manager)
                kind = outcome if outcome in ("harmless", "fallback") else "wrong"
                counts[kind] += 1
                if kind == "wrong":
                    wrong.append(f"byte {position} {chr(byte)!r}->{chr(value)!r}: {outcome}")
    finally:
        path.write_bytes(good)
    return counts, wrong


@pytest.mark.parametrize("target", [MANIFEST, MANIFEST_CHECKSUM])
def test_every_single_byte_change_of_the_manifest_or_its_checksum_falls_back(tmp_path, target):
    manager, newest = _two_checkpoints(tmp_path)
    counts, wrong = _every_byte_change(manager, newest / target)
    assert wrong == [], f"{len(wrong)} of {sum(counts.values())} changes:\n" + "\n".join(wrong[:40])
    assert counts["harmless"] == 0 and counts["fallback"] > 0  # the checksum catches every change
    assert _outcome(manager) == "harmless"  # restored: loads again


def test_without_a_checksum_no_byte_change_raises_or_loads_other_weights(tmp_path):
    """A checkpoint from before ``manifest.sha256``: its structure is checked strictly, so a change
    falls back or is harmless; the one thing left unseen is a digit of "step" changed to another."""
    manager, newest = _two_checkpoints(tmp_path)
    (newest / MANIFEST_CHECKSUM).unlink(missing_ok=True)
    text = (newest / MANIFEST).read_text()
    step_at = text.index('"step": ') + len('"step": ')
    counts, wrong = _every_byte_change(manager, newest / MANIFEST)
    # Unseen without the checksum: step 2 -> another digit loads step 2's exact weights under that step.
    unseen = [w for w in wrong if w.startswith(f"byte {step_at} ") and "w=[2.0, 3.0, 4.0, 5.0]" in w]
    assert [w for w in wrong if w not in unseen] == [], "\n".join(wrong[:40])
    assert len(unseen) <= 3 and counts["fallback"] > 0


@pytest.mark.parametrize("checksum", [True, False], ids=["with-checksum", "without-checksum"])
def test_files_renamed_and_a_flipped_weight_falls_back(tmp_path, checksum):
    manager, newest = _two_checkpoints(tmp_path)
    if not checksum:
        (newest / MANIFEST_CHECKSUM).unlink(missing_ok=True)
    manifest = newest / MANIFEST
    manifest.write_text(manifest.read_text().replace('"files"', '"filez"'))
    state = newest / "state.pt"
    data = bytearray(state.read_bytes())
    at = bytes(data).index(_state(2)["w"].numpy().tobytes())  # a byte of the weights themselves
    data[at + 1] ^= 0x01
    state.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match=r"ckpt-0000000002 is unusable .*falling back"):
        step, loaded = manager.load_latest()
    assert step == 1 and torch.equal(loaded["w"], _state(1)["w"])


def test_a_checkpoint_without_a_checksum_loads_when_intact(tmp_path):
    manager, newest = _two_checkpoints(tmp_path)
    (newest / MANIFEST_CHECKSUM).unlink(missing_ok=True)
    result, messages = _load(manager)
    assert result is not None and messages == []
    assert result[0] == 2 and torch.equal(result[1]["w"], _state(2)["w"])


def _edit(change: Callable[[dict], object]) -> Callable[[str], str]:
    def rewrite(text: str) -> str:
        manifest = json.loads(text)
        replaced = change(manifest)
        return json.dumps(manifest if replaced is None else replaced, indent=1, sort_keys=True)

    return rewrite


def _entry(manifest: dict) -> dict:
    return manifest["files"]["state.pt"]


MALFORMED = {
    "files missing": _edit(lambda m: m.pop("files")),
    "files empty": _edit(lambda m: m.update(files={})),
    "files a list": _edit(lambda m: m.update(files=[m["files"]])),
    "entry without sha256": _edit(lambda m: _entry(m).pop("sha256")),
    "entry without size": _edit(lambda m: _entry(m).pop("size")),
    "entry not an object": _edit(lambda m: m["files"].update({"state.pt": "x"})),
    "sha256 upper case": _edit(lambda m: _entry(m).update(sha256=_entry(m)["sha256"].upper())),
    "sha256 short": _edit(lambda m: _entry(m).update(sha256=_entry(m)["sha256"][:-1])),
    "size negative": _edit(lambda m: _entry(m).update(size=-1)),
    "step missing": _edit(lambda m: m.pop("step")),
    "step a string": _edit(lambda m: m.update(step="2")),
    "step a bool": _edit(lambda m: m.update(step=True)),
    "step negative": _edit(lambda m: m.update(step=-2)),
    "step a float": _edit(lambda m: m.update(step=2.0)),
    "not an object": _edit(lambda m: [m]),
    "name with a slash": _edit(lambda m: m.update(files={"sub/state.pt": _entry(m)})),
    "a key twice": lambda text: text.replace('"step": 2', '"step": 2, "step": 2'),
}


@pytest.mark.parametrize("rewrite", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_manifest_without_a_checksum_falls_back(tmp_path, rewrite):
    manager, newest = _two_checkpoints(tmp_path)
    (newest / MANIFEST_CHECKSUM).unlink(missing_ok=True)
    manifest = newest / MANIFEST
    manifest.write_text(rewrite(manifest.read_text()))
    with pytest.warns(RuntimeWarning, match=r"manifest\.json is (malformed|not valid JSON).*falling back"):
        step, loaded = manager.load_latest()
    assert step == 1 and torch.equal(loaded["w"], _state(1)["w"])


@pytest.mark.parametrize("checksum", [True, False], ids=["with-checksum", "without-checksum"])
@pytest.mark.parametrize("name", ["extra.bin", ".hidden"])
def test_a_file_the_manifest_does_not_list_falls_back_and_is_named(tmp_path, checksum, name):
    manager, newest = _two_checkpoints(tmp_path)
    if not checksum:
        (newest / MANIFEST_CHECKSUM).unlink(missing_ok=True)
    (newest / name).write_bytes(b"not in the manifest")
    with pytest.warns(RuntimeWarning, match=rf"{name} is not listed in .*manifest\.json.*falling back"):
        step, loaded = manager.load_latest()
    assert step == 1 and torch.equal(loaded["w"], _state(1)["w"])


def test_the_manifest_rewritten_in_place_lists_every_file_but_itself_and_its_checksum(tmp_path):
    manager, newest = _two_checkpoints(tmp_path)
    (newest / MANIFEST).unlink()
    write_manifest(newest, {"step": 2})  # over a stale manifest.sha256
    assert sorted(json.loads((newest / MANIFEST).read_text())["files"]) == ["state.pt"]
    assert _outcome(manager) == "harmless"


def test_a_manifest_verify_would_refuse_is_never_written(tmp_path):
    (tmp_path / "state.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r'"step" is not a non-negative integer'):
        write_manifest(tmp_path, {"step": -1})
    assert not (tmp_path / MANIFEST).exists()
