"""Checkpoints in object storage (``s3://bucket/run``, any fsspec URL): complete or invisible, verified.

Why another commit protocol: an object store has no directory rename, so the local one (write a
temporary directory, rename it, replace ``latest``) has no atomic step to hinge on. What it does have
is an atomic single-object PUT (an object is visible whole or not at all, multipart uploads included).
So here:

1. every object of a checkpoint goes under a prefix of its own, ``ckpt-<step>.<random>/``: a retry of
   the same step after a crash never overwrites, or mixes with, an earlier attempt's objects;
2. ``state.pt`` first, then ``manifest.json`` (every object's size and SHA-256), then
   ``manifest.sha256`` (the manifest's own checksum): the same files and checks as a local checkpoint
   (:mod:`spread.checkpoint.atomic`);
3. the ``latest`` object (the prefix's name) is the commit point: one PUT;
4. only then older checkpoints beyond ``keep``, and prefixes that were never committed (a crashed
   writer's), are deleted.

Readers trust only a checkpoint whose manifest matches its checksum and whose every object has the
recorded size and checksum (a prefix without them is ignored); ``latest`` is tried first, then the
others newest first, so a corrupt newest checkpoint falls back to the previous one with a warning, as
locally. A crash (SIGKILL) at any point before the ``latest`` PUT leaves the previous checkpoint as
``latest``; the same crash points as locally are honoured (``SPREAD_CHECKPOINT_CRASH_AT``).

Credentials and the endpoint come from fsspec's usual configuration (for S3: the AWS environment and
config files; ``FSSPEC_S3_ENDPOINT_URL`` for an S3-compatible server). Per-rank pieces (DCP shards,
ShardedStrategy) are not written to object storage yet: refused by name, before anything is written.
fsspec and the filesystem's package (``s3fs``: ``pip install spread[s3]``) are imported only here.
"""

from __future__ import annotations

import hashlib
import io
import re
import secrets
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from spread.checkpoint.atomic import (
    MANIFEST,
    MANIFEST_CHECKSUM,
    check_listed_file,
    checksum_line,
    crash_point,
    manifest_bytes,
    parse_manifest,
)
from spread.checkpoint.compat import raise_if, tensor_mismatches
from spread.errors import CheckpointCorruptError, CheckpointMismatchError

STATE_FILE = "state.pt"
POINTER = "latest"
_PREFIX = re.compile(r"^ckpt-(\d{10})\.([0-9a-f]{8})$")
_LOCAL_PROTOCOLS = ("file", "local")


def is_url(path: object) -> bool:
    """Whether ``path`` names remote storage (``scheme://...`` other than ``file://``)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0].lower() not in _LOCAL_PROTOCOLS


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it; a clear error naming the package to
    install when the protocol's is missing."""
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency of torch
        raise ImportError(f"checkpoints at {url} need fsspec: pip install fsspec") from exc
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise ImportError(
            f"checkpoints at {url} need the filesystem package for its protocol ({exc}); for s3:// "
            "pip install 'spread[s3]' (s3fs)"
        ) from exc
    return fs, root.rstrip("/")


def put_atomically(data: bytes, url: str) -> None:
    """Write one object whole (a single PUT: visible complete or not at all): ``atomic_save`` for a URL."""
    fs, path = filesystem(url)
    fs.pipe_file(path, data)


def remove_all(url: str) -> None:
    """Delete everything under ``url`` (a finished job's backups); nothing there is no error."""
    fs, root = filesystem(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)


