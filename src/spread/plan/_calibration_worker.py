"""One rank of the calibration job (``python -m spread.plan._calibration_worker``, under the launcher).

Times every all-reduce algorithm on fp32 buffers of the given sizes (allocated and touched once,
reused), and the reduce-scatter and all-gather ShardedStrategy runs (fitted as the ``"shard"``
link), times one push per size on the parameter servers' transport (rank 0 to a server on rank
1), then measures how much of the gradient exchange the real strategy hides behind backward:
an MLP step with the exchange (``t_sync``) and without it (``no_sync``: ``t_local``), and the bare
all-reduce of its gradients (``t_comm``); the overlap is the ``eta`` for which
:func:`spread.plan.costs.exposed_communication` explains ``t_sync - t_local``. Rank 0 writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
from torch import nn

from spread import env as spread_env
from spread.comm.algorithms import ALGORITHMS, make_algorithm
from spread.plan.costs import exposed_communication
from spread.ps.transports import DEFAULT_TRANSPORT
from spread.strategies import MultiWorkerMirroredStrategy

ROUNDS = 5  # of the overlap measurement


def _median_seconds(fn, reps: int, barrier) -> float:
    fn()
    times = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _overlap(strategy: MultiWorkerMirroredStrategy, reps: int) -> tuple[float, float]:
    """``(overlap, collective_in_step)``: the overlap that explains the exposed exchange of a real
    step, and, when even none explains it (the exchange inside the step takes longer than the bare
    all-reduce alone: memory traffic of the step, ranks arriving apart), by how much longer."""
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(
            nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )
    x, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    loss_fn = nn.CrossEntropyLoss()

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def forward() -> None:
        with torch.no_grad():
            model(x)

    barrier = strategy.collectives.barrier
    grads = torch.ones(sum(p.numel() for p in model.parameters()))
    # Rounds of the four timings in turn, medians over rounds: one block of each read the step's
    # excess over the bare all-reduce anywhere from 1.2x to 1.9x on the 2-core VM.
    rounds: list[tuple[float, float, float, float]] = []
    for _ in range(ROUNDS):
        t_sync = _median_seconds(forward_backward, reps, barrier)
        with strategy.no_sync():
            t_local = _median_seconds(forward_backward, reps, barrier)
        t_forward = _median_seconds(forward, reps, barrier)
        t_comm = _median_seconds(lambda: strategy.algorithm.all_reduce(grads), reps, barrier)
        rounds.append((t_sync, t_local, t_forward, t_comm))
    t_sync, t_local, t_forward, t_comm = (statistics.median(r[i] for r in rounds) for i in range(4))
    exposed = max(t_sync - t_local, 0.0)
    in_step = max(1.0, exposed / t_comm) if t_comm > 0 else 1.0
    backward = max(t_local - t_forward, 1e-9)
    buckets = [t_comm]  # the MLP's 4.2 MB of gradients fit in one 25 MB bucket
    lo, hi = 0.0, 1.0
    for _ in range(30):  # exposed() falls as eta grows: bisect for the measured exposure
        mid = (lo + hi) / 2
        if exposed_communication(backward, buckets, mid) > exposed:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3), round(in_step, 3)


def _shard_collective_samples(
    strategy: MultiWorkerMirroredStrategy, sizes: list[int], reps: int
) -> list[list[float]]:
    """Reduce-scatter and all-gather of whole buffers of ``sizes`` bytes, as ShardedStrategy runs
    them (torch.distributed's flat collectives through spread's ``Collectives``): one sample each."""
    collectives, n = strategy.collectives, strategy.num_replicas_in_sync
    samples = []
    for nbytes in sizes:
        whole = torch.ones(max(nbytes // 4 // n, 1) * n)
        part = torch.empty(whole.numel() // n)
        reps_here = reps if nbytes < 16 << 20 else max(3, reps // 2)
        for op in (
            lambda w=whole, p=part: collectives.reduce_scatter(p, w, name="calibration.reduce_scatter"),
            lambda w=whole, p=part: collectives.all_gather_into(w, p, name="calibration.all_gather"),
        ):
            seconds = _median_seconds(op, reps_here, collectives.barrier)
            samples.append([float(whole.numel() * 4), seconds, float(n)])
    return samples


def _local_address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (loopback when ``host`` is local)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # UDP: no packet is sent, the kernel just picks the route
        return probe.getsockname()[0]


def _ps_transport_samples(
    strategy: MultiWorkerMirroredStrategy, sizes: list[int], reps: int
) -> list[list[float]]:
    """Rank 1 serves a push method on the parameter servers' transport; rank 0 times pushes."""
    from spread.ps.transports import get_transport

    rpc = get_transport(os.environ.get(spread_env.PS_TRANSPORT, DEFAULT_TRANSPORT))
    token = os.environ.get(spread_env.JOB_TOKEN, "calibration")
    port = torch.zeros(1, dtype=torch.int64)
    server = None
    if strategy.rank == 1:
        host = _local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        server = rpc.server("calibration server", {"push": lambda meta, tensors: ({}, {})}, token=token,
                               address=f"{host}:0").start()  # fmt: skip
        port[0] = int(server.address.rsplit(":", 1)[1])
    strategy.collectives.broadcast(port, src=1, name="calibration.port")
    peer_host = _peer_host(strategy)  # collective: every rank takes part
    samples: list[list[float]] = []
    try:
        if strategy.rank == 0:
            client = rpc.client(f"{peer_host}:{int(port[0])}", peer="calibration server", token=token)
            try:
                for nbytes in sizes:
                    payload = {"x": torch.ones(max(nbytes // 4, 1))}
                    seconds = _median_seconds(
                        lambda p=payload: client.call("push", {}, p), reps, lambda: None
                    )
                    samples.append([float(nbytes), seconds, 2.0])
            finally:
                client.close()
        strategy.collectives.barrier(name="calibration.ps_done")
    finally:
        if server is not None:
            server.stop()
    return samples


def _peer_host(strategy: MultiWorkerMirroredStrategy) -> str:
    """Rank 1's address as rank 0 reaches it: exchanged as four bytes over the process group."""
    address = torch.zeros(4, dtype=torch.int64)
    if strategy.rank == 1:
        host = _local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        address.copy_(torch.tensor([int(part) for part in host.split(".")]))
    strategy.collectives.broadcast(address, src=1, name="calibration.peer")
    return ".".join(str(int(v)) for v in address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    strategy = MultiWorkerMirroredStrategy()
    try:
        n = strategy.num_replicas_in_sync
        barrier = strategy.collectives.barrier
        samples: dict[str, list[list[float]]] = {}
        for name in ALGORITHMS:
            try:
                algorithm = make_algorithm(name, strategy.collectives)
            except ValueError:  # e.g. shm across hosts
                continue
            try:
                for nbytes in (int(s) for s in args.sizes.split(",")):
                    buffer = torch.ones(nbytes // 4)
                    reps = args.reps if nbytes < 16 << 20 else max(3, args.reps // 2)
                    seconds = _median_seconds(lambda b=buffer, a=algorithm: a.all_reduce(b), reps, barrier)
                    samples.setdefault(name, []).append([float(nbytes), seconds, float(n)])
            finally:
                algorithm.close()
        sizes = [int(s) for s in args.sizes.split(",")]
        samples["shard"] = _shard_collective_samples(strategy, sizes, args.reps)
        overlap, in_step = _overlap(strategy, args.reps)
        ps_samples = _ps_transport_samples(strategy, sizes, args.reps) if n >= 2 else []
        if strategy.is_chief:
            tmp = f"{args.output}.tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "samples": samples,
                        "ps": ps_samples,
                        "overlap": overlap,
                        "collective_in_step": in_step,
                        "ranks": n,
                    },
                    f,
                )
            os.replace(tmp, args.output)
    finally:
        strategy.close()


if __name__ == "__main__":
    main()
