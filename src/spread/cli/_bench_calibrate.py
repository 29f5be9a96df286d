"""``spread bench --calibrate`` when the planner's own calibration is not installed.

Writes a JSON profile of this machine (schema documented in ``docs/architecture.md``,
"Calibration profile")::

    {"schema_version": 1, "kind": "spread-bench-calibration", "measured_at": "...",
     "machine": {...}, "ranks": 2, "quick": false,
     "allreduce": {"<algorithm>": {"alpha": s, "beta": bytes/s, "samples": [[bytes, s], ...]}},
     "compute": {"matmul_flops": FLOP/s, "threads": 1, "size": 1024}}

Each algorithm's ``alpha`` (latency) and ``beta`` (bandwidth) fit one all-reduce of ``S`` bytes
over ``ranks`` processes as ``alpha + S / beta`` (least squares on relative error, so small sizes
count as much as large ones; ``alpha >= 0``). ``matmul_flops`` is one thread's fp32 matmul rate.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
KIND = "spread-bench-calibration"


def fit_alpha_beta(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """``(alpha, beta)`` with ``seconds ~ alpha + bytes / beta`` for ``(bytes, seconds)`` samples."""
    rows = [(1.0 / t, s / t) for s, t in samples if t > 0]  # each row divided by t: relative error
    if len(rows) < 2:
        raise ValueError(f"need at least two timed sizes to fit latency and bandwidth, got {len(rows)}")
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa = sum(a for a, _ in rows)  # right-hand side is 1 for every row
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha = (sa * sbb - sab * sb) / det if det > 0 else 0.0
    inv_beta = (saa * sb - sab * sa) / det if det > 0 else 0.0
    if alpha < 0 or inv_beta <= 0:  # refit without latency (or keep a tiny per-byte cost)
        alpha = max(alpha, 0.0)
        inv_beta = max(sum((1 - alpha * a) * b for a, b in rows) / sbb, 1e-15)
    return alpha, 1.0 / inv_beta


def matmul_flops(size: int = 1024, reps: int = 5) -> float:
    """One thread's fp32 matmul rate (FLOP/s), best of ``reps``."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        out = torch.empty(size, size)
        torch.mm(a, b, out=out)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - start)
        return 2.0 * size**3 / best
    finally:
        torch.set_num_threads(previous)


def profile(allreduce: dict[str, Any], *, machine: dict[str, Any], quick: bool, flops: float) -> dict:
    """The profile document from an ``allreduce_bus.py`` result."""
    links = {}
    for name, by_size in allreduce["seconds"].items():
        samples = sorted((float(int(size)), float(t)) for size, t in by_size.items())
        alpha, beta = fit_alpha_beta(samples)
        links[name] = {"alpha": alpha, "beta": beta, "samples": [list(s) for s in samples]}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": KIND,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine,
        "ranks": allreduce["nprocs"],
        "quick": quick,
        "allreduce": links,
        "compute": {"matmul_flops": flops, "threads": 1, "size": 1024},
    }


def write(path: str | os.PathLike, document: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
