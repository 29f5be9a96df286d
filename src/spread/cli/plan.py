"""``spread plan``: which strategy should this script use on this cluster, and how fast will it be?

Profiles the user's model on this machine (a few real steps), reads a calibration profile from
``spread bench --calibrate`` (or a cluster described on the command line), predicts every strategy's
step time, throughput and memory per device, and recommends one. Torch is imported only when the
command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Any

from spread.cli.run import _int_at_least

DEFAULT_PROFILE = "spread-calibration.json"
# A few seconds of profiling take the speed of that moment, and on a shared VM that moves by tens of
# percent within a minute; every prediction moves with it (docs/results/2026-11-27-planner-warm.md).
PROFILE_SECONDS = 30.0

_DESCRIPTION = """\
Predict each strategy's step time, throughput, scaling efficiency and memory per device for the
model in SCRIPT (run until its first Trainer.fit, which is captured, not run) or in a factory
(--model package.module:function returning (model, loss_fn, inputs, targets[, optimizer])), on a
cluster of --devices devices over --nodes nodes, and recommend the fastest that fits.

Link and compute figures come from a calibration profile (`spread bench --calibrate` writes one;
default ./spread-calibration.json when present), else from built-in figures of a 2-core machine.
Anything can be described by hand: --memory-gb, --link-gbps, --link-latency-us, --compute-scale."""

_EPILOG = """\
examples:
  spread plan examples/digits.py --devices 8 --nodes 2
  spread plan examples/digits.py --devices 2 --profile spread-calibration.json
  spread plan --model mypkg.models:gpt --devices 64 --nodes 8 --memory-gb 16 --link-gbps 25
  spread plan examples/digits.py --devices 4 --plot plan.png --plot-max-devices 4096
  spread plan train.py --devices 4 --script-args '--epochs 1 --batch-size 256'"""


def _finite_float(noun: str, zero_allowed: bool) -> Any:
    """An argparse type: a finite float above 0 (or at least 0), named ``noun`` in its error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>=' if zero_allowed else '>'} 0, got {text}"
            )
        return value

    return parse


