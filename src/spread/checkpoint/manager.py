"""Save and restore training state atomically, keep the last k, fall back past corrupt ones.

Loads use ``torch.load(weights_only=True)``: a checkpoint holds tensors and plain containers only,
and a file crafted to run code on unpickling is refused (and named), never retried unsafely.
A state holding a NaN or infinite floating-point tensor is refused at save time, so a restart never
resumes from a poisoned state.

Readers and the writer need no lock between them. A checkpoint leaves its ``ckpt-<step>`` name in one
rename (to a hidden ``.trash-`` name, deleted afterwards), so under its name it is always whole. A
read that fails because the checkpoint is no longer under its name (the writer pruned or replaced
it, and a newer one exists) is therefore "gone", not "corrupt": the reader lists again and reads the
new ``latest``, without a warning. Only a checkpoint that fails while still under its name is corrupt.
"""

from __future__ import annotations

import pickle
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from spread.checkpoint.atomic import (
    MANIFEST,
    crash_point,
    fsync_path,
    replace_pointer,
    verify,
    write_file,
    write_manifest,
)
from spread.checkpoint.compat import raise_if, tensor_mismatches
from spread.checkpoint.remote import RemoteCheckpointManager, is_url
from spread.checkpoint.sharded import METADATA_FILE, UnsafeMetadataError, load_shards, save_shards
from spread.comm.ops import Collectives
from spread.errors import CheckpointCorruptError, CheckpointMismatchError, NonFiniteLossError

STATE_FILE = "state.pt"
SHARDS_KEY = "shards"  # where load_latest(shards_like=...) puts this rank's shards
POINTER = "latest"
_NAME = re.compile(r"^ckpt-(\d{10})$")
TRASH_PREFIX = ".trash-"  # a checkpoint being deleted: out of the ckpt-* namespace, never read
# How many times one load_latest() lists again after the checkpoint it read was pruned or replaced
# under it: each time means a newer one was published meanwhile, so only a writer saving faster
# than this process can read a checkpoint exhausts it.
_RELISTS = 100
_GONE = object()  # what was being read no longer exists under its name
# What this rank reads back per rank: given, or worked out from the replicated state (None: nothing).
ShardsLike = Mapping[str, torch.Tensor] | Callable[[dict[str, Any]], Mapping[str, torch.Tensor] | None]


