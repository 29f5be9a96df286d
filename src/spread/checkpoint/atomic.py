"""Durable, all-or-nothing writes: a checkpoint is either complete under its final name or absent.

The project's one atomic writer: :func:`atomic_save` for a single file (``ModelCheckpoint``), and the
steps below for a checkpoint directory (:class:`~spread.checkpoint.CheckpointManager`).

Order of operations for a directory (each step survives a crash of the one after it):
write files into a temporary directory -> fsync each file -> write ``manifest.json`` with each
file's size and SHA-256 -> fsync it -> write ``manifest.sha256``, the SHA-256 of the manifest's own
bytes -> fsync it and the directory -> rename the directory to its final name -> fsync the parent ->
replace the ``latest`` pointer (temp file + ``os.replace``) -> fsync the parent.

:func:`verify` trusts nothing it reads: a manifest that does not match its ``manifest.sha256``, or
whose structure is not exactly what :func:`write_manifest` writes, or a file in the directory that
the manifest does not list, is corruption (ValueError), never a KeyError nor a silent skip. A
checkpoint written before ``manifest.sha256`` existed has none; it is still accepted once its
structure checks out, because refusing it would leave an upgraded job nothing to resume from. Every
file is still checked against its size and checksum there, so what goes unnoticed without the
sidecar is only a change that keeps the manifest well-formed and consistent, such as a digit of
``step``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import secrets
import signal
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from spread import env

MANIFEST = "manifest.json"
MANIFEST_CHECKSUM = "manifest.sha256"  # SHA-256 of the manifest's bytes: the manifest is verified too
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
    with contextlib.suppress(OSError):
        fsync_path(Path(directory))


def atomic_save(
    obj: Any, path: str | os.PathLike[str], write: Callable[[Any, IO[bytes]], object] | None = None
) -> None:
    """Write ``obj`` to ``path`` so that ``path`` holds either its previous content or the whole new
    file, never a torn one: written to a hidden temporary file in the same directory, flushed and
    fsync'ed, renamed over ``path`` (``os.replace``), the directory fsync'ed.

    ``write(obj, file)`` serialises (default ``torch.save``). On failure the temporary file is
    removed and the exception propagates.

    A URL (``s3://bucket/model.pt``, any fsspec protocol but ``file``) is serialised in memory and
    written as one object, which object stores make visible whole or not at all
    (:mod:`spread.checkpoint.remote`).
    """
    from spread.checkpoint.remote import is_url, put_atomically

    if is_url(path):
        buffer = io.BytesIO()
        (write or torch.save)(obj, buffer)
        put_atomically(buffer.getvalue(), os.fspath(path))
        return
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Hidden and suffixed so globs like "*.pt" never pick up a temporary file.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    try:
        write_file(obj, tmp, write, shown_as=path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory_if_possible(directory)


def write_file(
    obj: Any,
    path: str | os.PathLike[str],
    write: Callable[[Any, IO[bytes]], object] | None = None,
    *,
    shown_as: str | os.PathLike[str] | None = None,
) -> None:
    """Create ``path`` (it must not exist), write ``obj`` into it (``write(obj, file)``, default
    ``torch.save``), flush and fsync it. An operating-system error while writing (a full disk, a
    file-size limit) is raised as itself, naming ``shown_as`` (default ``path``): ``torch.save`` would
    report it as ``[enforce fail at inline_container.cc] ... unexpected pos``, hiding the cause, and a
    plain ``write`` names no file."""
    shown = os.fspath(shown_as or path)
    try:
        with open(path, "xb") as f:
            (write or torch.save)(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as exc:
        cause = _os_error_under(exc)
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror, shown) from exc
    except OSError as exc:
        if exc.errno is None or exc.filename == shown:
            raise
        raise type(exc)(exc.errno, exc.strerror, shown) from exc


def _os_error_under(exc: BaseException) -> OSError | None:
    """The operating-system error an exception was raised while handling, if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, metadata: dict) -> None:
    """Write ``manifest.json`` (``metadata`` and every file's size and SHA-256) and its checksum
    ``manifest.sha256``, each fsync'ed, then fsync ``directory``."""
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name not in (MANIFEST, MANIFEST_CHECKSUM)
    }
    for name in files:
        fsync_path(directory / name)
    data = manifest_bytes(metadata, files, directory / MANIFEST)
    manifest = directory / MANIFEST
    manifest.write_bytes(data)
    fsync_path(manifest)
    checksum = directory / MANIFEST_CHECKSUM
    checksum.write_bytes(_checksum_line(data))
    fsync_path(checksum)
    fsync_path(directory)


def manifest_bytes(metadata: dict, files: dict[str, dict[str, Any]], shown: str | os.PathLike[str]) -> bytes:
    """The bytes of a manifest listing ``files`` (name -> size and SHA-256) with ``metadata``; never
    one :func:`parse_manifest` would refuse. Written by local and object-storage checkpoints alike."""
    content = {**metadata, "files": files}
    _check_structure(content, Path(shown))
    return json.dumps(content, indent=1, sort_keys=True).encode()


