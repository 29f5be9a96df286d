"""A model over a per-process memory limit: ShardedStrategy(shard="parameters") trains it,
MultiWorkerMirroredStrategy cannot; and each configuration's peak resident memory, FSDP2's too.

    python benchmarks/sharded_memory_limit.py [--nprocs 4 --limit-mb 1600]

The model: 6 x Linear(4096, 4096) + ReLU (100.7 M parameters, 403 MB in float32), Adam, 2 steps on
a batch of 4 per rank, 1 thread per process. The limit is ``RLIMIT_DATA`` (``resource.setrlimit``;
on Linux it bounds private anonymous mappings, where the CPU allocator's tensors live), set by each
rank to its own usage after joining the job plus ``--limit-mb``; ``--limit-mb 0`` sets none and
measures peak resident memory above that point (``VmHWM``) instead.
"""

from __future__ import annotations

import argparse
import resource

import torch
import torch.distributed as dist
from torch import nn

import spread
from spread.testing import launch_ranks

WIDTH, LAYERS = 4096, 6


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])


def _job(kind: str, limit_bytes: int) -> int:
    torch.set_num_threads(1)
    strategy: spread.Strategy = (
        spread.ShardedStrategy("parameters", units=(nn.Linear,))
        if kind == "sharded"
        else spread.MultiWorkerMirroredStrategy()  # also the process group FSDP2 runs on
    )
    try:
        start = _status("VmHWM")
        if limit_bytes:
            resource.setrlimit(
                resource.RLIMIT_DATA, (_status("VmData") + limit_bytes, resource.RLIM_INFINITY)
            )
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = _model()
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        else:
            with strategy.scope():
                model = _model()
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randn(4, WIDTH)
        for _ in range(2):
            optimizer.zero_grad()
            if kind == "fsdp2":
                model(x).pow(2).mean().backward()
            else:
                strategy.run(lambda: model(x).pow(2).mean().backward())
            optimizer.step()
        return _status("VmHWM") - start
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--limit-mb", type=int, default=1600)
    args = parser.parse_args()
    limit = args.limit_mb * 2**20
    print(
        f"{args.nprocs} processes, 100.7 M parameters + Adam, RLIMIT_DATA: "
        + (f"+{args.limit_mb} MB" if limit else "none")
    )
    for kind in ("sharded", "mirrored", "fsdp2"):
        results = launch_ranks(
            _job, args.nprocs, args=(kind, limit), timeout=300, env={"OMP_NUM_THREADS": "1"}
        )
        if all(r.ok for r in results):
            peaks = ", ".join(f"{r.value / 2**20:,.0f}" for r in results)
            print(f"  {kind:9} trained; peak resident memory above the start, MB per rank: {peaks}")
        else:
            failed = next(r for r in results if not r.ok)
            print(f"  {kind:9} failed: {failed.describe().splitlines()[0][:220]}")


if __name__ == "__main__":
    main()
