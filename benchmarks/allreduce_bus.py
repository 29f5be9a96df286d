"""All-reduce microbenchmark: bus bandwidth of each algorithm vs gloo's own, 2 local processes.

Bus bandwidth = 2(N-1)/N * bytes / time (the nccl-tests convention: what each rank's link carries
in a bandwidth-optimal all-reduce). fp32 buffers allocated once per size with each algorithm's own
``allocate`` (``shm``: in shared memory, as the gradient buckets are) and reused by every repetition;
the ``shm staged`` column passes plain buffers to ``shm`` (copied in and out). Ranks meet at a
barrier before each timing of ``k`` back-to-back calls (``k`` = 4 MB / size, 1 to 50, so the skew
of the barrier's exit is amortised), algorithms interleaved per repetition; the median of rank 0's
per-call times.

    python benchmarks/allreduce_bus.py [--nprocs 2] [--reps 7] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from spread.cluster import resolve_cluster
from spread.cluster.rendezvous import rendezvous
from spread.comm import Collectives
from spread.comm.algorithms import ALGORITHMS, make_algorithm
from spread.testing import run_ranks

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 256 << 10, 4 << 20]
STAGED = "shm staged"


def _bench(sizes: list[int], reps: int) -> dict:
    """Rank body: median seconds per call, keyed ``(algorithm, nbytes)``."""
    torch.set_num_threads(1)
    rdv = rendezvous(resolve_cluster())
    try:
        collectives = Collectives()
        algos = {name: make_algorithm(name, collectives) for name in ALGORITHMS}
        out = {}
        try:
            for nbytes in sizes:
                plain = torch.ones(nbytes // 4)
                cases = [*algos.items(), (STAGED, algos["shm"])]
                bufs = {
                    name: plain if name == STAGED else algo.allocate(nbytes // 4, torch.float32)
                    for name, algo in cases
                }
                inner = max(1, min(50, (4 << 20) // nbytes))  # calls per timing: amortise the barrier skew
                times: dict[str, list[float]] = {name: [] for name, _ in cases}
                for name, algo in cases:
                    bufs[name].fill_(1.0)
                    algo.all_reduce(bufs[name])  # warm-up (connections, scratch buffers, page faults)
                for _ in range(reps):  # algorithms interleaved, so drift hits them alike
                    for name, algo in cases:
                        collectives.barrier()
                        start = time.perf_counter()
                        for _ in range(inner):
                            algo.all_reduce(bufs[name])
                        times[name].append((time.perf_counter() - start) / inner)
                for name, ts in times.items():
                    out[(name, nbytes)] = statistics.median(ts)
        finally:
            for algo in algos.values():
                algo.close()
        return out
    finally:
        rdv.close()


def measure(nprocs: int = 2, sizes: list[int] | None = None, reps: int = 7, timeout: float = 600) -> dict:
    """``{"nprocs", "sizes", "seconds": {algorithm: {nbytes: median seconds per call}}}``."""
    sizes = list(sizes or SIZES)
    times = run_ranks(_bench, nprocs, args=(sizes, reps), timeout=timeout)[0]
    names = [*ALGORITHMS, STAGED]
    return {
        "nprocs": nprocs,
        "sizes": sizes,
        "seconds": {name: {str(n): times[(name, n)] for n in sizes} for name in names},
    }


def bus_bandwidth(nbytes: int, seconds: float, nprocs: int) -> float:
    """Bytes/s each rank's link would carry in a bandwidth-optimal all-reduce taking ``seconds``."""
    return 2 * (nprocs - 1) / nprocs * nbytes / seconds


def size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def table(result: dict) -> str:
    """Markdown: one row per size, GB/s (ratio to native, ms per call) per algorithm."""
    n, names = result["nprocs"], list(result["seconds"])
    lines = ["| size | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
    for nbytes in result["sizes"]:
        cells = []
        native = result["seconds"]["native"][str(nbytes)]
        for name in names:
            t = result["seconds"][name][str(nbytes)]
            cells.append(f"{bus_bandwidth(nbytes, t, n) / 1e9:.2f} ({native / t:.1f}x, {t * 1e3:.2f} ms)")
        lines.append(f"| {size_label(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--quick", action="store_true", help=f"sizes {[size_label(s) for s in QUICK_SIZES]}, 3 reps"
    )
    parser.add_argument("--json", default=None, help="also write the raw medians here")
    args = parser.parse_args()
    result = measure(args.nprocs, QUICK_SIZES if args.quick else SIZES, 3 if args.quick else args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    print(f"bus bandwidth GB/s (ratio to native, ms per call), {args.nprocs} processes, fp32, median")
    print(table(result))


if __name__ == "__main__":
    main()
