"""Which server holds which variable: dense variables whole, balanced by size; embedding tables by rows.

Like TF's ``ParameterServerStrategy`` with a ``MinSizePartitioner``: a table of ``B`` bytes is split
into ``min(num_servers, ceil(B / min_shard_bytes))`` contiguous row ranges, so small tables stay
whole and large ones spread over every server. Dense variables go, largest first, to the server
holding the fewest bytes so far (ties to the lowest index). Placement is a pure function of the
variables' names, shapes and dtypes, so every process computes the same answer without talking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_MIN_SHARD_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class VariableInfo:
    """What placement needs to know about one variable."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sparse: bool = False  # an embedding table: pulled and pushed by rows

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True, slots=True)
class Shard:
    """One piece of a variable on one server: rows ``[row_start, row_stop)`` (all rows if dense)."""

    key: str  # the server-side name: the variable's name, plus "/part<i>" for a row shard
    variable: str
    server: int
    row_start: int
    row_stop: int


@dataclass(frozen=True)
class Placement:
    """Every variable's shards, in row order."""

    shards: dict[str, tuple[Shard, ...]]
    num_servers: int

    def on_server(self, server: int) -> list[Shard]:
        return [s for shards in self.shards.values() for s in shards if s.server == server]

    def bytes_per_server(self, variables: list[VariableInfo]) -> list[int]:
        info = {v.name: v for v in variables}
        load = [0] * self.num_servers
        for name, shards in self.shards.items():
            v = info[name]
            row_bytes = v.nbytes // max(v.shape[0], 1) if v.shape else v.nbytes
            for s in shards:
                load[s.server] += (s.row_stop - s.row_start) * row_bytes if v.shape else v.nbytes
        return load

    def row_boundaries(self, variable: str) -> torch.Tensor:
        """The first row of each shard after the first (for ``torch.bucketize``)."""
        return torch.tensor([s.row_start for s in self.shards[variable][1:]], dtype=torch.int64)


def place(
    variables: list[VariableInfo], num_servers: int, *, min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
) -> Placement:
    """Assign every variable to servers (see the module docstring for the rule)."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers!r}")
    if min_shard_bytes < 1:
        raise ValueError(f"min_shard_bytes must be >= 1, got {min_shard_bytes!r}")
    load = [0] * num_servers
    shards: dict[str, tuple[Shard, ...]] = {}
    for v in (v for v in variables if v.sparse):
        rows = v.shape[0]
        parts = max(1, min(num_servers, rows, math.ceil(v.nbytes / min_shard_bytes)))
        bounds = [rows * i // parts for i in range(parts + 1)]
        row_bytes = v.nbytes // max(rows, 1)
        # Start on the least-loaded server so that several tables do not all begin on server 0.
        first = min(range(num_servers), key=lambda s: (load[s], s))
        pieces = []
        for i in range(parts):
            server = (first + i) % num_servers
            key = v.name if parts == 1 else f"{v.name}/part{i}"
            pieces.append(Shard(key, v.name, server, bounds[i], bounds[i + 1]))
            load[server] += (bounds[i + 1] - bounds[i]) * row_bytes
        shards[v.name] = tuple(pieces)
    for v in sorted((v for v in variables if not v.sparse), key=lambda v: (-v.nbytes, v.name)):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        rows = v.shape[0] if v.shape else 1
        shards[v.name] = (Shard(v.name, v.name, server, 0, rows),)
        load[server] += v.nbytes
    ordered = {v.name: shards[v.name] for v in variables}
    return Placement(ordered, num_servers)
