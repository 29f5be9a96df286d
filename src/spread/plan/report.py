"""Show a plan: a rich table in the terminal (plain text when piped) and a PNG of predicted scaling."""

from __future__ import annotations

import io
import math
from dataclasses import replace

from spread.plan.advisor import GIB, Plan
from spread.plan.predict import Candidate, predict, single_device_rate
from spread.plan.workload import ModelProfile


def human_bytes(n: float) -> str:
    """``1.5 KB``, ``23.4 MB``, ``3.20 GiB``: memory sizes readable at every scale."""
    if n < 1e6:
        return f"{n / 1e3:.1f} KB"
    if n < GIB:
        return f"{n / 1e6:.1f} MB"
    return f"{n / GIB:,.2f} GiB"


def table_rows(plan: Plan) -> list[list[str]]:
    """One row per prediction: strategy, step time, throughput, efficiency, memory per device and the
    activations in it (what ``Strategy.measure_activations`` measures per replica), fits, note."""
    rows = []
    for p in plan.predictions:
        mark = "*" if p is plan.recommended else ""
        rows.append(
            [
                f"{mark}{p.candidate.label}",
                f"{p.candidate.devices}",
                f"{p.step_seconds * 1e3:,.1f}",
                f"{p.samples_per_second:,.0f}",
                f"{p.scaling_efficiency:.2f}",
                human_bytes(p.memory.total),
                human_bytes(p.memory.activations),
                "yes" if p.fits else "NO",
                p.note,
            ]
        )
    return rows


HEADERS = [
    "strategy",
    "devices",
    "step ms",
    "samples/s",
    "efficiency",
    "memory/device",
    "activations",
    "fits",
    "why",
]


def render(plan: Plan, profile: ModelProfile) -> str:
    """The plan as text: what was measured, the table, and the recommendation."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    cluster = plan.cluster
    table = Table(title=None, show_lines=False)
    for header in HEADERS:
        table.add_column(
            header,
            justify="left" if header in ("strategy", "why", "fits") else "right",
            no_wrap=header != "why",
        )
    for row in table_rows(plan):
        table.add_row(*(Text(cell) for cell in row))
    # Model names, file paths, labels and reasons come from the user: "plan_cnn:factory" must not
    # become an emoji, nor "[shm]" markup. Every string goes in as Text (never parsed), and the console
    # parses nothing either, so a line added later cannot bring the problem back.
    console = Console(width=160, record=True, file=io.StringIO(), markup=False, emoji=False, highlight=False)
    activations = profile.activation_bytes_per_sample / 1e3
    memory = cluster.memory_per_device
    memory_text = "unbounded memory" if math.isinf(memory) else f"{memory / GIB:.1f} GiB"
    lines = [
        f"model {profile.name}: {profile.param_bytes / 1e6:.2f} MB of parameters "
        f"({profile.sparse_bytes / 1e6:.2f} MB in embeddings), {activations:.1f} KB "
        f"of activations per sample; global batch {plan.options.global_batch}",
        f"cluster: {cluster.nodes} node(s) x {cluster.devices_per_node} device(s), "
        f"{memory_text} per device, from {cluster.source}",
    ]
    for line in lines:
        console.print(Text(line))
    console.print(table)
    console.print(Text(f"recommended: {plan.recommended.candidate.label}: {plan.reason}"))
    return console.export_text()


def scaling_curve(plan: Plan, profile: ModelProfile, max_devices: int) -> dict[str, list[tuple[int, float]]]:
    """Predicted samples/s from 1 to ``max_devices`` devices (powers of two), batch per device fixed."""
    counts = [1]
    while counts[-1] * 2 <= max_devices:
        counts.append(counts[-1] * 2)
    if counts[-1] != max_devices:
        counts.append(max_devices)
    base = plan.cluster
    curves: dict[str, list[tuple[int, float]]] = {}
    families = {p.candidate.label: p.candidate for p in plan.predictions if p.candidate.devices > 1}
    per_device = max(1, plan.options.global_batch // base.devices)  # weak scaling: batch per device fixed
    for label, cand in families.items():
        points = []
        for n in counts:
            cluster = base.with_devices(n)
            options = replace(plan.options, global_batch=per_device * n)
            if n == 1:
                points.append((1, single_device_rate(profile, cluster, options)))
                continue
            if cand.strategy in ("mirrored", "central_storage") and cluster.nodes > 1:
                continue
            if cand.strategy == "pipeline" and n % cand.get("stages"):
                continue
            if cand.get("communication") == "shm" and cluster.nodes > 1:
                continue
            try:
                points.append(
                    (
                        n,
                        predict(
                            Candidate(cand.strategy, n, cand.settings), profile, cluster, options
                        ).samples_per_second,
                    )
                )
            except ValueError:
                continue
        curves[label] = points
    return curves


def plot(plan: Plan, profile: ModelProfile, max_devices: int, path: str) -> str:
    """Write a log-log PNG of :func:`scaling_curve`; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'spread[bench]'") from None
    curves = scaling_curve(plan, profile, max_devices)
    per_device = max(1, plan.options.global_batch // plan.cluster.devices)
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in curves.items():
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("predicted samples/s")
    # parse_math=False: a "$" in a user's model name is text, not mathtext
    ax.set_title(f"spread plan: {profile.name}, {per_device} samples per device", parse_math=False)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
