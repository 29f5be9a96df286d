"""Calibration profiles: what ``spread bench --calibrate`` measured, as a JSON file ``spread plan`` reads.

Schema (version 1)::

    {"schema": 1, "machine": "...", "measured_at": "...", "device_type": "cpu", "devices": 2,
     "memory_per_device": 25769803776, "memory_bandwidth": 1.6e10, "matmul_flops": 7.1e10,
     "overlap": 0.5, "collective_in_step": 1.4, "sync_wait": 0.004, "busy_handoff": 0.002,
     "shard_unit_seconds": 0.002,
     "links": {"native": {"alpha": 6e-4, "beta": 7.8e8}, "shm": {...}, ...},
     "samples": {"native": [[bytes, seconds, ranks], ...], ...}}

``links`` are alpha-beta fits (:func:`fit_link`) of the measured all-reduce times (and ``"ps"``: one
push on the parameter servers' transport), with each
algorithm's own structure (:func:`spread.plan.costs.allreduce_terms`) factored out, so a fit made with
2 ranks predicts other rank counts. The raw samples are kept so a profile can be refitted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spread.plan.costs import Link, allreduce_terms, shard_collective_terms

SCHEMA_VERSION = 1


class CalibrationError(ValueError):
    """A calibration profile that cannot be used (missing, malformed, or from another schema)."""


@dataclass(frozen=True)
class CalibrationProfile:
    """Measured figures of one machine (see the module docstring for the file format)."""

    machine: str
    devices: int
    memory_per_device: float
    memory_bandwidth: float
    matmul_flops: float
    links: dict[str, Link]
    overlap: float = 0.5
    # how much longer the exchange takes inside a training step than the same all-reduce timed
    # alone (>= 1; measured when nothing of it overlaps backward: ~2x on the 2-core VM)
    collective_in_step: float = 1.0
    # seconds a synchronous step loses where its ranks meet, whatever the bytes (ranks finishing
    # apart, woken when the last arrives): 0.1-0.6 ms for the calibration's steady MLP on the
    # 2-core VM, 0.4-9 ms for the validation families; 0 where not measured
    sync_wait: float = 0.0
    # one-way seconds for a message to wake a peer that waits for it while every core is busy
    # (a pipeline stage on a node with more busy processes than cores; 0 where not measured)
    busy_handoff: float = 0.0
    # seconds a unit of ShardedStrategy(shard="parameters") adds to a step beyond its bytes: its two
    # gathers and one reduction as the strategy runs them (buffers allocated and packed, the ranks
    # meeting three times between compute); 2.2-2.4 ms on the 2-core VM; 0 where not measured
    shard_unit_seconds: float = 0.0
    device_type: str = "cpu"  # "cpu": devices are cores shared by the processes; else accelerators
    measured_at: str = ""
    samples: dict[str, list[list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "machine": self.machine,
            "measured_at": self.measured_at,
            "device_type": self.device_type,
            "devices": self.devices,
            "memory_per_device": self.memory_per_device,
            "memory_bandwidth": self.memory_bandwidth,
            "matmul_flops": self.matmul_flops,
            "overlap": self.overlap,
            "collective_in_step": self.collective_in_step,
            "sync_wait": self.sync_wait,
            "busy_handoff": self.busy_handoff,
            "shard_unit_seconds": self.shard_unit_seconds,
            "links": {name: {"alpha": link.alpha, "beta": link.beta} for name, link in self.links.items()},
            "samples": self.samples,
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "profile") -> CalibrationProfile:
        """Validate ``data`` (parsed JSON); every problem names the field and the file."""
        if not isinstance(data, dict):
            raise CalibrationError(f"{source}: a calibration profile must be a JSON object")
        if data.get("schema") != SCHEMA_VERSION:
            raise CalibrationError(
                f"{source}: schema {data.get('schema')!r} is not the supported version {SCHEMA_VERSION}; "
                f"measure again with `spread bench --calibrate`"
            )

        def number(name: str, *, positive: bool = True) -> float:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise CalibrationError(f"{source}: field {name!r} must be a finite number, got {value!r}")
            if positive and value <= 0:
                raise CalibrationError(f"{source}: field {name!r} must be positive, got {value!r}")
            return float(value)

        links_data = data.get("links")
        if not isinstance(links_data, dict) or not links_data:
            raise CalibrationError(f"{source}: field 'links' must be a non-empty object of alpha/beta fits")
        links = {}
        for name, fit in links_data.items():
            try:
                links[name] = Link(alpha=float(fit["alpha"]), beta=float(fit["beta"]))
            except (TypeError, KeyError, ValueError) as exc:
                raise CalibrationError(
                    f"{source}: link {name!r} needs numeric 'alpha' and 'beta' ({exc})"
                ) from None
        devices = data.get("devices")
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise CalibrationError(f"{source}: field 'devices' must be a positive integer, got {devices!r}")
        overlap = number("overlap", positive=False)
        if not 0.0 <= overlap <= 1.0:
            raise CalibrationError(f"{source}: field 'overlap' must be in [0, 1], got {overlap!r}")
        in_step = data.get("collective_in_step", 1.0)  # older profiles: not measured
        if isinstance(in_step, bool) or not isinstance(in_step, int | float) or not in_step >= 1.0:
            raise CalibrationError(
                f"{source}: field 'collective_in_step' must be a number >= 1, got {in_step!r}"
            )

        def seconds(name: str) -> float:  # a measured wait in [0, 1) s; older profiles: 0
            value = data.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
                raise CalibrationError(
                    f"{source}: field {name!r} must be a number of seconds in [0, 1), got {value!r}"
                )
            return float(value)

        sync_wait, handoff, unit = (
            seconds("sync_wait"),
            seconds("busy_handoff"),
            seconds("shard_unit_seconds"),
        )
        samples = data.get("samples", {})
        if not isinstance(samples, dict):
            raise CalibrationError(f"{source}: field 'samples' must be an object")
        return cls(
            machine=str(data.get("machine", "unknown")),
            devices=devices,
            memory_per_device=number("memory_per_device"),
            memory_bandwidth=number("memory_bandwidth"),
            matmul_flops=number("matmul_flops"),
            links=links,
            overlap=overlap,
            collective_in_step=float(in_step),
            sync_wait=sync_wait,
            busy_handoff=handoff,
            shard_unit_seconds=unit,
            device_type=str(data.get("device_type", "cpu")),
            measured_at=str(data.get("measured_at", "")),
            samples=samples,
        )


def save_profile(profile: CalibrationProfile, path: str | os.PathLike) -> Path:
    """Write ``profile`` atomically (temporary file, then rename) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(profile.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def load_profile(path: str | os.PathLike) -> CalibrationProfile:
    """Read and validate a profile; a missing or malformed file is a :class:`CalibrationError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CalibrationError(
            f"no calibration profile at {path}; create one with `spread bench --calibrate --output {path}`"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not valid JSON ({exc})") from None
    return CalibrationProfile.from_json(data, source=str(path))


def fit_link(algorithm: str, samples: list[tuple[float, float, int]]) -> Link:
    """Least-squares alpha and beta from ``(bytes, seconds, ranks)`` all-reduce measurements.

    Each sample is explained as ``g * alpha + f * bytes / beta`` with the algorithm's ``(g, f)`` for
    its rank count, so the fit recovers per-message latency and per-byte cost, not the algorithm's
    shape. Relative error is minimised, so latency-bound small sizes weigh as much as large ones.
    Non-negative by construction: a negative intercept is clamped to zero and refitted.
    """
    rows = []
    for nbytes, seconds, ranks in samples:
        if algorithm == "ps":  # one push or pull: a single message each way
            g, f = 1.0, 1.0
        elif algorithm == "shard":  # a reduce-scatter or all-gather of the whole buffer
            g, f = shard_collective_terms(int(ranks))
        else:
            g, f = allreduce_terms("native" if algorithm == "hierarchical" else algorithm, int(ranks))
        if (g or f) and seconds > 0:  # weighted by 1/seconds: relative error, so small sizes count
            rows.append((g / seconds, f * nbytes / seconds, 1.0))
    if len(rows) < 2:
        raise CalibrationError(f"need at least two multi-rank samples to fit {algorithm!r}, got {len(rows)}")
    # Normal equations for seconds = g * alpha + (f * bytes) * inv_beta.
    sgg = sum(g * g for g, _, _ in rows)
    sgx = sum(g * x for g, x, _ in rows)
    sxx = sum(x * x for _, x, _ in rows)
    sgt = sum(g * t for g, _, t in rows)
    sxt = sum(x * t for _, x, t in rows)
    det = sgg * sxx - sgx * sgx
    alpha = (sgt * sxx - sgx * sxt) / det if det > 0 else 0.0
    inv_beta = (sgg * sxt - sgx * sgt) / det if det > 0 else 0.0
    if alpha < 0 or inv_beta <= 0:  # fall back to the bandwidth-only (or latency-only) fit
        alpha = max(alpha, 0.0)
        residual = [(t - g * alpha, x) for g, x, t in rows]
        inv_beta = sum(r * x for r, x in residual) / sxx if sxx > 0 else 0.0
        if inv_beta <= 0:
            inv_beta = 1e-12
    return Link(alpha=alpha, beta=1.0 / inv_beta)


def calibrate(
    path: str | os.PathLike, *, quick: bool = False, nprocs: int = 2, rounds: int | None = None
) -> CalibrationProfile:
    """Measure this machine (compute, memory, every all-reduce algorithm, overlap) and save to ``path``.

    ``quick`` uses fewer sizes and repetitions and one round (seconds instead of about a minute).
    Starts ``nprocs`` local ranks, ``rounds`` times (default 3); see :mod:`spread.plan.measure`.
    """
    from spread.plan.measure import measure_machine  # torch and the launcher only when measuring

    return measure_machine(path, quick=quick, nprocs=nprocs, rounds=rounds)
