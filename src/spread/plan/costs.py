"""The cost terms of the planner: pure functions of sizes, counts and link figures, no torch.

Every term is a closed formula that a test can check by hand. Times are seconds, sizes bytes.
Links follow the alpha-beta model: a message of ``n`` bytes costs ``alpha + n / beta``.

All-reduce of ``S`` bytes over ``n`` ranks, per algorithm (``g`` latency terms, ``f * S`` bytes on the
critical path), so that calibration on 2 ranks carries over to ``n``:

============== ================== ===================================================================
algorithm      time               why
============== ================== ===================================================================
ring, native   2(n-1)a + 2(n-1)/n S/b   reduce-scatter then all-gather, one S/n chunk per hop
reduce_to_one  2(n-1)a + 2(n-1) S/b     the root receives n-1 full buffers, then sends n-1
shm            2a + (3 + 1/n) S/b       per rank: copy in, read its slice from n slots, copy out
hierarchical   shm inside a node of k ranks, then ring over the m node leaders on the slow link
============== ================== ===================================================================
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

ALLREDUCE_ALGORITHMS = ("native", "ring", "shm", "hierarchical", "reduce_to_one")


@dataclass(frozen=True)
class Link:
    """One transport in the alpha-beta model: ``alpha`` seconds per message, ``beta`` bytes/s."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise ValueError(f"link latency alpha must be a finite number >= 0, got {self.alpha!r}")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"link bandwidth beta must be a finite number > 0, got {self.beta!r}")

    def time(self, nbytes: float) -> float:
        """Seconds to move one message of ``nbytes`` (0 for an empty message)."""
        return self.alpha + nbytes / self.beta if nbytes > 0 else 0.0


def allreduce_terms(algorithm: str, n: int) -> tuple[float, float]:
    """``(g, f)`` so that one all-reduce of ``S`` bytes over ``n`` ranks costs ``g*alpha + f*S/beta``."""
    if n < 1:
        raise ValueError(f"an all-reduce needs at least 1 rank, got {n}")
    if n == 1:
        return 0.0, 0.0
    if algorithm in ("ring", "native"):
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if algorithm == "reduce_to_one":
        return 2.0 * (n - 1), 2.0 * (n - 1)
    if algorithm == "shm":
        return 2.0, 3.0 + 1.0 / n
    raise ValueError(f"no flat cost formula for all-reduce algorithm {algorithm!r}")


def allreduce_time(algorithm: str, nbytes: float, n: int, link: Link) -> float:
    """Seconds for one all-reduce of ``nbytes`` over ``n`` ranks joined by ``link``."""
    if nbytes <= 0 or n <= 1:
        return 0.0
    g, f = allreduce_terms(algorithm, n)
    return g * link.alpha + f * nbytes / link.beta


def shard_collective_terms(n: int) -> tuple[float, float]:
    """``(g, f)`` of one reduce-scatter or all-gather over ``n`` ranks: a ring's half of an
    all-reduce, ``n - 1`` messages of ``1/n`` of the bytes."""
    return (float(n - 1), (n - 1) / n) if n > 1 else (0.0, 0.0)


def shard_collective_time(nbytes: float, n: int, link: Link) -> float:
    """One reduce-scatter or all-gather of a ``nbytes`` buffer (the whole, before splitting) over
    ``n`` ranks on ``link`` (the calibration's ``"shard"`` fit where measured)."""
    if nbytes <= 0 or n <= 1:
        return 0.0
    g, f = shard_collective_terms(n)
    return g * link.alpha + f * nbytes / link.beta


def hierarchical_allreduce_time(nbytes: float, nodes: int, per_node: int, intra: Link, inter: Link) -> float:
    """Reduce inside each node through shared memory, ring over one leader per node, share back.

    The intra-node phase is one shared-memory all-reduce (its result is what the leaders exchange and
    what the broadcast returns), so it is counted once; the leaders' ring runs on the slow link.
    """
    return allreduce_time("shm", nbytes, per_node, intra) + allreduce_time("ring", nbytes, nodes, inter)


