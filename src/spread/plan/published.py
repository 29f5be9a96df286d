"""Published results the cost model should reproduce at scale (``docs/planner.md``, sanity checks).

Horovod (Sergeev and Del Balso, 2018, arXiv:1802.05799, figure 6): TensorFlow with Horovod on
128 servers of 4 Pascal GPUs joined by 25 Gbit/s RoCE, synthetic ImageNet, 64 images per GPU:
scaling efficiency at 512 GPUs about 90% for Inception V3 and ResNet-101, about 68% for VGG-16.

Inputs not in the paper, stated so they can be judged: single-GPU throughput at batch 64 from
TensorFlow's published P100 benchmarks (rounded: Inception V3 ~140, ResNet-101 ~130, VGG-16 ~140
images/s); parameter counts from the model definitions (23.8M, 44.5M, 138.4M); backward is two thirds
of a step; per-hop network latency 10 us; Horovod's default 64 MB fusion buffer as the bucket; half
of the communication overlapping backward (``overlap=0.5``: TensorFlow 1 with Horovod hid part of
it). Gradient arrival order: VGG-16 holds 89% of its
parameters in its three fully connected layers, which backward reaches first (about the first 5% of
backward time); the others spread their parameters evenly over their depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spread.plan.cluster import ClusterModel
from spread.plan.costs import Link
from spread.plan.predict import Candidate, Options, predict
from spread.plan.workload import ModelProfile

HOROVOD_FUSION_BYTES = 64 * 2**20
HOROVOD_CLUSTER: dict[str, Any] = {
    "nodes": 128,
    "devices_per_node": 4,
    "inter": Link(alpha=10e-6, beta=25e9 / 8),
}


@dataclass(frozen=True)
class PublishedScaling:
    """One published scaling-efficiency figure and the model inputs it is predicted from."""

    name: str
    parameters: float
    images_per_second: float
    published_efficiency: float
    gradient_arrival: tuple[tuple[float, float], ...] | None = None


HOROVOD_512 = (
    PublishedScaling("Inception V3", 23.8e6, 140.0, 0.90),
    PublishedScaling("ResNet-101", 44.5e6, 130.0, 0.90),
    PublishedScaling("VGG-16", 138.4e6, 140.0, 0.68, gradient_arrival=((0.05, 0.894),)),
)


def profile_of(model: PublishedScaling, batch: int = 64) -> ModelProfile:
    """A :class:`ModelProfile` from the published inputs (fp32 gradients, SGD momentum state)."""
    return ModelProfile(
        name=model.name,
        param_bytes=model.parameters * 4,
        sparse_bytes=0.0,
        sparse_row_bytes=0.0,
        sparse_rows_per_sample=0.0,
        optimizer_bytes=model.parameters * 4,
        activation_bytes_per_sample=0.0,
        compute={1: (0.0, 1.0 / model.images_per_second)},
        backward_fraction=2 / 3,
        optimizer_seconds=0.0,
        batch=batch,
        gradient_arrival=model.gradient_arrival,
    )


def horovod_efficiency(model: PublishedScaling, *, overlap: float = 0.5, devices: int = 512) -> float:
    """Predicted scaling efficiency of ``model`` on the Horovod cluster (ring all-reduce over NCCL)."""
    cluster = ClusterModel(overlap=overlap, **HOROVOD_CLUSTER).with_devices(devices)
    candidate = Candidate("multi_worker_mirrored", devices, (("communication", "native"),))
    options = Options(global_batch=64 * devices, bucket_bytes=HOROVOD_FUSION_BYTES)
    return predict(candidate, profile_of(model), cluster, options).scaling_efficiency
