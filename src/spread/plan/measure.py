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
from typing import NamedTuple

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


class LocalDevices(NamedTuple):
    cuda: bool
    devices: int
    memory_per_device: float  # bytes


def local_devices() -> LocalDevices:
    """This machine's devices: its GPUs where CUDA sees any (a script's default strategy trains
    there), else its CPU cores sharing the host's memory."""
    if torch.cuda.is_available():
        memory = float(torch.cuda.get_device_properties(0).total_memory)
        return LocalDevices(cuda=True, devices=torch.cuda.device_count(), memory_per_device=memory)
    cores = os.cpu_count() or 1
    return LocalDevices(cuda=False, devices=cores, memory_per_device=psutil.virtual_memory().total / cores)


def measure_machine(
    path: str | os.PathLike, *, quick: bool = False, nprocs: int = 2, rounds: int | None = None
) -> CalibrationProfile:
    """Measure this machine and save the profile at ``path`` (see :mod:`spread.plan.calibration`).

    The collectives job runs ``rounds`` times (default 3; 1 when ``quick``), one after another: the
    links are fitted to every round's samples together and the in-step factor, overlap and busy
    handoff are the medians over rounds. One job alone read the in-step factor 1.2 to 3.7 in
    calibrations minutes apart on the 2-core VM (docs/results/2026-11-26-planner-handoffs.md).
    """
    rounds = (1 if quick else 3) if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    cuda, devices, memory = local_devices()
    if cuda and devices < nprocs:
        raise CalibrationError(
            f"calibrating the links between GPUs runs {nprocs} processes, one per GPU (NCCL), but this "
            f"machine has {devices}; calibrate its CPUs instead (CUDA_VISIBLE_DEVICES= spread bench "
            f"--calibrate), or plan without a profile and describe the links (spread plan --link-gbps "
            f"--link-latency-us)"
        )
    bandwidth = copy_bandwidth(16 << 20 if quick else 64 << 20)
    flops = matmul_flops(n=512 if quick else 1024)
    jobs = [
        measure_links(nprocs, QUICK_SIZES if quick else FULL_SIZES, 3 if quick else 7) for _ in range(rounds)
    ]
    samples = {name: [s for job in jobs for s in job["samples"].get(name, [])] for name in jobs[0]["samples"]}
    links = {name: fit_link(name, [tuple(s) for s in taken]) for name, taken in samples.items()}
    pushes = [s for job in jobs for s in job.get("ps", [])]
    if len(pushes) >= 2:
        links["ps"] = fit_link("ps", [tuple(s) for s in pushes])
        samples["ps"] = pushes

    def median(field: str, default: float) -> float:
        return statistics.median(float(job.get(field, default)) for job in jobs)

    links["memory"] = Link(alpha=1e-6, beta=bandwidth)
    profile = CalibrationProfile(
        machine=f"{platform.node()} {platform.machine()} {devices} {'GPU' if cuda else 'CPU core'}(s)",
        devices=devices,
        memory_per_device=float(memory),
        memory_bandwidth=bandwidth,
        matmul_flops=flops,
        links=links,
        overlap=median("overlap", 0.5),
        collective_in_step=median("collective_in_step", 1.0),
        sync_wait=median("sync_wait", 0.0),
        busy_handoff=median("busy_handoff", 0.0),
        shard_unit_seconds=median("shard_unit_seconds", 0.0),
        device_type="cuda" if cuda else "cpu",
        measured_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        samples=samples,
    )
    save_profile(profile, path)
    return profile