def bucket_sizes(total_bytes: float, bucket_bytes: float) -> list[float]:
    """Sizes of the gradient buckets: full buckets of ``bucket_bytes``, then the remainder."""
    if total_bytes <= 0:
        return []
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes!r}")
    full, rest = divmod(total_bytes, bucket_bytes)
    return [bucket_bytes] * int(full) + ([rest] if rest > 0 else [])


def bucket_ready_fractions(
    bucket_bytes: list[float], arrival: tuple[tuple[float, float], ...] | None = None
) -> list[float]:
    """When each bucket is full, as a fraction of backward, from the gradient arrival curve.

    ``arrival``: increasing ``(fraction of backward elapsed, fraction of gradient bytes ready)`` points
    (measured by :func:`spread.plan.workload.measure_model`); ``None`` means an even pace. A bucket
    is ready when the bytes up to its end have arrived (linear between points).
    """
    total = sum(bucket_bytes)
    if total <= 0:
        return []
    points = [(0.0, 0.0), *(arrival or ()), (1.0, 1.0)]
    ready, cumulative = [], 0.0
    for size in bucket_bytes:
        cumulative += size
        need = cumulative / total
        for (t0, b0), (t1, b1) in itertools.pairwise(points):
            if b1 >= need - 1e-12:
                ready.append(t1 if b1 <= b0 else t0 + (t1 - t0) * (need - b0) / (b1 - b0))
                break
        else:
            ready.append(1.0)
    return [min(max(r, 0.0), 1.0) for r in ready]


def exposed_communication(
    backward_s: float, bucket_times: list[float], overlap: float = 1.0, ready: list[float] | None = None
) -> float:
    """Seconds of communication left after backward ends, for buckets launched as they fill.

    Bucket ``i`` of ``k`` is ready at ``backward_s * ready[i]`` (default ``(i + 1) / k``: gradients
    arriving at an even pace; see :func:`bucket_ready_fractions`); buckets are sent one after
    another. While backward still runs, communication advances at rate ``overlap`` (1: fully
    hidden behind compute; 0: no progress until backward ends, as when both compete for the same
    cores and compute wins); afterwards at full rate.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    k = len(bucket_times)
    cursor = 0.0
    for i, cost in enumerate(bucket_times):
        cursor = max(cursor, backward_s * (ready[i] if ready is not None else (i + 1) / k))
        if cursor < backward_s:
            window = (backward_s - cursor) * overlap
            if overlap > 0 and cost <= window:
                cursor += cost / overlap
                continue
            cost -= window
            cursor = backward_s
        cursor += cost
    return max(0.0, cursor - backward_s)


def prefetched_exposure(transfers: list[float], windows: list[float], overlap: float = 1.0) -> float:
    """Seconds a chain of prefetched transfers holds up the compute that needs them.

    Transfer 0 is waited for at once (nothing ran before it to hide it); transfer ``i`` starts when
    item ``i - 1`` starts computing and must be done when item ``i`` does: ``windows[i - 1]`` seconds
    of compute in between, during which it advances at rate ``overlap`` (as for
    :func:`exposed_communication`). ShardedStrategy gathers a unit's parameters this way, one unit
    ahead: a unit's gather hides only behind the compute before it, not behind the whole step's.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    if len(windows) < len(transfers) - 1:
        raise ValueError(f"{len(transfers)} transfers need {len(transfers) - 1} windows, got {len(windows)}")
    if not transfers:
        return 0.0
    return transfers[0] + sum(
        max(0.0, cost - overlap * w)
        for cost, w in zip(transfers[1:], windows[: len(transfers) - 1], strict=True)
    )


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zb")


