"""One rank of the calibration job (``python -m spread.plan._calibration_worker``, under the launcher).

Times every all-reduce algorithm on fp32 buffers of the given sizes (allocated and touched once,
reused), and the reduce-scatter and all-gather ShardedStrategy runs (fitted as the ``"shard"``
link), times one push per size on the parameter servers' transport (rank 0 to a server on rank
1), then measures how much of the gradient exchange the real strategy hides behind backward:
an MLP step with the exchange (``t_sync``) and without it (``no_sync``: ``t_local``), and the bare
all-reduce of its gradients (``t_comm``), and a local step followed by an all-reduce of one float
(what the ranks lose meeting, ``sync_wait``); the overlap is the ``eta`` for which
:func:`spread.plan.costs.exposed_communication` explains ``t_sync - t_local - sync_wait``; last, how long a
message takes to wake a waiting peer while every core is busy (``busy_handoff``), and what a unit
of ShardedStrategy at ``"parameters"`` adds to a step beyond its bytes (``shard_unit_seconds``).
Rank 0 writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from spread import env as spread_env
from spread._device import wait_for_device
from spread.comm.algorithms import ALGORITHMS, make_algorithm
from spread.plan._forked import busy_processes
from spread.plan.costs import exposed_communication
from spread.ps.transports import DEFAULT_TRANSPORT
from spread.strategies import MultiWorkerMirroredStrategy
from spread.strategies.sharded_block import ParameterBlock

ROUNDS = 5  # of the overlap measurement


def _timed(fn, barrier) -> float:
    """Seconds of one ``fn()`` started together on every rank."""
    barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median_seconds(fn, reps: int, barrier) -> float:
    fn()
    return statistics.median(_timed(fn, barrier) for _ in range(reps))


def _overlap(strategy: MultiWorkerMirroredStrategy, reps: int) -> tuple[float, float, float]:
    """``(overlap, collective_in_step, sync_wait)`` of a real step's gradient exchange.

    ``sync_wait``: what a step loses where the ranks meet, whatever the bytes (ranks finishing their
    backward apart, each woken when the last arrives): a local step followed by the all-reduce of
    one float, less that all-reduce alone. The rest of the exchange's cost is bytes: ``overlap`` is
    the share hidden behind backward that explains it, and ``collective_in_step`` how much longer
    it takes than the bare all-reduce when even none is hidden (memory traffic of the step)."""
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

    token = torch.ones(1)

    def local_step_then_meet() -> None:
        with strategy.no_sync():
            forward_backward()
        strategy.algorithm.all_reduce(token)

    barrier = strategy.collectives.barrier
    grads = torch.ones(sum(p.numel() for p in model.parameters()))

    # Each timing is paired with its neighbours, many times: the step's excess over the bare
    # all-reduce is a difference of two noisy timings (medians of whole blocks read it anywhere
    # from 1.4x to 3.7x in five calibrations minutes apart on the 2-core VM; see
    # docs/results/2026-11-26-planner-handoffs.md).
    forward_backward()
    excess, waits, locals_, comms = [], [], [], []
    for _ in range(ROUNDS * reps):
        t_sync = _timed(forward_backward, barrier)
        with strategy.no_sync():
            t_local = _timed(forward_backward, barrier)
        t_meet = _timed(local_step_then_meet, barrier)
        t_token = _timed(lambda: strategy.algorithm.all_reduce(token), barrier)
        t_comm = _timed(lambda: strategy.algorithm.all_reduce(grads), barrier)
        excess.append(max(t_sync - t_local, 0.0))
        waits.append(max(t_meet - t_local - t_token, 0.0))
        locals_.append(t_local)
        comms.append(t_comm)
    t_forward = _median_seconds(forward, reps, barrier)
    sync_wait = statistics.median(waits)
    in_step = max(
        1.0, statistics.median(max(e - sync_wait, 0.0) / c for e, c in zip(excess, comms, strict=True))
    )
    exposed = max(statistics.median(excess) - sync_wait, 0.0)
    t_local, t_comm = statistics.median(locals_), statistics.median(comms)
    backward = max(t_local - t_forward, 1e-9)
    buckets = [t_comm]  # the MLP's 4.2 MB of gradients fit in one 25 MB bucket
    lo, hi = 0.0, 1.0
    for _ in range(30):  # exposed() falls as eta grows: bisect for the measured exposure
        mid = (lo + hi) / 2
        if exposed_communication(backward, buckets, mid) > exposed:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3), round(in_step, 3), sync_wait


SHARD_UNITS = 8  # of the shard_unit_seconds measurement


def _shard_unit_seconds(strategy: MultiWorkerMirroredStrategy, reps: int) -> float:
    """Seconds one unit of ShardedStrategy(shard="parameters") adds to a step, beyond its bytes.

    Each unit is gathered before its forward and again before its backward (the next one
    prefetched) and its gradients reduced as backward leaves it: three collectives on freshly
    allocated, packed buffers, each a meeting of the ranks between stretches of compute. Timed with
    the strategy's own :class:`ParameterBlock` on 64 KB units (the bytes' share is small) against
    the same compute alone, paired, many times; the median excess per unit. On the 2-core VM
    2.2-2.4 ms, where the link's latency says 0.75 (a ResNet's 8 units: 22 ms a step at 2 processes).
    """
    device = strategy.device
    params = [nn.Parameter(torch.randn(128, 128, device=device)) for _ in range(SHARD_UNITS)]
    blocks = [ParameterBlock([p], strategy.collectives, "parameters") for p in params]
    for block in blocks:
        block.release()
    work = torch.randn(192, 192, device=device)

    def compute() -> None:
        for _ in range(4):
            work @ work

    def compute_alone() -> None:
        for _ in range(3 * SHARD_UNITS):
            compute()
        wait_for_device()

    def sharded_step() -> None:
        for i, block in enumerate(blocks):  # forward
            block.gather()
            if i + 1 < len(blocks):
                blocks[i + 1].start_gather()
            compute()
            block.release()
        for i in reversed(range(len(blocks))):  # backward, twice forward's compute
            block = blocks[i]
            block.gather()
            if i > 0:
                blocks[i - 1].start_gather()
            compute()
            compute()
            block.params[0].grad = torch.ones_like(block.full[0])
            block.start_reduce(1.0)
            block.release()
        for block in blocks:
            block.finish_reduce()
        wait_for_device()

    barrier = strategy.collectives.barrier
    compute_alone()
    sharded_step()
    excess = [_timed(sharded_step, barrier) - _timed(compute_alone, barrier) for _ in range(max(5, 2 * reps))]
    return max(statistics.median(excess), 0.0) / SHARD_UNITS


def _busy_handoff(strategy: MultiWorkerMirroredStrategy, reps: int) -> float:
    """One-way seconds for a small message to wake a peer that waits for it while every core is busy.

    A pipeline stage computes, then waits for its neighbour; with more busy processes than cores it
    is woken only when the scheduler gives it a core back. On the 2-core VM a 256 KB ping-pong
    between two computing processes took 0.3 ms per round trip alone and 3.4-7.1 ms with two more
    processes computing (docs/results/2026-11-26-planner-handoffs.md). Ranks 0 and 1 ping-pong,
    computing between hops as stages do, while forked children keep every core busy. Rank 0's
    median round trip over two; 0 on other ranks and where no load can be forked.
    """
    rank, n = strategy.collectives.rank, strategy.num_replicas_in_sync
    per_rank = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    message, work = torch.ones(1024), torch.ones(256, 256)
    trips: list[float] = []
    with busy_processes(per_rank) as started:
        strategy.collectives.barrier(name="calibration.handoff")
        if started and rank < 2 <= n:
            for _ in range(max(reps, 5) * 4 + 1):
                begin = time.perf_counter()
                if rank == 0:
                    dist.send(message, 1)
                    dist.recv(message, 1)
                else:
                    dist.recv(message, 0)
                    dist.send(message, 0)
                trips.append(time.perf_counter() - begin)
                for _ in range(8):  # a stage's compute between hops: a few ms
                    work @ work
        strategy.collectives.barrier(name="calibration.handoff")
    return statistics.median(trips[1:]) / 2 if rank == 0 and len(trips) > 1 else 0.0


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
        overlap, in_step, sync_wait = _overlap(strategy, args.reps)
        handoff = _busy_handoff(strategy, args.reps)
        shard_unit = _shard_unit_seconds(strategy, args.reps) if n >= 2 else 0.0
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
                        "sync_wait": sync_wait,
                        "busy_handoff": handoff,
                        "shard_unit_seconds": shard_unit,
                        "ranks": n,
                    },
                    f,
                )
            os.replace(tmp, args.output)
    finally:
        strategy.close()


if __name__ == "__main__":
    main()
