"""What the planner knows about the machines: devices, memory, compute speed and links.

A :class:`ClusterModel` comes from a calibration profile measured by ``spread bench --calibrate``
(:meth:`ClusterModel.from_profile`) or is described by hand (nodes, devices per node, link rate and
latency, memory per device). Links inside a node are per all-reduce algorithm, because on one
machine ``shm`` and loopback TCP differ by an order of magnitude; between nodes there is one network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from spread.plan.calibration import CalibrationProfile
from spread.plan.costs import Link

# Fallbacks for a cluster described by hand without a profile: loopback TCP and memcpy on the
# 2-core development machine (docs/results/), and a 10 Gbit/s, 50 us network between nodes.
DEFAULT_INTRA = {
    "native": Link(alpha=6e-4, beta=0.78e9),
    "ring": Link(alpha=6e-4, beta=0.78e9),
    "reduce_to_one": Link(alpha=6e-4, beta=0.78e9),
    "shm": Link(alpha=2e-5, beta=8e9),
    "memory": Link(alpha=1e-6, beta=8e9),
    "ps": Link(alpha=1e-4, beta=1.2e9),  # one push on the parameter servers' transport
}
DEFAULT_INTER = Link(alpha=5e-5, beta=1.25e9)
# Where ShardedStrategy(offload=...) keeps its shards: host memory over PCIe beside an accelerator
# (about 16 GB/s one way), a memory-mapped file beside a CPU (the page cache while it has room; a
# local SSD's 1 GB/s is the conservative figure once the state no longer fits in memory).
DEFAULT_OFFLOAD_ACCELERATOR = Link(alpha=1e-5, beta=16e9)
DEFAULT_OFFLOAD_CPU = Link(alpha=1e-4, beta=1e9)


@dataclass(frozen=True)
class ClusterModel:
    """A homogeneous cluster: ``nodes`` machines with ``devices_per_node`` devices each."""

    nodes: int = 1
    devices_per_node: int = 1
    memory_per_device: float = math.inf  # bytes
    intra: dict[str, Link] = field(default_factory=lambda: dict(DEFAULT_INTRA))
    inter: Link = DEFAULT_INTER
    inter_by_algorithm: dict[str, Link] = field(default_factory=dict)  # measured per algorithm, if any
    compute_scale: float = 1.0  # a device's speed relative to where the model was profiled
    overlap: float = 1.0  # how much of communication runs concurrently with backward (0..1)
    collective_in_step: float = 1.0  # the exchange inside a step over the same collective alone (>= 1)
    sync_wait: float = 0.0  # seconds a synchronous step loses where its ranks meet, whatever the bytes
    server_apply_bytes_per_s: float = 4e9  # a parameter server applying an update (memory bound)
    busy_handoff: float = 0.0  # seconds to wake a waiting process when every core is busy (CPU)
    shard_unit_seconds: float = 0.0  # a ShardedStrategy "parameters" unit's step cost beyond bytes
    cores_per_node: int | None = None  # CPU devices: processes on a node share these cores
    offload_link: Link | None = None  # where offloaded shards live (None: the default for the device)
    source: str = "defaults"

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.memory_per_device > 0:
            raise ValueError(f"memory_per_device must be positive, got {self.memory_per_device!r}")
        if not (self.compute_scale > 0 and math.isfinite(self.compute_scale)):
            raise ValueError(f"compute_scale must be a positive number, got {self.compute_scale!r}")
        if self.cores_per_node is not None and (
            not isinstance(self.cores_per_node, int) or self.cores_per_node < 1
        ):
            raise ValueError(
                f"cores_per_node must be a positive integer or None, got {self.cores_per_node!r}"
            )
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap!r}")
        if not 0.0 <= self.sync_wait < 1.0:
            raise ValueError(f"sync_wait must be in [0, 1) seconds, got {self.sync_wait!r}")
        if not 0.0 <= self.busy_handoff < 1.0:
            raise ValueError(f"busy_handoff must be in [0, 1) seconds, got {self.busy_handoff!r}")
        if not 0.0 <= self.shard_unit_seconds < 1.0:
            raise ValueError(f"shard_unit_seconds must be in [0, 1) seconds, got {self.shard_unit_seconds!r}")
        if not self.collective_in_step >= 1.0:
            raise ValueError(f"collective_in_step must be >= 1, got {self.collective_in_step!r}")
        missing = {"native", "ring", "reduce_to_one", "shm", "memory", "ps"} - set(self.intra)
        if missing:
            raise ValueError(f"intra-node links missing for {sorted(missing)}")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def with_devices(self, devices: int) -> ClusterModel:
        """The same kind of cluster grown or shrunk to ``devices`` (whole nodes once past one node)."""
        if devices <= self.devices_per_node:
            return replace(self, nodes=1, devices_per_node=devices)
        return replace(self, nodes=math.ceil(devices / self.devices_per_node))

    def link(self, algorithm: str) -> Link:
        """The link a flat algorithm runs on: the node's own when on one node, else the network."""
        if self.nodes == 1:
            return self.intra[algorithm]
        return self.inter_by_algorithm.get(algorithm, self.inter)

    def offload_path(self) -> Link:
        """The link ShardedStrategy(offload=...) moves its shards over, each way, every step."""
        if self.offload_link is not None:
            return self.offload_link
        return DEFAULT_OFFLOAD_CPU if self.cores_per_node is not None else DEFAULT_OFFLOAD_ACCELERATOR

    def shard_group_link(self, group: int) -> Link:
        """The link a shard group of ``group`` processes gathers and reduce-scatters on: the node's
        own while the group fits in one node (hybrid sharding's point), else the network's."""
        if self.nodes == 1 or group <= self.devices_per_node:
            return self.intra.get("shard", self.intra["native"])
        return self.shard_link()

    def shard_link(self) -> Link:
        """The link ShardedStrategy's reduce-scatters and all-gathers run on: their own calibrated
        fit where measured (gloo's differ from its all-reduce's), else the all-reduce's."""
        if self.nodes == 1:
            return self.intra.get("shard", self.intra["native"])
        return self.inter_by_algorithm.get("shard", self.inter)

    @classmethod
    def from_profile(
        cls,
        profile: CalibrationProfile,
        *,
        nodes: int = 1,
        devices_per_node: int | None = None,
        memory_per_device: float | None = None,
        inter: Link | None = None,
    ) -> ClusterModel:
        """A cluster of machines like the one ``profile`` was measured on."""
        intra = dict(DEFAULT_INTRA)
        intra.update(profile.links)
        return cls(
            nodes=nodes,
            devices_per_node=devices_per_node or profile.devices,
            memory_per_device=memory_per_device
            if memory_per_device is not None
            else profile.memory_per_device,
            intra=intra,
            inter=inter or profile.links.get("network", DEFAULT_INTER),
            overlap=profile.overlap,
            collective_in_step=profile.collective_in_step,
            sync_wait=profile.sync_wait,
            server_apply_bytes_per_s=profile.memory_bandwidth,
            busy_handoff=profile.busy_handoff,
            shard_unit_seconds=profile.shard_unit_seconds,
            cores_per_node=profile.devices if profile.device_type == "cpu" else None,
            source=f"calibration {profile.machine}",
        )