def pipeline_slots(stages: int, microbatches: int, schedule: str = "1f1b") -> float:
    """How long one mini-batch takes, in slots of one micro-batch's forward+backward on one stage.

    Equal stages, backward = 2 x forward. GPipe and 1F1B: ``M + S - 1``. Zero bubble (``"zb"``): its
    deferred weight gradients fill all of the drain but one input gradient per hop, leaving
    ``M + (2S - 3) / 3`` (``1 + 2(S - 1) / 3`` for ``M = 1``); the tests replay the runtime's own
    schedule (``spread.pipeline.simulate``) against this formula.
    """
    _check_schedule(schedule)
    if stages < 1 or microbatches < 1:
        raise ValueError(f"stages and microbatches must be >= 1, got S={stages}, M={microbatches}")
    if schedule != "zb" or stages == 1:
        return microbatches + stages - 1
    if microbatches == 1:
        return 1 + 2 * (stages - 1) / 3
    return microbatches + (2 * stages - 3) / 3


def pipeline_bubble(stages: int, microbatches: int, schedule: str = "1f1b") -> float:
    """The idle fraction: GPipe's ``(S - 1) / (M + S - 1)`` (1F1B's too); less for zero bubble."""
    return 1.0 - microbatches / pipeline_slots(stages, microbatches, schedule)


def pipeline_step_time(
    stage_compute_s: float,
    stages: int,
    microbatches: int,
    boundary_bytes: float,
    link: Link,
    schedule: str = "1f1b",
) -> float:
    """One mini-batch through ``stages`` stages in ``microbatches`` micro-batches.

    ``stage_compute_s`` is the slowest stage's forward+backward time for one micro-batch;
    ``boundary_bytes`` the activation bytes one micro-batch sends across one stage boundary. Each slot
    costs the larger of compute and the transfer (sends overlap compute), and filling and draining
    the pipe adds :func:`pipeline_slots` beyond ``M`` plus one forward and one backward hop per boundary.
    """
    slots = pipeline_slots(stages, microbatches, schedule)
    hop = link.time(boundary_bytes) if stages > 1 else 0.0
    slot = max(stage_compute_s, 2.0 * hop)
    return slots * slot + 2.0 * (stages - 1) * hop


def _check_schedule(schedule: str) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {PIPELINE_SCHEDULES}")


def server_seconds_per_step(
    bytes_per_step: float, servers: int, link: Link, server_apply_bytes_per_s: float
) -> float:
    """Seconds each of ``servers`` spends on one worker step: its share of the pull, push and apply."""
    return 2.0 * bytes_per_step / (servers * link.beta) + bytes_per_step / (
        servers * server_apply_bytes_per_s
    )


def parameter_server_rate(
    *,
    worker_compute_s: float,
    batch_per_worker: int,
    workers: int,
    servers: int,
    bytes_per_step: float,
    link: Link,
    server_apply_bytes_per_s: float,
    synchronous: bool = False,
) -> tuple[float, float]:
    """``(step_seconds_per_worker, samples_per_second)`` of parameter-server training.

    Each worker step pulls and pushes ``bytes_per_step`` (dense parameters plus the touched rows of
    sparse tables), spread evenly over ``servers``. A worker's step is compute, its pull and push
    over its own link, and the servers applying its push (the answer carries the values updated by
    it); the servers together can absorb ``servers * beta / (2 * bytes)`` steps per second (plus
    applying the update), which caps the job when many workers share few servers.
    Synchronous mode waits for all workers' pushes at the servers before the next pull.
    """
    if workers < 1 or servers < 1:
        raise ValueError(f"need at least one worker and one server, got {workers} and {servers}")
    transfer = 2.0 * (servers * link.alpha + bytes_per_step / link.beta)
    worker_step = worker_compute_s + transfer + bytes_per_step / (servers * server_apply_bytes_per_s)
    server_busy = server_seconds_per_step(bytes_per_step, servers, link, server_apply_bytes_per_s)
    if synchronous:
        step = worker_compute_s + 2.0 * servers * link.alpha + workers * server_busy
        return step, workers * batch_per_worker / step
    rate = min(workers * batch_per_worker / worker_step, batch_per_worker / server_busy)
    return worker_step, rate


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes one device holds at the peak of a step."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float = 0.0
    # Kept off the device by ShardedStrategy(offload=...): in host memory beside an accelerator, on
    # disk (memory-mapped) beside a CPU. Not part of ``total``: that is what must fit the device.
    offloaded: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers


