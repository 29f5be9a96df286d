"""A minimal rank for the launcher benchmark: join a gloo group, all-reduce 4 MiB once, leave.

Works under both launchers being compared. Under ``spread run`` (``SPREAD_LAUNCHER=1``) rank 0 hosts
the ``TCPStore`` on the listening socket the launcher handed it (``SPREAD_STORE_FD``) and the others
connect to ``MASTER_ADDR:MASTER_PORT``; under torchrun the default ``env://`` initialisation is used.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

_TIMEOUT = timedelta(seconds=60)


def _spread_store(rank: int, world_size: int) -> dist.Store | None:
    if os.environ.get("SPREAD_LAUNCHER") != "1":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fd = os.environ.get("SPREAD_STORE_FD")
    if rank == 0 and fd is not None:
        return dist.TCPStore(
            host, port, world_size, True, _TIMEOUT, wait_for_workers=False, master_listen_fd=int(fd)
        )
    return dist.TCPStore(host, port, world_size, False, _TIMEOUT)


def main() -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback for both launchers alike
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _spread_store(rank, world_size)
    if store is None:
        dist.init_process_group("gloo", timeout=_TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT)
    tensor = torch.ones(2**20)
    dist.all_reduce(tensor)
    if not torch.equal(tensor, torch.full_like(tensor, float(world_size))):
        raise SystemExit(f"rank {rank}: all_reduce gave a wrong result")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
