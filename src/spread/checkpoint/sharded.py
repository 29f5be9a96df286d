"""Per-rank (sharded) state through ``torch.distributed.checkpoint``, read back without trusting pickles.

Replicated state (the model under data parallelism) is written once, by the chief, as ``state.pt``.
State that differs per rank (optimizer shards, a parameter server's or a pipeline stage's share)
goes through DCP: every rank writes its own ``__<rank>_0.distcp`` file in parallel and the
coordinator writes one ``.metadata`` index, all inside the checkpoint's temporary directory, so the
manifest, checksums, rename and ``latest`` pointer of :mod:`spread.checkpoint.atomic` cover them too.
Each rank's tensors are stored under ``rank<NNNNN>/<key>``; a rank's piece of a tensor split over the
ranks (a ``DTensor``, e.g. ``Shard(0)`` of a flat parameter) is stored under ``global/<key>`` with its
global offset, so that DCP reads, at any other world size, the ranges that overlap each rank's new piece
(resharding). A rank reads only those ranges, never the whole tensor (unless it holds it whole).

Trust boundary. DCP's stock ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load`` and
turns non-tensor entries back into objects with ``torch.load(weights_only=False)``: whoever can write
into the checkpoint directory could run code in every process that loads it. Checksums do not help
(an attacker rewrites the manifest too). So here:

* only tensors are saved through DCP (anything else is refused at save time);
* ``.metadata`` is unpickled by :class:`RestrictedUnpickler`, which resolves only DCP's own metadata
  classes, ``torch.Size``, dtypes, the layout helper and ``pathlib`` paths; anything else is refused
  before it is constructed;
* a metadata entry that is not a tensor (DCP's ``BytesStorageMetadata``, which would be loaded with
  ``weights_only=False``) and a storage path that is not a plain file name in the checkpoint
  directory are refused;
* tensor payloads are read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PosixPath, PurePosixPath

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.tensor import DTensor

from spread.checkpoint.compat import raise_if

METADATA_FILE = ".metadata"

_METADATA_CLASSES = {
    "Metadata",
    "MetadataIndex",
    "ChunkStorageMetadata",
    "TensorProperties",
    "TensorStorageMetadata",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in _METADATA_CLASSES
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
}


class UnsafeMetadataError(pickle.UnpicklingError):
    """The ``.metadata`` file names something other than DCP's plain metadata records."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: every global outside a short allow-list is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"{METADATA_FILE} refers to {module}.{name}, which is not DCP metadata")


def shard_key(rank: int, key: str) -> str:
    return f"rank{rank:05d}/{key}"


GLOBAL_PREFIX = "global/"


def _stored_key(rank: int, key: str, value: torch.Tensor) -> str:
    """Where a value is stored: a piece of a split tensor under its global name, else per rank."""
    return GLOBAL_PREFIX + key if isinstance(value, DTensor) else shard_key(rank, key)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled under :class:`RestrictedUnpickler` and checked."""

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        path = Path(self.path) / METADATA_FILE
        metadata = RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeMetadataError(f"{path} does not hold DCP metadata")
        for fqn, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
                raise UnsafeMetadataError(
                    f"{path}: entry {fqn!r} is not a tensor (refused: it would be unpickled)"
                )
        for info in (metadata.storage_data or {}).values():
            name = str(info.relative_path)
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise UnsafeMetadataError(f"{path}: storage path {name!r} is not a file in the checkpoint")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process whenever ``no_dist`` holds; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _check_tensors(shards: Mapping[str, object]) -> None:
    for key, value in shards.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"shard keys must be non-empty strings, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"shard {key!r} is a {type(value).__name__}; only tensors are saved per rank "
                f"(put other values in the replicated state)"
            )


def save_shards(
    directory: Path, rank: int, shards: Mapping[str, torch.Tensor], group: dist.ProcessGroup | None = None
) -> None:
    """Write this rank's tensors into ``directory`` with DCP; collective (over ``group``, default the
    default group) when a process group exists.
    A ``DTensor`` value is this rank's piece of a tensor split over the ranks: every rank must pass
    one under that key, and each writes only its own piece."""
    _check_tensors(shards)
    state = {_stored_key(rank, k, v): v.detach() for k, v in shards.items()}
    with _quiet_single_process():
        dcp.save(
            state,
            storage_writer=FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True),
            process_group=group,
            no_dist=not dist.is_initialized(),
        )


def load_shards(directory: Path, rank: int, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read this rank's tensors (shaped like ``like``) from ``directory``; no collectives needed.

    A ``DTensor`` in ``like`` asks for this rank's piece of a split tensor as its placement says now
    (the world size may differ from the save's: DCP reads the overlapping saved ranges); its local
    tensor is returned.

    Raises :class:`~spread.errors.CheckpointMismatchError` listing every missing, unexpected or
    differently shaped key, and :class:`UnsafeMetadataError` for metadata outside the trust boundary.
    """
    _check_tensors(like)
    reader = SafeFileSystemReader(str(directory))
    metadata = reader.read_metadata()
    # A plain tensor asked for under a split tensor's name reads it whole (a strategy that keeps
    # whole copies resuming from sharded state); otherwise plain tensors are this rank's own.
    stored = {
        k: GLOBAL_PREFIX + k if GLOBAL_PREFIX + k in metadata.state_dict_metadata else _stored_key(rank, k, v)
        for k, v in like.items()
    }
    prefix = shard_key(rank, "")
    saved = {
        fqn[len(prefix) :]: entry
        for fqn, entry in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix)
    }
    saved |= {  # split tensors: every rank reads its piece of each
        fqn[len(GLOBAL_PREFIX) :]: entry
        for fqn, entry in metadata.state_dict_metadata.items()
        if fqn.startswith(GLOBAL_PREFIX)
    }
    problems = [f"missing shard {k!r} for rank {rank}" for k in like if k not in saved]
    problems += [f"unexpected shard {k!r} for rank {rank}" for k in saved if k not in like]
    for key in like.keys() & saved.keys():
        entry, want = saved[key], like[key]
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            problems.append(f"shard {key!r} for rank {rank}: saved as bytes, expected a tensor")
            continue
        if tuple(entry.size) != tuple(want.shape) or entry.properties.dtype != want.dtype:
            problems.append(
                f"shard {key!r} for rank {rank}: saved {tuple(entry.size)} {entry.properties.dtype}, "
                f"expected {tuple(want.shape)} {want.dtype}"
            )
    raise_if(sorted(problems), str(directory), "per-rank state")
    state = {stored[k]: _empty_like(v) for k, v in like.items()}
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k: _local(state[stored[k]]) for k in like}


def _empty_like(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return DTensor.from_local(
            torch.empty_like(value.to_local()),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return torch.empty_like(value, device="cpu")


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value