def checksum_line(manifest: bytes) -> bytes:
    """What ``manifest.sha256`` holds for a manifest of these bytes."""
    return _checksum_line(manifest)


def parse_manifest(data: bytes, recorded_checksum: bytes | None, shown: str | os.PathLike[str]) -> dict:
    """The manifest in ``data`` if it matches ``recorded_checksum`` (None: a checkpoint from before the
    sidecar existed, vouched for by its structure alone), is JSON without repeated keys and has the
    structure :func:`manifest_bytes` writes; else ValueError naming ``shown``."""
    if recorded_checksum is not None and recorded_checksum != _checksum_line(data):
        raise ValueError(f"{shown} does not match its checksum in {MANIFEST_CHECKSUM}")
    try:
        manifest = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{shown} is not valid JSON ({exc})") from None
    _check_structure(manifest, Path(shown))
    return manifest


def check_listed_file(shown: str | os.PathLike[str], size: int, sha256: str, entry: dict[str, Any]) -> None:
    """ValueError naming ``shown`` unless a file's ``size`` and ``sha256`` are its manifest entry's."""
    if size != entry["size"]:
        raise ValueError(f"{shown} has {size} bytes, the manifest says {entry['size']}")
    if sha256 != entry["sha256"]:
        raise ValueError(f"{shown} does not match its checksum")


def verify(directory: Path) -> dict:
    """Return the manifest if it matches its checksum, is well-formed, lists every file in
    ``directory``, and every file has its recorded size and checksum.

    Raises ValueError naming the file and the first problem: a damaged manifest is corruption like
    a damaged file, so the caller falls back to an older checkpoint instead of crashing or loading
    unverified data.
    """
    manifest_path = directory / MANIFEST
    try:
        data = manifest_path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{manifest_path} is missing") from None
    try:
        recorded: bytes | None = (directory / MANIFEST_CHECKSUM).read_bytes()
    except FileNotFoundError:
        recorded = None
    manifest = parse_manifest(data, recorded, manifest_path)
    files = manifest["files"]
    present = {
        p.name for p in directory.iterdir() if p.is_file() and p.name not in (MANIFEST, MANIFEST_CHECKSUM)
    }
    for name in files:
        if name not in present:  # by name: nothing is looked up outside the directory
            raise ValueError(f"{directory / name} is missing")
    unlisted = sorted(present - files.keys())
    if unlisted:
        raise ValueError(
            f"{directory / unlisted[0]} is not listed in {manifest_path} (the manifest lost an entry)"
        )
    for name, entry in files.items():
        path = directory / name
        size = path.stat().st_size
        if size != entry["size"]:  # before hashing: a wrong size needs no read
            check_listed_file(path, size, "", entry)
        check_listed_file(path, size, sha256_file(path), entry)
    return manifest


def _checksum_line(manifest: bytes) -> bytes:
    return hashlib.sha256(manifest).hexdigest().encode() + b"\n"


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's ``object_pairs_hook``: a repeated key (which json would silently resolve to the last
    one) means the manifest was changed."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice")
        result[key] = value
    return result


def _check_structure(manifest: Any, manifest_path: Path | str) -> dict[str, dict[str, Any]]:
    """Return the manifest's ``files`` if the manifest has the structure :func:`write_manifest`
    writes; otherwise raise ValueError naming the problem (never KeyError or TypeError)."""

    def bad(problem: str) -> ValueError:
        return ValueError(f"{manifest_path} is malformed: {problem}")

    if not isinstance(manifest, dict):
        raise bad(f"expected a JSON object, found {_show(manifest)}")
    step = manifest.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # JSON true is no step
        raise bad(f'"step" is not a non-negative integer (found {_show(step)})')
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise bad(f'"files" is not a non-empty object (found {_show(files)})')
    for name, entry in files.items():
        if name in ("", ".", "..") or any(c in name for c in (os.sep, os.altsep or os.sep, "\0")):
            raise bad(f'"files" lists {_show(name)}, which is not a file name')
        if not isinstance(entry, dict):
            raise bad(f"the entry of {name!r} is not an object (found {_show(entry)})")
        size, digest = entry.get("size"), entry.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise bad(f'the entry of {name!r} has no valid "size" (found {_show(size)})')
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise bad(f'the entry of {name!r} has no valid "sha256" (found {_show(digest)})')
    return files


def _show(value: Any) -> str:
    """``repr`` of a value read from a damaged manifest, cut short (it may be the whole manifest)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def replace_pointer(pointer: Path, target: str) -> None:
    tmp = pointer.with_name(f".{pointer.name}.tmp")
    with open(tmp, "w") as f:
        f.write(target)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, pointer)
    fsync_path(pointer.parent)
