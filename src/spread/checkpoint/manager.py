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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from spread.checkpoint.atomic import crash_point, fsync_path, replace_pointer, verify, write_manifest
from spread.checkpoint.compat import raise_if, tensor_mismatches
from spread.checkpoint.sharded import METADATA_FILE, UnsafeMetadataError, load_shards, save_shards
from spread.comm.ops import Collectives
from spread.errors import CheckpointCorruptError, CheckpointMismatchError, NonFiniteLossError

STATE_FILE = "state.pt"
SHARDS_KEY = "shards"  # where load_latest(shards_like=...) puts this rank's shards
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
    def save(
        self, step: int, state: dict[str, Any], *, shards: Mapping[str, torch.Tensor] | None = None
    ) -> Path:
        """Write ``state`` as the checkpoint of ``step`` and point ``latest`` at it.

        Without ``shards`` only the caller writes (call it on the chief for replicated state). With
        ``shards`` (this rank's own tensors, e.g. an optimizer shard) the call is collective: every
        rank of the default process group must make it; every rank's shards go through
        ``torch.distributed.checkpoint`` into the same temporary directory, the chief adds ``state``
        (the replicated part, written once; other ranks' ``state`` is ignored) and commits.
        """
        if shards is not None:
            return self._save_with_shards(step, state, shards)
        _check_finite(state, step)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temporaries()
        final = self.directory / f"ckpt-{step:010d}"
        tmp = self.directory / f".tmp-{final.name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            torch.save(state, tmp / STATE_FILE)
            crash_point("after_shard_write")
            self._commit(step, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._publish(final)
        return final

    def _save_with_shards(self, step: int, state: dict[str, Any], shards: Mapping[str, torch.Tensor]) -> Path:
        collectives = Collectives() if dist.is_initialized() else None
        rank = collectives.rank if collectives is not None else 0
        finite = _is_finite(shards) and (rank != 0 or _is_finite(state))
        if collectives is not None:
            flag = torch.tensor([1.0 if finite else 0.0], device=collectives.device)
            finite = bool(collectives.all_reduce(flag, "min", name="checkpoint.check_finite").item() > 0)
        if not finite:
            raise NonFiniteLossError(f"refusing to checkpoint step {step}: the state holds non-finite values")
        final = self.directory / f"ckpt-{step:010d}"
        tmp = self.directory / f".tmp-{final.name}-shared"  # one name every rank can compute
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.remove_stale_temporaries()
            tmp.mkdir()
        if collectives is not None:
            collectives.barrier(name="checkpoint.prepare")
        try:
            save_shards(tmp, rank, shards)  # collective: each rank its file, the coordinator .metadata
            if rank == 0:
                torch.save(state, tmp / STATE_FILE)
                crash_point("after_shard_write")
                self._commit(step, tmp, final)
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if rank == 0:
            self._publish(final)
        if collectives is not None:
            collectives.barrier(name="checkpoint.commit")  # every rank returns once the step is durable
        return final

    def _commit(self, step: int, tmp: Path, final: Path) -> None:
        write_manifest(tmp, {"step": step})
        crash_point("after_manifest")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_path(self.directory)

    def _publish(self, final: Path) -> None:
        crash_point("after_rename")
        replace_pointer(self.directory / POINTER, final.name)
        crash_point("after_pointer")
        self._prune()

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

    def load_latest(
        self,
        map_location: str | torch.device | None = "cpu",
        *,
        like: Mapping[str, Any] | None = None,
        shards_like: Mapping[str, torch.Tensor] | None = None,
        step: int | None = None,
    ) -> tuple[int, dict] | None:
        """Return ``(step, state)`` of the newest valid checkpoint, or None when there is none.

        A corrupt or partial checkpoint is skipped with a warning naming the file and the reason; if
        checkpoints exist but none is valid, raises CheckpointCorruptError naming the directory.

        ``like``: the state this checkpoint will be loaded into (e.g. ``{"model": model.state_dict()}``);
        every tensor under its top-level keys must be in the checkpoint with the same shape and dtype,
        and nothing else may be there, or :class:`~spread.errors.CheckpointMismatchError` lists every
        difference (a mismatch is a configuration error, so there is no fallback to older ones).
        ``shards_like``: this rank's per-rank tensors to read back (see :meth:`save`); they are
        returned as ``state["shards"]``. No collectives: every rank may load on its own.
        ``step``: only the checkpoint of that step (None when there is none).
        """
        candidates = self.checkpoints()
        if step is not None:
            candidates = [c for c in candidates if c.name == f"ckpt-{step:010d}"]
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
                if like is not None:
                    found = {k: state.get(k) for k in like}
                    raise_if(tensor_mismatches(found, like), str(path), "given state")
                if shards_like is not None:
                    state[SHARDS_KEY] = self._load_shards(path, shards_like, map_location)
            except CheckpointMismatchError:
                raise  # the checkpoint is fine; what it is loaded into differs: no fallback
            except UnsafeMetadataError as exc:
                reason = f"{exc} (refused: never unpickled unsafely)"
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

    def _load_shards(
        self, path: Path, like: Mapping[str, torch.Tensor], map_location: str | torch.device | None
    ) -> dict[str, torch.Tensor]:
        if not (path / METADATA_FILE).is_file():
            raise CheckpointMismatchError(
                str(path), "per-rank state", ["the checkpoint holds no per-rank shards"]
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        loaded = load_shards(path, rank, like)
        return {k: v.to(map_location) if map_location is not None else v for k, v in loaded.items()}


def _is_finite(state: Any) -> bool:
    return all(
        torch.isfinite(leaf).all()
        for leaf in pytree.tree_leaves(state)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    )


def _check_finite(state: dict[str, Any], step: int) -> None:
    if not _is_finite(state):
        raise NonFiniteLossError(f"refusing to checkpoint step {step}: the state holds non-finite values")
