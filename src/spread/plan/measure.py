"""Measure this machine for the planner: compute, memory bandwidth, all-reduce links, overlap.

The all-reduce figures come from a real job: :func:`measure_machine` starts ``nprocs`` ranks of
:mod:`spread.plan._calibration_worker` with ``spread run``'s launcher (loopback, job token, process
groups killed on exit) and reads back the JSON rank 0 writes. Nothing is unpickled.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch

from spread.cluster.launcher import LaunchConfig, launch
from spread.plan.calibration import CalibrationError, CalibrationProfile, fit_link, save_profile
from spread.plan.costs import Link

FULL_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
QUICK_SIZES = [4 << 10, 256 << 10, 4 << 20]


def matmul_flops(threads: int | None = None, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` float32 matmul (2 n^3 flops) with all (or ``threads``) threads."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b, out = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        torch.mm(a, b, out=out)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            times.append(time.perf_counter() - start)
        return 2.0 * n**3 / statistics.median(times)
    finally:
        torch.set_num_threads(previous)


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Bytes/s moved (read + write) by ``copy_`` into a preallocated buffer, one thread."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2.0 * nbytes / statistics.median(times)


def measure_links(nprocs: int, sizes: list[int], reps: int) -> dict:
    """Run the all-reduce worker as ``nprocs`` local ranks; return its JSON result."""
    with tempfile.TemporaryDirectory(prefix="spread-calibrate-") as folder:
        output = os.path.join(folder, "links.json")
        config = LaunchConfig(
            entrypoint="spread.plan._calibration_worker",
            module=True,
            nproc=nprocs,
            args=("--output", output, "--reps", str(reps), "--sizes", ",".join(map(str, sizes))),
            prefix_output=True,
        )
        code = launch(config)
        if code != 0:
            raise CalibrationError(f"the all-reduce calibration job failed with exit code {code}")
        return json.loads(Path(output).read_text())


def measure_machine(path: str | os.PathLike, *, quick: bool = False, nprocs: int = 2) -> CalibrationProfile:
    """Measure this machine and save the profile at ``path`` (see :mod:`spread.plan.calibration`)."""
    cuda = torch.cuda.is_available()
    devices = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    memory = (
        torch.cuda.get_device_properties(0).total_memory if cuda else psutil.virtual_memory().total / devices
    )
    bandwidth = copy_bandwidth(16 << 20 if quick else 64 << 20)
    flops = matmul_flops(n=512 if quick else 1024)
    result = measure_links(nprocs, QUICK_SIZES if quick else FULL_SIZES, 3 if quick else 7)
    links = {name: fit_link(name, [tuple(s) for s in samples]) for name, samples in result["samples"].items()}
    if len(result.get("ps", [])) >= 2:
        links["ps"] = fit_link("ps", [tuple(s) for s in result["ps"]])
        result["samples"]["ps"] = result["ps"]
    links["memory"] = Link(alpha=1e-6, beta=bandwidth)
    profile = CalibrationProfile(
        machine=f"{platform.node()} {platform.machine()} {devices} {'GPU' if cuda else 'CPU core'}(s)",
        devices=devices,
        memory_per_device=float(memory),
        memory_bandwidth=bandwidth,
        matmul_flops=flops,
        links=links,
        overlap=float(result["overlap"]),
        collective_in_step=float(result.get("collective_in_step", 1.0)),
        device_type="cuda" if cuda else "cpu",
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        samples=result["samples"],
    )
    save_profile(profile, path)
    return profile