class CheckpointManager:
    """Checkpoints in ``directory`` as ``ckpt-<step>/`` with a ``latest`` pointer.

    Only one process should call :meth:`save` for replicated state (the chief); every process may
    call :meth:`load_latest`.

    ``directory`` may be an fsspec URL (``s3://bucket/run``): the manager is then a
    :class:`~spread.checkpoint.remote.RemoteCheckpointManager` (the same interface, a commit protocol
    for storage without an atomic rename, the same manifest and checksums).
    """

    def __new__(cls, directory: str | Path, *, keep: int = 3) -> Any:
        if cls is CheckpointManager and is_url(directory):
            return RemoteCheckpointManager(str(directory), keep=keep)
        return super().__new__(cls)

    def __init__(self, directory: str | Path, *, keep: int = 3) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"Invalid value for argument `keep`. Expected a positive integer. Received: keep={keep!r}"
            )
        self.directory = Path(directory)
        self.keep = keep

    def location(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or will be) committed."""
        return self.directory / f"ckpt-{step:010d}"

    # -- writing -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        shards: Mapping[str, torch.Tensor] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> Path:
        """Write ``state`` as the checkpoint of ``step`` and point ``latest`` at it.

        Without ``shards`` only the caller writes (call it on the chief for replicated state). With
        ``shards`` (this rank's own tensors, e.g. an optimizer shard) the call is collective: every
        rank of the default process group must make it; every rank's shards go through
        ``torch.distributed.checkpoint`` into the same temporary directory, the chief adds ``state``
        (the replicated part, written once; other ranks' ``state`` is ignored) and commits.
        ``group``: the process group of those collectives (default: the default group); a save on a
        background thread passes a group of its own, so that its collectives never run concurrently
        with the training loop's on the same group (:mod:`spread.checkpoint.background`).
        """
        if shards is not None:
            return self._save_with_shards(step, state, shards, group)
        _check_finite(state, step)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temporaries()
        final = self.directory / f"ckpt-{step:010d}"
        tmp = self.directory / f".tmp-{final.name}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            write_file(state, tmp / STATE_FILE, shown_as=final / STATE_FILE)
            crash_point("after_shard_write")
            self._commit(step, tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._publish(final)
        return final

    def _save_with_shards(
        self,
        step: int,
        state: dict[str, Any],
        shards: Mapping[str, torch.Tensor],
        group: dist.ProcessGroup | None,
    ) -> Path:
        collectives = Collectives(group) if dist.is_initialized() else None
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
            save_shards(tmp, rank, shards, group)  # collective: each rank its file, the coordinator .metadata
            if rank == 0:
                write_file(state, tmp / STATE_FILE, shown_as=final / STATE_FILE)
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
            self._remove(final)
        tmp.rename(final)
        fsync_path(self.directory)

    def _publish(self, final: Path) -> None:
        crash_point("after_rename")
        replace_pointer(self.directory / POINTER, final.name)
        crash_point("after_pointer")
        self._prune(final)

    def remove_stale_temporaries(self) -> None:
        """Delete half-written checkpoints left by a crash (they never had their final name) and
        half-deleted ones (they no longer have it)."""
        for pattern in (".tmp-ckpt-*", f"{TRASH_PREFIX}ckpt-*"):
            for p in self.directory.glob(pattern):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, published: Path) -> None:
        """Keep the newest ``keep`` checkpoints, and always the one ``latest`` names."""
        for old in self.checkpoints()[: -self.keep]:
            if old != published:
                self._remove(old)

    def _remove(self, path: Path) -> None:
        """Delete a checkpoint: first renamed out of its name in one step (readers see it whole or
        not at all), then its files."""
        trash = self.directory / f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}"
        try:
            path.rename(trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

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
        shards_like: ShardsLike | None = None,
        step: int | None = None,
    ) -> tuple[int, dict] | None:
        """Return ``(step, state)`` of the newest valid checkpoint, or None when there is none.

        A corrupt or partial checkpoint is skipped with a warning naming the file and the reason; if
        checkpoints exist but none is valid, raises CheckpointCorruptError naming the directory. One
        that another process prunes or replaces while this one reads it is not corrupt: the listing is
        taken again and the new newest is read, without a warning.

        ``like``: the state this checkpoint will be loaded into (e.g. ``{"model": model.state_dict()}``);
        every tensor under its top-level keys must be in the checkpoint with the same shape and dtype,
        and nothing else may be there, or :class:`~spread.errors.CheckpointMismatchError` lists every
        difference (a mismatch is a configuration error, so there is no fallback to older ones).
        ``shards_like``: this rank's per-rank tensors to read back (see :meth:`save`); they are
        returned as ``state["shards"]``. No collectives: every rank may load on its own. A callable
        is given the checkpoint's replicated state and returns them (or None: nothing per rank),
        so a checkpoint says itself which per-rank tensors it holds; a corrupt shard still falls
        back to an older checkpoint.
        ``step``: only the checkpoint of that step (None when there is none).
        """
        corrupt: dict[str, tuple[int, int]] = {}  # name -> identity, of those warned about
        problems: list[str] = []
        lost_one = False  # the last pass lost the checkpoint it was reading
        for _ in range(_RELISTS):
            candidates = self._candidates(step)
            lost_one = False
            if not candidates:
                if self._pointer_target(step) is None:
                    break
                continue  # ``latest`` names one: the listing ran while it was renamed; list again
            found = self._newest_valid(candidates, corrupt, problems, map_location, like, shards_like)
            if found is _GONE:
                lost_one = True
                continue
            if found is None:
                break  # every candidate is corrupt
            assert isinstance(found, tuple)
            return found
        if lost_one:
            raise CheckpointCorruptError(
                str(self.directory),
                f"the checkpoint being read was pruned or replaced {_RELISTS} times in a row: "
                "is a writer saving faster than this process can read?",
            )
        if problems:
            raise CheckpointCorruptError(str(self.directory), "no valid checkpoint: " + "; ".join(problems))
        return None

    def _newest_valid(
        self,
        candidates: list[Path],
        corrupt: dict[str, tuple[int, int]],
        problems: list[str],
        map_location: str | torch.device | None,
        like: Mapping[str, Any] | None,
        shards_like: ShardsLike | None,
    ) -> tuple[int, dict] | object | None:
        """The first of ``candidates`` (last first) that loads; None when all are corrupt (each
        warned about once, and recorded in ``corrupt`` and ``problems``); ``_GONE`` as soon as one
        is pruned or replaced while it is read (a newer one exists: list again)."""
        for path in reversed(candidates):
            identity = _identity(path)
            if identity is None:
                return _GONE
            if corrupt.get(path.name) == identity:
                continue
            try:
                return self._read(path, map_location, like, shards_like)
            except (Exception, CheckpointException) as exc:
                if _identity(path) != identity:
                    return _GONE
                reason = _corruption(exc)
                if reason is None:
                    raise  # not a damaged checkpoint (e.g. a mismatch with ``like``): no fallback
            corrupt[path.name] = identity
            problems.append(f"{path.name}: {reason}")
            warnings.warn(
                f"checkpoint {path} is unusable ({reason}); falling back to an older one",
                RuntimeWarning,
                stacklevel=3,
            )
        return None

    def _candidates(self, step: int | None) -> list[Path]:
        """Checkpoints to try, the last one first: ``latest``'s target, then the others newest first."""
        candidates = self.checkpoints()
        if step is not None:
            candidates = [c for c in candidates if c.name == f"ckpt-{step:010d}"]
        named = self._pointer_target(step)
        if named is not None:
            if named in candidates:
                candidates.remove(named)
                candidates.append(named)
            elif named.is_dir():  # published after the listing was taken
                candidates.append(named)
        return candidates

    def _pointer_target(self, step: int | None) -> Path | None:
        """The checkpoint ``latest`` names (of ``step``, if given), or None."""
        try:
            name = (self.directory / POINTER).read_text().strip()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, UnicodeDecodeError):
            return None
        if not _NAME.match(name) or (step is not None and name != f"ckpt-{step:010d}"):
            return None
        return self.directory / name

    def _read(
        self,
        path: Path,
        map_location: str | torch.device | None,
        like: Mapping[str, Any] | None,
        shards_like: ShardsLike | None,
    ) -> tuple[int, dict]:
        manifest = verify(path)
        if f"ckpt-{int(manifest['step']):010d}" != path.name:
            raise ValueError(f"{path / MANIFEST} says step {manifest['step']}, the directory's name another")
        state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
        if like is not None:
            found = {k: state.get(k) for k in like}
            raise_if(tensor_mismatches(found, like), str(path), "given state")
        try:
            wanted = shards_like(state) if callable(shards_like) else shards_like
        except CheckpointMismatchError as exc:  # name the checkpoint that does not fit
            raise CheckpointMismatchError(str(path), exc.what, exc.problems) from None
        if wanted is not None:
            state[SHARDS_KEY] = self._load_shards(path, wanted, map_location)
        return int(manifest["step"]), state

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


def _identity(path: Path) -> tuple[int, int] | None:
    """Which directory ``path`` names now (device, inode), or None when nothing does."""
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def _corruption(exc: BaseException) -> str | None:
    """Why a checkpoint that failed to load is unusable, or None if ``exc`` is not about its bytes."""
    if isinstance(exc, CheckpointMismatchError):
        return None  # the checkpoint is fine; what it is loaded into differs
    if isinstance(exc, UnsafeMetadataError):
        return f"{exc} (refused: never unpickled unsafely)"
    if isinstance(exc, pickle.UnpicklingError):
        return f"{STATE_FILE} holds more than tensors and plain data (refused under weights_only=True)"
    if isinstance(exc, (ValueError, OSError, RuntimeError, EOFError)):
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def _is_finite(state: Any) -> bool:
    """Whether every floating-point tensor is finite; of a ``DTensor`` this rank's piece (the check
    is local: the caller combines the ranks' answers)."""
    leaves = (leaf.to_local() if isinstance(leaf, DTensor) else leaf for leaf in pytree.tree_leaves(state))
    return all(
        torch.isfinite(leaf).all()
        for leaf in leaves
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()
    )


def _check_finite(state: dict[str, Any], step: int) -> None:
    if not _is_finite(state):
        raise NonFiniteLossError(f"refusing to checkpoint step {step}: the state holds non-finite values")
