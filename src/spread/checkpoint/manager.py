"""Save and restore training state atomically, keep the last k, fall back past corrupt ones.

Loads use ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain containers only,
and a file crafted to run code on unpickling is refused (and named), never retried unsafely.
A state holding a NaN or infinite floating-point tensor is refused at save time, so a restart never
resumes from a poisoned state.
"""

from __future__ import annotations

import pickle
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from spread.checkpoint.atomic import crash_point, fsync_path, replace_pointer, verify, write_manifest
from spread.errors import CheckpointCorruptError, NonFiniteLossError

STATE_FILE = "state.pt"
POINTER = "latest"
_NAME = re.compile(r"^ckpt-(\d{10})$")


class CheckpointManager:
    """Checkpoints in ``directory`` as ``ckpt-<step>/`` with a ``latest`` pointer.

    Only one process should call :meth:`save` for replicated state (the chief); every process may
    call :meth:`load_latest`.
    """

    def __init__(self, directory: str | Path, *, keep: int = 3) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"Invalid value for argument `keep`. Expected a positive integer. Received: keep={keep!r}"
            )
        self.directory = Path(directory)
        self.keep = keep

    # -- writing -------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` and point ``latest`` at it."""
        _check_finite(state, step)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temporaries()
        final = self.directory / f"ckpt-{step:010d}"
        tmp = self.directory / f".tmp-{final.name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            torch.save(state, tmp / STATE_FILE)
            crash_point("after_shard_write")
            write_manifest(tmp, {"step": step})
            crash_point("after_manifest")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_path(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        crash_point("after_rename")
        replace_pointer(self.directory / POINTER, final.name)
        crash_point("after_pointer")
        self._prune()
        return final

    def remove_stale_temporaries(self) -> None:
        """Delete half-written checkpoints left by a crash (they never had their final name)."""
        for p in self.directory.glob(".tmp-ckpt-*"):
            shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # -- reading -------------------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Complete-looking checkpoint directories, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if p.is_dir() and _NAME.match(p.name))

    def load_latest(self, map_location: str | torch.device | None = "cpu") -> tuple[int, dict] | None:
        """Return ``(step, state)`` of the newest valid checkpoint, or None when there is none.

        A corrupt or partial checkpoint is skipped with a warning naming the file and the reason; if
        checkpoints exist but none is valid, raises CheckpointCorruptError naming the directory.
        """
        candidates = self.checkpoints()
        pointer = self.directory / POINTER
        if pointer.is_file():
            named = self.directory / pointer.read_text().strip()
            if named in candidates:  # the pointer's target first, then the others newest first
                candidates.remove(named)
                candidates.append(named)
        if not candidates:
            return None
        problems = []
        for path in reversed(candidates):
            try:
                manifest = verify(path)
                state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
            except pickle.UnpicklingError:
                reason = (
                    f"{STATE_FILE} holds more than tensors and plain data (refused under weights_only=True)"
                )
            except (ValueError, OSError, RuntimeError, EOFError) as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            else:
                return int(manifest["step"]), state
            problems.append(f"{path.name}: {reason}")
            warnings.warn(
                f"checkpoint {path} is unusable ({reason}); falling back to an older one",
                RuntimeWarning,
                stacklevel=2,
            )
        raise CheckpointCorruptError(str(self.directory), "no valid checkpoint: " + "; ".join(problems))


def _check_finite(state: dict[str, Any], step: int) -> None:
    for leaf in pytree.tree_leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not torch.isfinite(leaf).all():
            raise NonFiniteLossError(f"refusing to checkpoint step {step}: the state holds non-finite values")
