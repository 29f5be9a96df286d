"""A minimal rank for the launcher benchmark: join through spread's rendezvous, all-reduce 4 MiB, leave.

The same script runs under both launchers being compared: under ``spread run`` rank 0 hosts the
store on the socket the launcher handed it; under torchrun every rank connects to the agent's store
(with spread's per-attempt prefix). Rendezvous includes the job-token handshake and arrival check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous


def main() -> None:
    rdzv = rendezvous(resolve_cluster(), init_timeout=60, collective_timeout=60)
    tensor = torch.ones(2**20)
    dist.all_reduce(tensor)
    if not torch.equal(tensor, torch.full_like(tensor, float(rdzv.world_size))):
        raise SystemExit(f"rank {rdzv.rank}: all_reduce gave a wrong result")
    rdzv.close()


if __name__ == "__main__":
    main()