class RemoteCheckpointManager:
    """:class:`~spread.checkpoint.CheckpointManager` for an fsspec URL, with the commit protocol of
    the module docstring. Only one process should call :meth:`save` (the chief)."""

    def __init__(self, url: str, *, keep: int = 3) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"Invalid value for argument `keep`. Expected a positive integer. Received: keep={keep!r}"
            )
        self.url = url.rstrip("/")
        self.directory = self.url  # what messages name
        self.keep = keep
        self.fs, self.root = filesystem(self.url)

    def location(self, step: int) -> str:
        """How a checkpoint of ``step`` is named in messages (its prefix adds a random suffix)."""
        return f"{self.url}/ckpt-{step:010d}"

    # -- writing -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: dict[str, Any],
        *,
        shards: Mapping[str, torch.Tensor] | None = None,
        group: object = None,
    ) -> str:
        """Write ``state`` as the checkpoint of ``step`` and make ``latest`` name it (the commit)."""
        if shards:
            raise ValueError(
                f"per-rank checkpoint pieces (ShardedStrategy's DCP shards) cannot be written to {self.url} "
                "yet: back up to a path on a shared filesystem, or use a strategy that holds whole "
                "copies (MultiWorkerMirroredStrategy)"
            )
        from spread.checkpoint.manager import _check_finite

        _check_finite(state, step)
        name = f"ckpt-{step:010d}.{secrets.token_hex(4)}"
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        prefix = f"{self.root}/{name}"
        self.fs.pipe_file(f"{prefix}/{STATE_FILE}", data)
        crash_point("after_shard_write")
        files = {STATE_FILE: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
        manifest = manifest_bytes({"step": step}, files, f"{prefix}/{MANIFEST}")
        self.fs.pipe_file(f"{prefix}/{MANIFEST}", manifest)
        self.fs.pipe_file(f"{prefix}/{MANIFEST_CHECKSUM}", checksum_line(manifest))
        crash_point("after_manifest")
        crash_point("after_rename")  # no rename in object storage: the same moment
        self.fs.pipe_file(f"{self.root}/{POINTER}", name.encode())  # the commit point
        crash_point("after_pointer")
        self._prune(name)
        return f"{self.url}/{name}"

    def _prune(self, published: str) -> None:
        """Keep the newest ``keep`` committed checkpoints and ``published``; delete the rest, and the
        prefixes of crashed writers (no manifest checksum: never complete)."""
        names = self._listing()
        complete = [n for n, done in names if done]
        keep = set(complete[-self.keep :]) | {published}
        step_published = int(_PREFIX.match(published).group(1))  # type: ignore[union-attr]
        for name, done in names:
            if name in keep:
                continue
            if done or int(_PREFIX.match(name).group(1)) <= step_published:  # type: ignore[union-attr]
                self.fs.rm(f"{self.root}/{name}", recursive=True)

    def remove_stale_temporaries(self) -> None:
        """Nothing to do before a save: a crashed writer's prefix is deleted after the next commit."""

    # -- reading -------------------------------------------------------------------------------------
    def _listing(self) -> list[tuple[str, bool]]:
        """Every checkpoint prefix (step order) and whether it holds a manifest checksum."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = sorted(
            (e.rstrip("/").rsplit("/", 1)[-1] for e in entries),
            key=lambda n: (int(m.group(1)), m.group(2)) if (m := _PREFIX.match(n)) else (-1, ""),
        )
        result = []
        for name in names:
            if _PREFIX.match(name):
                result.append((name, self.fs.exists(f"{self.root}/{name}/{MANIFEST_CHECKSUM}")))
        return result

    def checkpoints(self) -> list[str]:
        """Names of the complete-looking checkpoints, oldest first."""
        return [name for name, done in self._listing() if done]

    def _pointer(self) -> str | None:
        try:
            name = self.fs.cat_file(f"{self.root}/{POINTER}").decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return name if _PREFIX.match(name) else None

    def load_latest(
        self,
        map_location: str | torch.device | None = "cpu",
        *,
        like: Mapping[str, Any] | None = None,
        shards_like: Any = None,
        step: int | None = None,
    ) -> tuple[int, dict] | None:
        """As :meth:`CheckpointManager.load_latest`: the newest checkpoint that verifies (``latest``'s
        first), falling back past corrupt ones with a warning; None when there is none."""
        problems: list[str] = []
        pointer = self._pointer()
        candidates = self.checkpoints()
        if pointer is not None and pointer in candidates:
            candidates.remove(pointer)
            candidates.append(pointer)
        if step is not None:
            candidates = [c for c in candidates if c.startswith(f"ckpt-{step:010d}.")]
        for name in reversed(candidates):
            try:
                return self._read(name, map_location, like, shards_like)
            except CheckpointMismatchError:
                raise
            except FileNotFoundError:
                continue  # pruned while it was read: a newer one exists and was tried first
            except (ValueError, OSError, RuntimeError, EOFError) as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                problems.append(f"{name}: {reason}")
                warnings.warn(
                    f"checkpoint {self.url}/{name} is unusable ({reason}); falling back to an older one",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if problems:
            raise CheckpointCorruptError(self.url, "no valid checkpoint: " + "; ".join(problems))
        return None

    def _read(
        self,
        name: str,
        map_location: str | torch.device | None,
        like: Mapping[str, Any] | None,
        shards_like: Any,
    ) -> tuple[int, dict]:
        prefix = f"{self.root}/{name}"
        shown = f"{self.url}/{name}"
        data = self.fs.cat_file(f"{prefix}/{MANIFEST}")
        # the checksum is required here: object-storage checkpoints always had one
        recorded = self.fs.cat_file(f"{prefix}/{MANIFEST_CHECKSUM}")
        manifest = parse_manifest(data, recorded, f"{shown}/{MANIFEST}")
        files = manifest["files"]
        if f"ckpt-{int(manifest['step']):010d}" != name.split(".")[0]:
            raise ValueError(f"{shown}/{MANIFEST} says step {manifest['step']}, the prefix's name another")
        present = {e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(prefix, detail=False)} - {
            MANIFEST,
            MANIFEST_CHECKSUM,
        }
        unlisted = sorted(present - files.keys())
        if unlisted:
            raise ValueError(
                f"{shown}/{unlisted[0]} is not listed in {MANIFEST} (the manifest lost an entry)"
            )
        blobs = {}
        for file, entry in files.items():
            if file not in present:
                raise ValueError(f"{shown}/{file} is missing")
            blob = self.fs.cat_file(f"{prefix}/{file}")
            check_listed_file(f"{shown}/{file}", len(blob), hashlib.sha256(blob).hexdigest(), entry)
            blobs[file] = blob
        state = torch.load(io.BytesIO(blobs[STATE_FILE]), map_location=map_location, weights_only=True)
        if like is not None:
            raise_if(tensor_mismatches({k: state.get(k) for k in like}, like), shown, "given state")
        try:
            wanted = shards_like(state) if callable(shards_like) else shards_like
        except CheckpointMismatchError as exc:
            raise CheckpointMismatchError(shown, exc.what, exc.problems) from None
        if wanted:
            raise CheckpointMismatchError(
                shown, "per-rank state", ["the checkpoint holds no per-rank shards"]
            )
        return int(manifest["step"]), state
