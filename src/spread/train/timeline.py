"""One timeline of all ranks from their traces (:mod:`spread.train.tracing`), and a picture of it.

Each rank's Chrome trace counts time from its own base (``baseTimeNanoseconds``, the wall clock at
the profiler's start, plus the events' ``ts``), so the events are put on one clock, the earliest at 0,
and each rank becomes one process (a track) named ``rank <r>``. Open ``timeline.json`` in Perfetto
(ui.perfetto.dev) or ``chrome://tracing``; ``spread trace plot DIR`` draws spread's own spans (steps,
forward, backward, exchanges, data waits, pipeline actions) as a PNG for those who would rather look.
Plain JSON and (for the picture) matplotlib: no torch here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from spread.checkpoint.atomic import atomic_save

MERGED = "timeline.json"
_RANK_FILE = re.compile(r"rank-(\d+)\.json")
# spread's span names, by kind, for the picture: (prefix, label, colour)
_KINDS = (
    ("spread.step", "step", "#dddddd"),
    ("spread.forward", "forward", "#4c78a8"),
    ("spread.pipeline.forward", "forward", "#4c78a8"),
    ("spread.backward", "backward", "#f58518"),
    ("spread.pipeline.backward", "backward", "#f58518"),
    ("spread.data_wait", "data wait", "#9d755d"),
    ("spread.gradient_exchange", "exchange", "#e45756"),
    ("spread.pipeline.send", "send/recv", "#b279a2"),
    ("spread.pipeline.recv", "send/recv", "#b279a2"),
    ("spread.", "collective", "#72b7b2"),
)


def rank_traces(directory: str | os.PathLike[str]) -> dict[int, Path]:
    """The per-rank traces in ``directory``, by rank."""
    found = {}
    for path in Path(directory).iterdir():
        matched = _RANK_FILE.fullmatch(path.name)
        if matched:
            found[int(matched.group(1))] = path
    return dict(sorted(found.items()))


def merge_traces(directory: str | os.PathLike[str]) -> Path:
    """Write ``directory/timeline.json``: every rank's events on one clock, a track per rank."""
    traces = rank_traces(directory)
    if not traces:
        raise FileNotFoundError(f"no rank-<r>.json traces in {directory}")
    loaded = {rank: json.loads(path.read_text()) for rank, path in traces.items()}
    starts = {rank: float(trace.get("baseTimeNanoseconds", 0)) / 1000 for rank, trace in loaded.items()}
    timed = [
        starts[rank] + float(event["ts"])
        for rank, trace in loaded.items()
        for event in trace.get("traceEvents", [])
        if event.get("ph") == "X"
    ]
    origin = min(timed) if timed else 0.0
    events: list[dict[str, Any]] = []
    for rank, trace in loaded.items():
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for event in trace.get("traceEvents", []):
            if event.get("ph") != "X" or "ts" not in event:
                continue
            events.append({**event, "pid": rank, "ts": starts[rank] + float(event["ts"]) - origin})
    merged = Path(directory) / MERGED
    text = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode()
    atomic_save(text, merged, write=lambda data, file: file.write(data))
    return merged


def spans(merged: str | os.PathLike[str]) -> dict[int, list[tuple[str, float, float]]]:
    """spread's spans of a merged timeline by rank: ``(kind, start ms, duration ms)``."""
    events = json.loads(Path(merged).read_text())["traceEvents"]
    by_rank: dict[int, list[tuple[str, float, float]]] = {}
    for event in events:
        name = str(event.get("name", ""))
        if event.get("ph") != "X" or not name.startswith("spread."):
            continue
        kind = next(label for prefix, label, _ in _KINDS if name.startswith(prefix))
        by_rank.setdefault(int(event["pid"]), []).append(
            (kind, float(event["ts"]) / 1000, float(event.get("dur", 0)) / 1000)
        )
    return dict(sorted(by_rank.items()))


def plot_timeline(merged: str | os.PathLike[str], picture: str | os.PathLike[str]) -> Path:
    """Draw the merged timeline's spread spans, a lane per rank, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("spread trace plot needs matplotlib: pip install matplotlib") from exc
    lanes = spans(merged)
    if not lanes:
        raise ValueError(f"{merged} holds no spread spans: was a fit traced?")
    colours = {label: colour for _, label, colour in _KINDS}
    figure, axes = plt.subplots(figsize=(12, 1.2 + 0.6 * len(lanes)))
    for row, items in enumerate(lanes.values()):
        for kind in _draw_order(items):
            boxes = [(start, length) for k, start, length in items if k == kind]
            height = 0.8 if kind == "step" else 0.5
            axes.broken_barh(boxes, (row - height / 2, height), facecolors=colours[kind])
    axes.set_yticks(range(len(lanes)), [f"rank {rank}" for rank in lanes])
    axes.invert_yaxis()
    axes.set_xlabel("milliseconds")
    shown = sorted({k for items in lanes.values() for k, _, _ in items}, key=list(colours).index)
    axes.legend(
        handles=[Patch(color=colours[k], label=k) for k in shown],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(shown),
        frameon=False,
    )
    figure.tight_layout()
    out = Path(picture)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def _draw_order(items: Iterable[tuple[str, float, float]]) -> list[str]:
    """Steps first (underneath), then the rest."""
    kinds = {k for k, _, _ in items}
    return sorted(kinds, key=lambda k: (k != "step", k))
