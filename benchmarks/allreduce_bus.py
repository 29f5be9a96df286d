"""All-reduce microbenchmark: bus bandwidth of each algorithm vs gloo's own, 2 local processes.

Bus bandwidth = 2(N-1)/N * bytes / time (the nccl-tests convention: what each rank's link carries
in a bandwidth-optimal all-reduce). fp32 buffers allocated once per size with each algorithm's own
``allocate`` (``shm``: in shared memory, as the gradient buckets are) and reused by every repetition;
the ``shm staged`` column passes plain buffers to ``shm`` (copied in and out). Ranks meet at a
barrier before each timed call; the median of rank 0's times.

    python benchmarks/allreduce_bus.py [--nprocs 2] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous
from spread.comm import Collectives
from spread.comm.algorithms import ALGORITHMS, make_algorithm
from spread.testing import run_ranks

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _bench(reps: int) -> dict:
    torch.set_num_threads(1)
    rdv = rendezvous(resolve_cluster())
    try:
        collectives = Collectives()
        algos = {name: make_algorithm(name, collectives) for name in ALGORITHMS}
        out = {}
        try:
            for nbytes in SIZES:
                plain = torch.ones(nbytes // 4)
                for name, algo in [*algos.items(), ("shm staged", algos["shm"])]:
                    buf = plain if name == "shm staged" else algo.allocate(nbytes // 4, torch.float32)
                    buf.fill_(1.0)
                    algo.all_reduce(buf)  # warm-up (connections, scratch buffers)
                    times = []
                    for _ in range(reps if nbytes < 16 << 20 else max(3, reps // 2)):
                        collectives.barrier()
                        start = time.perf_counter()
                        algo.all_reduce(buf)
                        times.append(time.perf_counter() - start)
                    out[(name, nbytes)] = statistics.median(times)
        finally:
            for algo in algos.values():
                algo.close()
        return out
    finally:
        rdv.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    times = run_ranks(_bench, args.nprocs, args=(args.reps,), timeout=600)[0]
    n = args.nprocs
    names = [*ALGORITHMS, "shm staged"]
    print(f"bus bandwidth GB/s (ratio to native), {n} processes, fp32, median time")
    print("| size | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for nbytes in SIZES:
        cells = []
        for name in names:
            t = times[(name, nbytes)]
            bw = 2 * (n - 1) / n * nbytes / t / 1e9
            ratio = times[("native", nbytes)] / t
            cells.append(f"{bw:.2f} ({ratio:.1f}x, {t * 1e3:.2f} ms)")
        label = f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
