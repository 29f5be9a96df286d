"""Durable, all-or-nothing writes: a checkpoint is either complete under its final name or absent.

The project's one atomic writer: :func:`atomic_save` for a single file (``ModelCheckpoint``), and the
steps below for a checkpoint directory (:class:`~spread.checkpoint.CheckpointManager`).

Order of operations for a directory (each step survives a crash of the one after it):
write files into a temporary directory -> fsync each file -> write ``manifest.json`` with each
file's size and SHA-256 -> fsync it and the directory -> rename the directory to its final name ->
fsync the parent -> replace the ``latest`` pointer (temp file + ``os.replace``) -> fsync the parent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from spread import env

MANIFEST = "manifest.json"
CRASH_ENV = env.CHECKPOINT_CRASH_AT  # chaos tests: kill this process at a named point
CRASH_POINTS = ("after_shard_write", "after_manifest", "after_rename", "after_pointer")


def crash_point(name: str) -> None:
    """SIGKILL this process if ``SPREAD_CHECKPOINT_CRASH_AT`` names this point (fault injection)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory_if_possible(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename in it survives a power loss; a no-op where the platform or
    filesystem cannot open or fsync a directory (the rename is still atomic there)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(obj: Any, path: str | os.PathLike[str], write: Callable[[Any, IO[bytes]], None] | None = None) -> None:
    """Write ``obj`` to ``path`` so that ``path`` holds either its previous content or the whole new
    file, never a torn one: written to a hidden temporary file in the same directory, flushed and
    fsync'ed, renamed over ``path`` (``os.replace``), the directory fsync'ed.

    ``write(obj, file)`` serialises (default ``torch.save``). On failure the temporary file is
    removed and the exception propagates.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Hidden and suffixed so globs like "*.pt" never pick up a temporary file.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            (write or torch.save)(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory_if_possible(directory)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, metadata: dict) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    for name in files:
        fsync_path(directory / name)
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps({**metadata, "files": files}, indent=1, sort_keys=True))
    fsync_path(manifest)
    fsync_path(directory)


def verify(directory: Path) -> dict:
    """Return the manifest if every file is present with its recorded size and checksum.

    Raises ValueError naming the first problem (missing manifest, missing file, size or checksum).
    """
    manifest_path = directory / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{manifest_path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{manifest_path} is not valid JSON ({exc})") from None
    for name, entry in manifest.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            raise ValueError(f"{path} is missing")
        if path.stat().st_size != entry["size"]:
            raise ValueError(f"{path} has {path.stat().st_size} bytes, the manifest says {entry['size']}")
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"{path} does not match its checksum")
    return manifest


def replace_pointer(pointer: Path, target: str) -> None:
    tmp = pointer.with_name(f".{pointer.name}.tmp")
    with open(tmp, "w") as f:
        f.write(target)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    fsync_path(pointer.parent)