_positive_float = _finite_float("a number", zero_allowed=False)
_seconds = _finite_float("a number of seconds", zero_allowed=True)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to ``spread``'s subparsers."""
    parser = subparsers.add_parser(
        "plan",
        help="predict each strategy's speed and memory for a script, and recommend one",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("script", nargs="?", help="training script that calls spread.Trainer.fit")
    parser.add_argument(
        "--script-args",
        default="",
        metavar="ARGS",
        help="arguments for the script, one string ('--epochs 1')",
    )
    parser.add_argument("--model", metavar="MODULE:FUNCTION", help="factory instead of a script")
    parser.add_argument(
        "--devices", type=_int_at_least(1), default=None, help="devices in all (default: this machine's)"
    )
    parser.add_argument(
        "--nodes", type=_int_at_least(1), default=1, help="machines the devices are spread over"
    )
    parser.add_argument(
        "--profile", default=None, help=f"calibration profile (default ./{DEFAULT_PROFILE} if present)"
    )
    parser.add_argument("--memory-gb", type=_positive_float, help="memory per device, GiB")
    parser.add_argument("--link-gbps", type=_positive_float, help="network rate between nodes, Gbit/s")
    parser.add_argument("--link-latency-us", type=_positive_float, help="network latency between nodes, us")
    parser.add_argument(
        "--compute-scale",
        type=_positive_float,
        default=1.0,
        help="a device's speed relative to this machine (e.g. 20 for a GPU vs these cores)",
    )
    parser.add_argument(
        "--profile-seconds",
        type=_seconds,
        default=PROFILE_SECONDS,
        help="time the model's compute over at least this long, to take the machine's typical speed "
        "rather than one moment's (default: %(default)s; 0: three rounds, a few seconds)",
    )
    parser.add_argument("--global-batch", type=_int_at_least(1), help="global batch (default: the script's)")
    parser.add_argument("--strategies", help="comma-separated subset of strategies to consider")
    parser.add_argument("--accumulation-steps", type=_int_at_least(1), default=1)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--offload", action="store_true", help="activation offload to host memory")
    parser.add_argument("--plot", metavar="PNG", help="write predicted throughput from 1 to N devices")
    parser.add_argument("--plot-max-devices", type=_int_at_least(2), default=1024)
    parser.add_argument("--json", action="store_true", help="print the predictions as JSON")
    parser.set_defaults(handler=_run)
    return parser


def _cluster(args: argparse.Namespace) -> Any:
    from spread.plan.calibration import load_profile
    from spread.plan.cluster import ClusterModel
    from spread.plan.costs import Link
    from spread.plan.measure import local_devices

    path = args.profile or (DEFAULT_PROFILE if os.path.exists(DEFAULT_PROFILE) else None)
    cuda, local, local_memory = local_devices()
    devices = args.devices or local
    if devices % args.nodes:
        raise ValueError(
            f"impossible cluster: {devices} devices cannot be spread evenly over {args.nodes} nodes; "
            f"give --devices as a multiple of --nodes"
        )
    memory = args.memory_gb * 2**30 if args.memory_gb else None
    inter = None
    if args.link_gbps or args.link_latency_us:
        inter = Link(alpha=(args.link_latency_us or 50.0) * 1e-6, beta=(args.link_gbps or 10.0) * 1.25e8)
    per_node = devices // args.nodes
    if path:
        profile = load_profile(path)
        return ClusterModel.from_profile(
            profile, nodes=args.nodes, devices_per_node=per_node, memory_per_device=memory, inter=inter
        ), profile.devices if profile.device_type == "cpu" else None
    # a machine with GPUs plans GPUs (the script's default strategy trains there); else its cores
    cores = None if cuda else local
    if cuda and not memory:
        memory = local_memory
    kwargs: dict[str, Any] = {"nodes": args.nodes, "devices_per_node": per_node, "cores_per_node": cores}
    if memory:
        kwargs["memory_per_device"] = memory
    if inter:
        kwargs["inter"] = inter
    return ClusterModel(**kwargs, compute_scale=args.compute_scale, source="built-in figures"), cores


def _run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from spread.cluster.allocator import tune_this_process
    from spread.plan.advisor import PlanError, make_plan
    from spread.plan.calibration import CalibrationError
    from spread.plan.capture import CaptureError, capture_factory, capture_script
    from spread.plan.concurrency import replica_counts
    from spread.plan.machine_load import busy_cores_elsewhere, load_warning
    from spread.plan.predict import STRATEGY_NAMES, Options
    from spread.plan.report import plot, render
    from spread.plan.workload import measure_model

    if bool(args.script) == bool(args.model):
        print("spread plan: give a SCRIPT or --model MODULE:FUNCTION (one of them)", file=sys.stderr)
        return 2
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else STRATEGY_NAMES
    unknown = [s for s in strategies if s not in STRATEGY_NAMES]
    if unknown:
        print(
            f"spread plan: unknown strategy {unknown[0]!r}; known: {', '.join(STRATEGY_NAMES)}",
            file=sys.stderr,
        )
        return 2
    tune_this_process()  # the profile runs with the allocator `spread run` gives the job's ranks
    try:
        cluster, cores = _cluster(args)
        if args.compute_scale != 1.0:
            cluster = replace(cluster, compute_scale=args.compute_scale)
        script_args = shlex.split(args.script_args)
        busy_before = busy_cores_elsewhere()
        workload = capture_factory(args.model) if args.model else capture_script(args.script, script_args)
        threads = sorted({1, cores or 1, max(1, (cores or 1) // cluster.devices_per_node)})
        profile = measure_model(
            workload.model,
            workload.loss_fn,
            workload.inputs,
            workload.targets,
            optimizer=workload.optimizer,
            threads=threads if cores else (1,),
            concurrency=replica_counts(min(cluster.devices_per_node, 2 * cores)) if cores else (),
            min_seconds=args.profile_seconds,
            name=workload.source,
        )
        busy = max(busy_before, busy_cores_elsewhere())
        options = Options(
            global_batch=args.global_batch or workload.global_batch,
            accumulation_steps=args.accumulation_steps,
            checkpointing=args.checkpointing,
            offload=args.offload,
        )
        plan = make_plan(profile, cluster, options, strategies)
    except (PlanError, CalibrationError, CaptureError, ValueError) as exc:
        print(f"spread plan: {exc}", file=sys.stderr)
        return 2
    warning = load_warning(busy, os.cpu_count() or 1)
    if warning is not None:
        print(f"spread plan: warning: {warning}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {**_as_json(plan), "busy_cores_elsewhere": round(busy, 2), "warning": warning}, indent=2
            )
        )
    else:
        print(render(plan, profile), end="")
        if warning is not None:
            print(f"warning: {warning}")
    if args.plot:
        try:
            print(f"wrote {plot(plan, profile, args.plot_max_devices, args.plot)}")
        except RuntimeError as exc:
            print(f"spread plan: {exc}", file=sys.stderr)
            return 2
    return 0


def _as_json(plan: Any) -> dict[str, Any]:
    return {
        "recommended": plan.recommended.candidate.label,
        "reason": plan.reason,
        "predictions": [
            {
                "strategy": p.candidate.strategy,
                "label": p.candidate.label,
                "settings": dict(p.candidate.settings),
                "devices": p.candidate.devices,
                "step_seconds": p.step_seconds,
                "samples_per_second": p.samples_per_second,
                "scaling_efficiency": p.scaling_efficiency,
                "memory_bytes": p.memory.total,
                "offloaded_bytes": p.memory.offloaded,  # off the device: host memory, or a file on a CPU
                "activation_bytes": p.memory.activations,  # MemoryReport.activation_bytes, predicted
                "fits": p.fits,
                "note": p.note,
            }
            for p in plan.predictions
        ],
    }