def data_parallel_memory(
    param_bytes: float,
    optimizer_bytes: float,
    activation_bytes_per_sample: float,
    batch_per_replica: int,
    *,
    flat_gradient_buffer: bool = True,
) -> MemoryBreakdown:
    """Memory of one replica: a full copy of everything, activations for its share of the batch.

    ``flat_gradient_buffer``: the bucketed reducer keeps one flat copy of the gradients to exchange.
    """
    return MemoryBreakdown(
        parameters=param_bytes,
        gradients=param_bytes,
        optimizer=optimizer_bytes,
        activations=activation_bytes_per_sample * batch_per_replica,
        buffers=param_bytes if flat_gradient_buffer else 0.0,
    )


def sharded_memory(
    param_bytes: float,
    optimizer_bytes: float,
    activation_bytes_per_sample: float,
    batch_per_replica: int,
    *,
    n: int,
    shard: str,
    largest_unit_bytes: float,
    offload: str | None = None,
) -> MemoryBreakdown:
    """Memory of one ShardedStrategy rank: the optimizer state is always split ``n`` ways (``n``: the
    processes of one shard group, all of them without hybrid sharding); at ``"gradients"`` the
    gradients too, at ``"parameters"`` the parameters too. ``parameters``, ``gradients`` and
    ``optimizer`` are what :meth:`~spread.Strategy.memory_report` measures after a step; ``buffers``
    the transient: one block's packed gradients in flight, and at ``"parameters"`` the gathered units
    (the one computing, the next prefetched). ``offload="optimizer"`` moves the optimizer's shard off
    the device, ``"parameters"`` the parameter and gradient shards too (``offloaded``)."""
    if shard not in ("optimizer", "gradients", "parameters"):
        raise ValueError(f"shard must be 'optimizer', 'gradients' or 'parameters', got {shard!r}")
    if offload not in (None, "optimizer", "parameters"):
        raise ValueError(f"offload must be None, 'optimizer' or 'parameters', got {offload!r}")
    if offload == "parameters" and shard != "parameters":
        raise ValueError('offload="parameters" needs shard="parameters"')
    # Below "parameters" the optimizer's shards are views of the model's full parameters; at
    # "optimizer" the gradients stay whole (the all-reduced buffer the shards' gradients view).
    params = param_bytes / n if shard == "parameters" else param_bytes
    grads = param_bytes if shard == "optimizer" else param_bytes / n
    buffers = 3 * largest_unit_bytes if shard == "parameters" else largest_unit_bytes
    optimizer = optimizer_bytes / n
    offloaded = 0.0
    if offload is not None:
        offloaded, optimizer = optimizer, 0.0
    if offload == "parameters":
        offloaded, params, grads = offloaded + params + grads, 0.0, 0.0
    return MemoryBreakdown(
        parameters=params,
        gradients=grads,
        optimizer=optimizer,
        activations=activation_bytes_per_sample * batch_per_replica,
        buffers=buffers,
        offloaded=offloaded,
    )


def pipeline_memory(
    stage_param_bytes: float,
    stage_optimizer_bytes: float,
    stage_activation_bytes_per_sample: float,
    batch_per_replica: int,
    stages: int,
    microbatches: int,
    schedule: str,
) -> MemoryBreakdown:
    """Memory of the largest stage: GPipe keeps all M micro-batches' activations, 1F1B at most S,
    zero bubble at most S + 1 (the first stage's weight gradients wait for one micro-batch more)."""
    _check_schedule(schedule)
    in_flight = {
        "gpipe": microbatches,
        "1f1b": min(microbatches, stages),
        "zb": min(microbatches, stages + 1),
    }[schedule]
    micro = batch_per_replica / microbatches
    return MemoryBreakdown(
        parameters=stage_param_bytes,
        gradients=stage_param_bytes,
        optimizer=stage_optimizer_bytes,
        activations=stage_activation_bytes_per_sample * micro * in_flight,
    )
