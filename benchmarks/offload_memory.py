"""Offload on a CPU machine: peak memory per rank and step time of ShardedStrategy(shard="parameters") with
offload="optimizer" and "parameters" (state, and parameter shards, in memory-mapped files) against
no offload, and FSDP2 with and without ``CPUOffloadPolicy``; and which of them train under a
per-process memory limit.

    python benchmarks/offload_memory.py [--nprocs 2 --layers 6 --width 4096 --steps 6]
        [--limit-mb 700] [--cgroup-mb 700] [--offload-dir DIR]

The model: ``layers`` x Linear(width, width) + ReLU (6 x 4096: 100.7 M parameters, 403 MB float32),
Adam (its state: 805 MB), batch 4 per rank, 1 thread per process; each Linear a unit (spread
``units=(nn.Linear,)``, FSDP2 ``fully_shard`` on each Linear, then the root). Each configuration is a
job of its own, one after another.

Memory, per rank, above the moment after building the model (so the parameter shards are in the
start): *anonymous* is the peak of ``RssAnon`` (``/proc/self/status``, sampled every millisecond by a
thread: a lower bound of the true peak), the memory no kernel can take back without swap; *resident*
is ``VmHWM`` (anonymous and file pages together: the mapped state's pages count while resident, and
the kernel evicts them, written back, when memory is short). *anon total*: the peak ``RssAnon``
itself (with the start: Python, torch, gloo, and the parameter shards where they are in memory).
glibc's mmap threshold is fixed at 64 KB (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the
resident set. Step time: the median of the
steps after the first two (the first makes the optimizer state).

Limits (each configuration once more under them): ``--limit-mb``: ``RLIMIT_DATA`` at the rank's
``VmData`` after building plus this, bounding private writable mappings (anonymous memory; not the
shared file mappings offload uses, where ``RLIMIT_AS`` would count both). ``--cgroup-mb``: each rank
moves itself into a memory cgroup of its own (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``,
where this process may make one) limited to this: what it holds already stays charged to its old
cgroup, so the limit is on what it allocates after building, anonymous memory and page cache
together, as a container's limit; the kernel reclaims the mapped files' pages (written back), and
kills the process when anonymous memory alone exceeds it (there is no swap here).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import spread
from spread.testing import launch_ranks

CONFIGS = (
    "sharded",
    "sharded offload=optimizer",
    "sharded offload=parameters",
    "FSDP2",
    "FSDP2 CPUOffloadPolicy",
)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


class _PeakSampler(threading.Thread):
    """The peak of ``RssAnon`` while running, sampled every millisecond."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _status("RssAnon")
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _status("RssAnon"))

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, _status("RssAnon"))


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _own_cgroup(limit_bytes: int) -> Path | None:
    """Move this process into a new memory cgroup limited to its usage plus ``limit_bytes``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        v1 = "memory" in controllers.split(",")
        if not v1 and controllers != "":
            continue
        root = Path("/sys/fs/cgroup/memory" if v1 else "/sys/fs/cgroup") / path.lstrip("/")
        if not v1 and not (root / "memory.max").exists() and not (root / "cgroup.controllers").exists():
            continue
        group = root / f"spread-offload-{os.getpid()}"
        try:
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))  # what it holds stays charged where it was
            usage = int((group / ("memory.usage_in_bytes" if v1 else "memory.current")).read_text())
            (group / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(usage + limit_bytes))
            return group
        except OSError:
            continue
    raise RuntimeError("no memory cgroup this process may make (cgroup v1 or v2): run without --cgroup-mb")


def _build(kind: str, strategy: spread.Strategy, layers: int, width: int):
    if kind.startswith("FSDP2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        policy = CPUOffloadPolicy(pin_memory=False) if "CPUOffload" in kind else OffloadPolicy()
        model = _model(layers, width)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        def fsdp_step(x: torch.Tensor) -> None:
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()

        return model, optimizer, fsdp_step
    with strategy.scope():
        model = _model(layers, width)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        strategy.run(lambda: model(x).pow(2).mean().backward())
        optimizer.step()

    return model, optimizer, step


def _job(kind: str, layers: int, width: int, steps: int, limit: int, cgroup: int, offload_dir: str | None):
    torch.set_num_threads(1)
    if kind.startswith("sharded"):
        offload = kind.split("offload=")[1] if "offload=" in kind else None
        strategy: spread.Strategy = spread.ShardedStrategy(
            "parameters", units=(nn.Linear,), offload=offload, offload_dir=offload_dir if offload else None
        )
    else:
        strategy = spread.MultiWorkerMirroredStrategy("native")  # the process group FSDP2 runs on
    group = None
    try:
        _model_built, optimizer, step = _build(kind, strategy, layers, width)
        if limit:
            resource.setrlimit(resource.RLIMIT_DATA, (_status("VmData") + limit, resource.RLIM_INFINITY))
        if cgroup:
            group = _own_cgroup(cgroup)
        start_anon, start_rss = _status("RssAnon"), _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        sampler = _PeakSampler()
        sampler.start()
        x = torch.randn(4, width)
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            step(x)
            times.append(time.perf_counter() - begin)
        peak_anon = sampler.stop()
        out = {
            "anon": peak_anon - start_anon,
            "resident": _status("VmHWM") - start_rss,
            "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
            "start_anon": start_anon,
        }
        if isinstance(strategy, spread.ShardedStrategy):
            report = strategy.memory_report(optimizer)
            out["state_in_memory"] = report.device_bytes
            out["offloaded"] = report.offloaded_bytes
        return out
    finally:
        strategy.close()
        if group is not None:
            parent = group.parent
            (parent / "cgroup.procs").write_text(str(os.getpid()))


def _remove_cgroups() -> None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        base = "/sys/fs/cgroup/memory" if "memory" in controllers.split(",") else "/sys/fs/cgroup"
        for group in (Path(base) / path.lstrip("/")).glob("spread-offload-*"):
            try:
                group.rmdir()
            except OSError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--limit-mb", type=int, default=0, help="RLIMIT_DATA above the start (0: none)")
    parser.add_argument("--cgroup-mb", type=int, default=0, help="a cgroup's limit above the start (0: none)")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(2**16))
    params = args.layers * (args.width * args.width + args.width)
    limits = []
    if args.limit_mb:
        limits.append(f"RLIMIT_DATA +{args.limit_mb} MB")
    if args.cgroup_mb:
        limits.append(f"memory cgroup +{args.cgroup_mb} MB")
    print(
        f"{args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.1f} M parameters, "
        f"{params * 4 / 1e6:.0f} MB float32, Adam state {params * 8 / 1e6:.0f} MB; {args.nprocs} processes "
        f"x 1 thread, {args.steps} steps; limit: {', '.join(limits) or 'none'}; load {os.getloadavg()[0]:.1f}"
    )
    print("per rank, max over ranks, MB above the start (after building):")
    print(
        f"  {'configuration':30} {'peak anon':>10} {'peak resident':>14} {'anon total':>11} {'step s':>8} "
        f"{'x sharded':>10}  state"
    )
    base = None
    for kind in args.configs.split(","):
        results = launch_ranks(
            _job,
            args.nprocs,
            args=(
                kind,
                args.layers,
                args.width,
                args.steps,
                args.limit_mb * 2**20,
                args.cgroup_mb * 2**20,
                args.offload_dir,
            ),
            timeout=900,
            env={"OMP_NUM_THREADS": "1"},
            collective_timeout=120,
        )
        _remove_cgroups()
        if not all(r.ok for r in results):
            failed = next(r for r in results if not r.ok)
            print(f"  {kind:30} failed: {' '.join(failed.describe().split())[:300]}")
            continue
        values = [r.value for r in results]
        anon = max(v["anon"] for v in values)
        anon_total = max(v["anon"] + v["start_anon"] for v in values)
        resident = max(v["resident"] for v in values)
        step_s = max(v["step_s"] for v in values)
        base = base or (step_s if kind == "sharded" else None)
        ratio = f"{step_s / base:.2f}" if base else "-"
        state = ""
        if "state_in_memory" in values[0]:
            state = (
                f"model state in memory {values[0]['state_in_memory'] / 1e6:,.0f} MB, "
                f"in files {values[0]['offloaded'] / 1e6:,.0f} MB (rank 0)"
            )
        print(
            f"  {kind:30} {anon / 1e6:>10,.0f} {resident / 1e6:>14,.0f} {anon_total / 1e6:>11,.0f} "
            f"{step_s:>8.2f} {ratio:>10}  {state}"
        )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
