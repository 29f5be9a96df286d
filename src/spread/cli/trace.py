"""``spread trace``: one timeline of all ranks from the traces ``spread run --trace DIR`` (or
``Trainer(profile=DIR)``) wrote, and a picture of it.

    spread trace merge DIR             DIR/timeline.json: every rank on one clock, a track per rank
    spread trace plot DIR [-o PNG]     spread's spans (steps, forward, backward, exchanges, data
                                       waits, pipeline micro-batches), a lane per rank
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``trace`` subcommand to ``spread``'s subparsers."""
    parser = subparsers.add_parser(
        "trace",
        help="merge the ranks' traces of `spread run --trace DIR` into one timeline, or draw it",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("merge", "plot"), help="merge the traces, or draw the timeline")
    parser.add_argument("directory", help="the directory given to --trace (rank-<r>.json files)")
    parser.add_argument("-o", "--output", default=None, help="plot: the PNG (default DIR/timeline.png)")
    parser.set_defaults(handler=trace_command)
    return parser


def trace_command(args: argparse.Namespace) -> int:
    from spread.train.timeline import MERGED, merge_traces, plot_timeline

    directory = Path(args.directory)
    try:
        merged = merge_traces(directory)
        if args.action == "merge":
            print(f"spread trace: {merged} (open it in ui.perfetto.dev or chrome://tracing)")
            return 0
        picture = plot_timeline(merged, args.output or directory / "timeline.png")
    except (OSError, ValueError, ImportError) as exc:
        print(f"spread trace: error: {exc}", file=sys.stderr)
        return 1
    print(f"spread trace: {picture} (from {directory / MERGED})")
    return 0
