"""Rank the candidates, recommend one and say why; explain what would make a model fit.

The recommendation is the fastest candidate that fits in device memory. The reason names the
runner-up and the margin, and the term that decides (communication hidden or not, bubble, sparse
traffic), so a user can judge how close the call is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spread.plan.cluster import ClusterModel
from spread.plan.predict import STRATEGY_NAMES, Options, Prediction, candidates, predict
from spread.plan.workload import ModelProfile

GIB = 2**30


class PlanError(ValueError):
    """The question has no answer: an impossible cluster, or a model that fits nowhere."""


@dataclass(frozen=True)
class Plan:
    """All predictions (fastest first), the recommended one and the reason."""

    predictions: list[Prediction]
    recommended: Prediction
    reason: str
    cluster: ClusterModel
    options: Options


def _fits_message(
    profile: ModelProfile, cluster: ClusterModel, options: Options, smallest: Prediction
) -> str:
    need = smallest.memory.total
    have = cluster.memory_per_device
    hints = [f"a device with at least {need / GIB:.2f} GiB"]
    if not options.checkpointing and profile.layers:
        with_ckpt = replace(options, checkpointing=True)
        best = min(
            (predict(c, profile, cluster, with_ckpt) for c in candidates(profile, cluster, with_ckpt)),
            key=lambda p: p.memory.total,
        )
        hints.append(
            f"activation checkpointing ({best.memory.total / GIB:.2f} GiB with {best.candidate.label})"
        )
    if options.global_batch > 1:
        k = options.accumulation_steps * 2
        hints.append(f"accumulation_steps={k} (halves the activations of each micro-step)")
    if cluster.devices < 64 and profile.layers:
        hints.append("more devices for a deeper pipeline (parameters and activations split by stage)")
    m = smallest.memory
    return (
        f"the model fits on no strategy: the smallest need is {need / GIB:.2f} GiB per device "
        f"({smallest.candidate.label}: parameters {m.parameters / GIB:.2f}, gradients "
        f"{m.gradients / GIB:.2f}, optimizer {m.optimizer / GIB:.2f}, activations "
        f"{m.activations / GIB:.2f} GiB) but a device has {have / GIB:.2f} GiB. "
        f"It would fit with: " + "; or ".join(hints)
    )


def make_plan(
    profile: ModelProfile,
    cluster: ClusterModel,
    options: Options,
    strategies: tuple[str, ...] = STRATEGY_NAMES,
) -> Plan:
    """Predict every candidate of ``strategies`` and recommend the fastest that fits."""
    if options.global_batch < cluster.devices:
        raise PlanError(
            f"a global batch of {options.global_batch} cannot be split over {cluster.devices} devices; "
            f"use a global batch of at least {cluster.devices}"
        )
    try:
        cands = candidates(profile, cluster, options, strategies)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if not cands:
        raise PlanError(
            f"none of {', '.join(strategies)} can run on {cluster.devices} device(s) "
            f"with this model (pipelines need an nn.Sequential of at least 2 blocks)"
        )
    predictions = sorted(
        (predict(c, profile, cluster, options) for c in cands), key=lambda p: -p.samples_per_second
    )
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        raise PlanError(
            _fits_message(profile, cluster, options, min(predictions, key=lambda p: p.memory.total))
        )
    best = fitting[0]
    reason = f"fastest predicted: {best.samples_per_second:,.0f} samples/s"
    others = [p for p in fitting[1:] if p.candidate.strategy != best.candidate.strategy] or fitting[1:]
    if others:
        runner = others[0]
        margin = best.samples_per_second / runner.samples_per_second - 1
        reason += f", {margin:.0%} ahead of {runner.candidate.label}"
    if best.note:
        reason += f" ({best.note})"
    too_big = [p for p in predictions[: predictions.index(best)] if not p.fits]
    if too_big:
        reason += f"; {too_big[0].candidate.label} would be faster but does not fit in memory"
    return Plan(predictions=predictions, recommended=best, reason=reason, cluster=cluster, options=options)
