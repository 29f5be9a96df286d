"""Predict each strategy's step time, throughput and memory for one model on one cluster.

A :class:`Candidate` is one concrete configuration (strategy, algorithm, stage/replica/server
counts); :func:`predict` turns it into a :class:`Prediction` from the measured
:class:`~spread.plan.workload.ModelProfile`, the :class:`~spread.plan.cluster.ClusterModel` and the
cost terms of :mod:`spread.plan.costs`. :func:`candidates` lists what is worth predicting.

Scaling efficiency is throughput divided by ``devices`` times one device's throughput alone (on CPU,
a device is one process with its share of the cores), the figure the benchmarks report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from spread.pipeline import balanced_bounds
from spread.plan.cluster import ClusterModel
from spread.plan.costs import (
    MemoryBreakdown,
    allreduce_time,
    bucket_ready_fractions,
    bucket_sizes,
    data_parallel_memory,
    exposed_communication,
    hierarchical_allreduce_time,
    parameter_server_rate,
    pipeline_bubble,
    pipeline_memory,
    pipeline_step_time,
    prefetched_exposure,
    server_seconds_per_step,
    shard_collective_time,
    sharded_memory,
)
from spread.plan.workload import ModelProfile

STRATEGY_NAMES = (
    "one_device",
    "mirrored",
    "central_storage",
    "multi_worker_mirrored",
    "parameter_server",
    "pipeline",
    "sharded",
)
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Options:
    """Memory and batching options applied to every candidate."""

    global_batch: int
    accumulation_steps: int = 1
    checkpointing: bool = False
    offload: bool = False
    bucket_bytes: float = DEFAULT_BUCKET_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise ValueError(f"global batch must be a positive integer, got {self.global_batch!r}")
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise ValueError(
                f"accumulation_steps must be a positive integer, got {self.accumulation_steps!r}"
            )


@dataclass(frozen=True)
class Candidate:
    """One configuration to predict: a strategy, its settings, and how many devices it uses."""

    strategy: str
    devices: int
    settings: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.settings).get(key, default)

    @property
    def label(self) -> str:
        """Short name for tables: ``multi_worker_mirrored[shm]``, ``pipeline[S=2 M=8 1f1b]``."""
        settings = dict(self.settings)
        if self.strategy == "pipeline":
            inner = f"S={settings['stages']} M={settings['microbatches']} {settings.get('schedule', '1f1b')}"
        elif self.strategy == "parameter_server":
            inner = f"servers={settings['servers']}" + (" sync" if settings.get("mode") == "sync" else "")
        elif self.strategy == "sharded":  # sharded[parameters], sharded[parameters shard_group_size=2]
            extra = [f"{k}={v}" for k, v in self.settings if k != "shard"]
            inner = " ".join([str(settings.get("shard", "parameters")), *extra])
        else:
            inner = " ".join(str(v) for v in settings.values())
        return f"{self.strategy}[{inner}]" if inner else self.strategy


@dataclass(frozen=True)
class Prediction:
    """What one candidate is predicted to do."""

    candidate: Candidate
    step_seconds: float
    samples_per_second: float
    scaling_efficiency: float
    memory: MemoryBreakdown
    fits: bool
    note: str = ""
    parts: dict[str, float] = field(default_factory=dict)  # compute, communication, ... (seconds)


def _compute(
    profile: ModelProfile,
    cluster: ClusterModel,
    batch: float,
    processes_per_node: int,
    k: int,
    *,
    concurrent: int = 1,
    in_process: bool = False,
    synchronous: bool = False,
    busy: float | None = None,
) -> float:
    """Forward+backward of ``batch`` samples as ``k`` accumulation micro-steps on one device.

    On CPU nodes the processes share ``cores_per_node``: each gets ``cores // processes`` intra-op
    threads, more processes than cores run time-sliced (slower by ``processes / cores``), and
    ``concurrent`` replicas computing at the same time also slow each other through the shared
    memory system, by the model's measured :meth:`~ModelProfile.contention_factor` (and, for
    ``in_process`` thread replicas, :meth:`~ModelProfile.in_process_factor` on top). ``synchronous``
    processes meet at every step, so each step lasts as long as the slowest one's:
    :meth:`~ModelProfile.slowest_contention_factor`. ``busy``: how many of the processes compute at
    once when fewer than all do (pipeline stages that mostly wait).
    """
    threads, crowding = _core_share(cluster, processes_per_node, busy)
    if cluster.cores_per_node is not None:
        if synchronous:
            crowding *= profile.slowest_contention_factor(concurrent)
        else:
            crowding *= profile.contention_factor(concurrent)
        if in_process:
            crowding *= profile.in_process_factor(concurrent)
    return crowding * k * profile.compute_seconds(batch / k, threads) / cluster.compute_scale


def _core_share(
    cluster: ClusterModel, processes_per_node: int, busy: float | None
) -> tuple[int | None, float]:
    """``(intra-op threads, time-slicing factor)`` of one of ``processes_per_node`` CPU processes.

    Each gets ``cores // processes`` threads; ``busy`` (default: all) of them computing at once on
    fewer cores are time-sliced by ``busy / cores``. Accelerators: ``(None, 1.0)``.
    """
    if cluster.cores_per_node is None:
        return None, 1.0
    threads = max(1, cluster.cores_per_node // max(processes_per_node, 1))
    return threads, max(1.0, (processes_per_node if busy is None else busy) / cluster.cores_per_node)


def _optimizer(
    profile: ModelProfile,
    cluster: ClusterModel,
    processes_per_node: int,
    concurrent: int,
    busy: float | None = None,
) -> float:
    """One optimizer step in each of ``processes_per_node`` processes, ``concurrent`` of them at once.

    The update is compute too: on CPU nodes it runs at the process's share of the cores, time-sliced
    past one process per core, and slowed by the others' updates through the shared memory system
    (:meth:`~ModelProfile.optimizer_contention_factor`); a memory-bound update of a large table is
    where data parallelism on one CPU node loses most. ``busy`` as for :func:`_compute`.
    """
    threads, crowding = _core_share(cluster, processes_per_node, busy)
    if cluster.cores_per_node is not None:
        crowding *= profile.optimizer_contention_factor(concurrent)
    return crowding * profile.optimizer_time(threads) / cluster.compute_scale


def _activations_per_sample(profile: ModelProfile, options: Options) -> float:
    if options.offload:  # kept on the host; the device holds one block's working set
        layers = profile.layers
        return max((la.activation_bytes_per_sample for la in layers), default=0.0)
    if options.checkpointing:
        return profile.checkpointed_activation_bytes_per_sample()
    return profile.activation_bytes_per_sample


def single_device_rate(profile: ModelProfile, cluster: ClusterModel, options: Options) -> float:
    """Samples/s of one device alone (the efficiency baseline), at its share of a node's cores."""
    per_node = cluster.devices_per_node
    step = _compute(profile, cluster, options.global_batch, per_node, options.accumulation_steps)
    return options.global_batch / (step + _optimizer(profile, cluster, per_node, 1))


def _allreduce(cluster: ClusterModel, algorithm: str, nbytes: float, n: int) -> float:
    if algorithm == "hierarchical":
        per_node = min(cluster.devices_per_node, n)
        nodes = math.ceil(n / per_node)
        return hierarchical_allreduce_time(nbytes, nodes, per_node, cluster.intra["shm"], cluster.inter)
    return allreduce_time(algorithm, nbytes, n, cluster.link(algorithm))


def _meetings(p: ModelProfile, cl: ClusterModel, n: int, per_node: int) -> float:
    """What a synchronous multi-process step loses where its ``n`` ranks meet, beyond the bytes.

    Ranks finish their backward apart and each is woken when the last one arrives: the
    calibration's ``sync_wait``, time-sliced past one process per core. (At 2 processes on the
    2-core VM, six families' exchanges took 1-7 ms more than their bytes' prediction; a ResNet's
    exchange, 0.7 ms predicted, took 8.)
    Once at the gradient exchange, and once more where the model has buffers (BatchNorm
    statistics): MultiWorkerMirrored and ShardedStrategy average them in one more all-reduce after
    every optimizer step (a ResNet's update took 2.7 ms in a job with it, 0.9 without).
    """
    if n < 2:
        return 0.0
    sliced = _core_share(cl, per_node, None)[1]
    if p.buffer_bytes <= 0:
        return cl.sync_wait * sliced
    averaging = _allreduce(cl, "native", p.buffer_bytes, n) * cl.collective_in_step
    return (2 * cl.sync_wait + averaging) * sliced


def predict(
    candidate: Candidate, profile: ModelProfile, cluster: ClusterModel, options: Options
) -> Prediction:
    """Predicted step time, throughput, efficiency and per-device memory of ``candidate``."""
    method = _PREDICTORS.get(candidate.strategy)
    if method is None:
        raise ValueError(f"unknown strategy {candidate.strategy!r}; known: {', '.join(STRATEGY_NAMES)}")
    step, rate, memory, note, parts = method(candidate, profile, cluster, options)
    baseline = single_device_rate(profile, cluster, options)
    return Prediction(
        candidate=candidate,
        step_seconds=step,
        samples_per_second=rate,
        scaling_efficiency=rate / (candidate.devices * baseline),
        memory=memory,
        fits=memory.total <= cluster.memory_per_device,
        note=note,
        parts=parts,
    )


def _one_device(c: Candidate, p: ModelProfile, cl: ClusterModel, o: Options):
    compute = _compute(p, cl, o.global_batch, 1, o.accumulation_steps)
    opt = _optimizer(p, cl, 1, 1)
    memory = data_parallel_memory(
        p.param_bytes,
        p.optimizer_bytes,
        _activations_per_sample(p, o),
        o.global_batch // o.accumulation_steps,
        flat_gradient_buffer=False,
    )
    step = compute + opt
    return step, o.global_batch / step, memory, "one process uses the whole device", {"compute": compute}


def _data_parallel(c: Candidate, p: ModelProfile, cl: ClusterModel, o: Options):
    n = c.devices
    in_process = c.strategy in ("mirrored", "central_storage")
    local = o.global_batch / n
    per_node = min(n, cl.devices_per_node)
    compute = _compute(
        p,
        cl,
        local,
        per_node,
        o.accumulation_steps,
        concurrent=per_node,
        in_process=in_process,
        synchronous=not in_process,
    )
    backward = compute / o.accumulation_steps * p.backward_fraction
    grad_bytes = p.param_bytes
    if in_process:
        # Thread replicas share the one copy of the parameters and autograd sums their gradients
        # into it: no copy. CentralStorageStrategy is that same machinery (its variables live where
        # the replicas compute; other placements are refused), so it is charged no reduce-to-one
        # over memory: that would make it look 1-7% slower than Mirrored, which it never is.
        comm_total = exposed = 0.0
    else:
        algorithm = c.get("communication", "native")
        sizes = bucket_sizes(grad_bytes, o.bucket_bytes)
        # the exchange is CPU work too (time-sliced alike), and costs more inside a step than alone
        sliced = _core_share(cl, per_node, None)[1] * cl.collective_in_step
        buckets = [_allreduce(cl, algorithm, b, n) * sliced for b in sizes]
        comm_total = sum(buckets)
        ready = bucket_ready_fractions(sizes, p.gradient_arrival)
        exposed = exposed_communication(backward, buckets, cl.overlap, ready) + _meetings(p, cl, n, per_node)
    # Thread replicas apply one update while the other replicas wait, but at the process's thread
    # count, which MirroredStrategy sets to the replicas' share of the cores (one thread each at as
    # many replicas as cores: MLP's Adam 5.2 ms against 2.5 ms at 2 threads). Separate processes each
    # apply their own, at once.
    opt = _optimizer(p, cl, per_node, 1, busy=1.0) if in_process else _optimizer(p, cl, per_node, per_node)
    step = compute + exposed + opt
    memory = data_parallel_memory(
        p.param_bytes,
        p.optimizer_bytes,
        _activations_per_sample(p, o),
        math.ceil(local / o.accumulation_steps),
        flat_gradient_buffer=not in_process,
    )
    note = f"{comm_total * 1e3:.1f} ms of all-reduce per step, {exposed * 1e3:.1f} ms not hidden by backward"
    parts = {"compute": compute, "communication": comm_total, "exposed": exposed, "optimizer": opt}
    return step, o.global_batch / step, memory, note, parts


def _sharded(c: Candidate, p: ModelProfile, cl: ClusterModel, o: Options):
    """ShardedStrategy as it holds its parameters. At ``"optimizer"`` and ``"gradients"``: in blocks
    of up to ``bucket_bytes``, as MultiWorkerMirrored's buckets, reduced as backward fills them (an
    all-reduce at ``"optimizer"``, a reduce-scatter above), each rank updating ``1/n`` of the state,
    then every block all-gathered at once after the step. At ``"parameters"``: one block per unit
    (each top-level layer with parameters; the whole model where the profile has no layers),
    reduced as backward produces it, and gathered twice a step, before the unit's forward and again
    before its backward, the next unit's prefetched behind the current one's compute
    (:func:`prefetched_exposure`: a unit's gather hides only behind the compute just before it).
    Each unit also costs the calibration's ``shard_unit_seconds`` beyond its bytes (buffers allocated
    and packed, the ranks meeting three times between compute), and each of its two waits, with more
    processes than cores, a wake-up (``busy_handoff``), as a pipeline stage's do.

    Hybrid sharding (``shard_group_size``: processes per shard group, fewer than all): gathers and
    reduce-scatters run inside a group, on the node's own link while a group fits in a node, and each
    block's reduced ``1/group`` is all-reduced across the ``n / group`` groups. Offload
    (:func:`_offload_seconds`) adds its transfers, not hidden behind compute."""
    n, shard = c.devices, c.get("shard", "parameters")
    group, offload = c.get("shard_group_size", n), c.get("offload")
    if not isinstance(group, int) or group < 1 or n % group:
        raise ValueError(f"shard_group_size must divide the {n} processes, got shard_group_size={group!r}")
    local = o.global_batch / n
    per_node = min(n, cl.devices_per_node)
    compute = _compute(p, cl, local, per_node, o.accumulation_steps, concurrent=per_node, synchronous=True)
    micro_step = compute / o.accumulation_steps
    backward = micro_step * p.backward_fraction
    unit_layers = [i for i, layer in enumerate(p.layers) if layer.param_bytes > 0]
    if shard == "parameters":
        whole = [p.param_bytes] if p.param_bytes > 0 else []
        blocks = [p.layers[i].param_bytes for i in unit_layers] or whole
    else:
        blocks = bucket_sizes(p.param_bytes, o.bucket_bytes)
    link = cl.shard_group_link(group)
    sliced = _core_share(cl, per_node, None)[1] * cl.collective_in_step  # as for data parallelism
    if shard == "optimizer":
        reductions = [allreduce_time("native", b, n, cl.link("native")) * sliced for b in blocks]
    else:
        reductions = [
            (shard_collective_time(b, group, link) + _allreduce(cl, "native", b / group, n // group)) * sliced
            for b in blocks
        ]
    ready = bucket_ready_fractions(blocks, p.gradient_arrival)
    exposed_reduce = exposed_communication(backward, reductions, cl.overlap, ready)
    gathered = [shard_collective_time(b, group, link) * sliced for b in blocks]
    if shard == "parameters":
        micro_batch = local / o.accumulation_steps
        forward_windows, backward_windows = _unit_windows(
            p, unit_layers, micro_batch, per_node, cl, micro_step
        )
        exposed_gather = prefetched_exposure(gathered, forward_windows, cl.overlap) + prefetched_exposure(
            gathered[::-1], backward_windows, cl.overlap
        )
        crowded = cl.cores_per_node is not None and per_node > cl.cores_per_node
        exposed_gather += 2 * len(blocks) * cl.busy_handoff if crowded else 0.0
        exposed_gather += len(blocks) * cl.shard_unit_seconds
        exposed_gather *= o.accumulation_steps
        gathers = 2 * sum(gathered) * o.accumulation_steps
    else:
        gathers = exposed_gather = sum(gathered)
    opt = _optimizer(p, cl, per_node, per_node) / group
    moved = 0.0
    if offload is not None:
        opt, moved = _offload_seconds(p, cl, group, offload, opt, o.accumulation_steps)
    exposed_reduce += _meetings(p, cl, n, per_node)
    step = compute + exposed_reduce + exposed_gather + opt + moved
    memory = sharded_memory(
        p.param_bytes,
        p.optimizer_bytes,
        _activations_per_sample(p, o),
        math.ceil(local / o.accumulation_steps),
        n=group,
        shard=shard,
        largest_unit_bytes=max(blocks, default=0.0),
        offload=offload,
    )
    note = (
        f"{sum(reductions) * 1e3:.1f} ms of gradient reduction and {gathers * 1e3:.1f} ms of parameter "
        f"all-gather per step, {(exposed_reduce + exposed_gather) * 1e3:.1f} ms not hidden"
    )
    parts = {
        "compute": compute,
        "communication": sum(reductions) + gathers,
        "exposed": exposed_reduce + exposed_gather,
        "optimizer": opt,
    }
    if offload is not None:
        note += f"; {moved * 1e3:.1f} ms moving offloaded shards"
        parts["offload"] = moved
    return step, o.global_batch / step, memory, note, parts


def _offload_seconds(
    p: ModelProfile, cl: ClusterModel, group: int, offload: str, device_update: float, k: int
) -> tuple[float, float]:
    """``(optimizer seconds, transfer seconds)`` per step of ShardedStrategy(offload=...).

    Beside an accelerator the shards live in host memory: the gradient shard goes out and the updated
    parameter shard comes back over ``cl.offload_path()``, and the update runs on the host, timed as
    the memory it touches (parameters, gradients, state, read and written) at the host's
    ``server_apply_bytes_per_s``. Beside a CPU the update is where it was, but its state is a
    memory-mapped file, read and written back once a step. With ``"parameters"`` the parameter shard
    also comes in before each of a unit's two gathers, for each of the ``k`` micro-steps, and the
    gradient shard goes out and back in for the update.
    """
    path, params, state = cl.offload_path(), p.param_bytes / group, p.optimizer_bytes / group
    if cl.cores_per_node is None:  # an accelerator
        update = 2 * (2 * params + state) / cl.server_apply_bytes_per_s
        moved = 2 * path.time(params)
    else:
        update, moved = device_update, 2 * path.time(state)
    if offload == "parameters":
        moved += 2 * k * path.time(params) + 2 * path.time(params)
    return update, moved


def _unit_windows(
    p: ModelProfile, unit_layers: list[int], batch: float, per_node: int, cl: ClusterModel, micro_step: float
) -> tuple[list[float], list[float]]:
    """Seconds of compute each prefetched unit gather can hide behind, in forward and in backward.

    In forward, unit ``i``'s gather starts as unit ``i - 1`` starts and hides behind the layers from
    it up to unit ``i``; in backward (units in reverse), unit ``i``'s starts as backward reaches unit
    ``i + 1``'s output, behind the layers after unit ``i`` up to unit ``i + 1``. Layers' shares of
    ``micro_step`` are their measured costs at the rank's micro-batch (``batch``) and threads."""
    if len(unit_layers) < 2:
        return [], []
    costs = p.layer_costs(batch, _core_share(cl, per_node, None)[0])
    total = sum(costs) or 1.0
    forward = micro_step * (1.0 - p.backward_fraction) / total
    backward = micro_step * p.backward_fraction / total
    pairs = list(pairwise(unit_layers))
    forward_windows = [forward * sum(costs[a:b]) for a, b in pairs]
    backward_windows = [backward * sum(costs[a + 1 : b + 1]) for a, b in reversed(pairs)]
    return forward_windows, backward_windows


def _server_apply_rate(p: ModelProfile, cl: ClusterModel, processes_per_node: int, busy: float) -> float:
    """Bytes/s a parameter server updates at: this model's optimizer as the profile timed it.

    A server runs the job's optimizer (element-wise, torch's single-tensor formulas) over the bytes
    each push carries, at its process's share of the cores; the profile timed that optimizer over
    all ``param_bytes`` per thread count. A dense AdamW update is ~20x slower than the memory copy
    the calibration's generic ``server_apply_bytes_per_s`` describes (W2: ~25 ms against ~1 ms per
    push), which is the fallback when no optimizer was profiled. ``busy``: processes computing
    while the server applies (the pushing worker waits for the answer), for time-slicing.
    """
    seconds = _optimizer(p, cl, processes_per_node, 1, busy=max(1.0, busy))
    if seconds <= 0 or p.param_bytes <= 0:
        return cl.server_apply_bytes_per_s
    return p.param_bytes / seconds


def _parameter_server(c: Candidate, p: ModelProfile, cl: ClusterModel, o: Options):
    servers = c.get("servers", 1)
    workers = c.devices - servers
    per_worker = o.global_batch / workers
    rows = (
        min(p.sparse_rows_per_sample * per_worker, p.sparse_bytes / p.sparse_row_bytes)
        if p.sparse_bytes
        else 0
    )
    moved = p.dense_bytes + rows * p.sparse_row_bytes
    link = cl.link("ps")
    # Processes busy at once on a node: the workers, and each server for the share of the time it
    # serves them (a server of touched embedding rows mostly waits; one of dense weights may not).
    # The workers are separate replicas computing at once: the measured contention slows each.
    on_node = min(c.devices, cl.devices_per_node)
    workers_on_node = on_node * workers / c.devices
    servers_on_node = on_node * servers / c.devices
    concurrent = max(1, round(workers_on_node))
    k = o.accumulation_steps
    alone = _compute(p, cl, per_worker, on_node, k, concurrent=concurrent, busy=workers_on_node)
    apply_rate = _server_apply_rate(p, cl, on_node, workers_on_node - 1.0 + servers_on_node)
    serving = server_seconds_per_step(moved, servers, link, apply_rate)
    cycle = alone + 2.0 * moved / link.beta + moved / (servers * apply_rate)
    utilisation = min(1.0, workers * serving / max(cycle, 1e-12))
    busy = workers_on_node + servers_on_node * utilisation
    compute = _compute(p, cl, per_worker, on_node, k, concurrent=concurrent, busy=busy)
    step, rate = parameter_server_rate(
        worker_compute_s=compute,
        batch_per_worker=int(per_worker),
        workers=workers,
        servers=servers,
        bytes_per_step=moved,
        link=link,
        server_apply_bytes_per_s=apply_rate,
        synchronous=c.get("mode", "async") == "sync",
    )
    worker_memory = data_parallel_memory(
        p.dense_bytes + rows * p.sparse_row_bytes,
        0.0,
        _activations_per_sample(p, o),
        math.ceil(per_worker / o.accumulation_steps),
        flat_gradient_buffer=False,
    )
    server_memory = (p.param_bytes + p.optimizer_bytes) / servers
    memory = (
        worker_memory
        if worker_memory.total >= server_memory
        else MemoryBreakdown(
            parameters=p.param_bytes / servers,
            gradients=0.0,
            optimizer=p.optimizer_bytes / servers,
            activations=0.0,
        )
    )
    note = f"{moved / 1e6:.2f} MB pulled and pushed per worker step ({rows:.0f} sparse rows)"
    return step, rate, memory, note, {"compute": compute, "communication": step - compute}


def _pipeline(c: Candidate, p: ModelProfile, cl: ClusterModel, o: Options):
    stages, micro = c.get("stages"), c.get("microbatches")
    replicas = c.devices // stages
    per_replica = o.global_batch / replicas
    on_node = min(c.devices, cl.devices_per_node)
    # Cut where PipelineStrategy cuts: its blocks' costs on one micro-batch at the stage's threads.
    costs = p.layer_costs(per_replica / micro, _core_share(cl, on_node, None)[0])
    groups = [list(range(a, b)) for a, b in balanced_bounds(costs, stages)]
    total = sum(costs) or 1.0
    shares = [sum(costs[i] for i in g) / total for g in groups]
    share = max(shares)
    # While the slowest stage computes, a faster one computes only share_s / share of the time: an
    # unbalanced pipeline keeps fewer cores busy than it has processes (W3's embedding stage does
    # ~95% of the work; its MLP stage mostly waits).
    busy = on_node / stages * sum(s / share for s in shares) if share > 0 else float(on_node)
    stage_compute = _compute(p, cl, per_replica / micro, on_node, 1, busy=busy) * share
    schedule = c.get("schedule", "1f1b")
    if schedule == "zb":  # its backward runs as an input pass and a weight pass per module
        stage_compute *= p.split_backward_factor(per_replica / micro)
    boundary = max((p.layers[g[-1]].output_bytes_per_sample for g in groups[:-1]), default=0.0)
    link = cl.link("native")
    step = pipeline_step_time(stage_compute, stages, micro, boundary * per_replica / micro, link, schedule)
    # More processes computing than cores: a stage that waits for its neighbour's activation or
    # gradient runs again only when the scheduler frees a core for it (the calibration's
    # busy_handoff, ~3 ms on the 2-core VM). Once per micro-batch on the critical path: the fitted
    # families' pipelines at 4 processes on 2 cores measured about that much over the prediction
    # (the MLP: 22-28 ms at M=4, 24-38 at 8, 48-53 at 16). With a core each, or on accelerators,
    # a waiting stage wakes at once.
    crowded = cl.cores_per_node is not None and busy > cl.cores_per_node
    wakeups = micro * cl.busy_handoff if crowded else 0.0
    step = (step + wakeups) * o.accumulation_steps
    stage_params = max(sum(p.layers[i].param_bytes for i in g) for g in groups)
    grad_sync = allreduce_time("native", stage_params, replicas, link)
    stage_replicas = max(1, on_node // stages)  # a stage's replicas on a node update at the same moment
    opt = _optimizer(p, cl, on_node, stage_replicas, busy=busy) * stage_params / max(p.param_bytes, 1.0)
    step += grad_sync + opt
    if o.checkpointing:
        acts = max(
            sum(p.layers[i].output_bytes_per_sample for i in g)
            + max(p.layers[i].activation_bytes_per_sample for i in g)
            for g in groups
        )
    else:
        acts = max(sum(p.layers[i].activation_bytes_per_sample for i in g) for g in groups)
    memory = pipeline_memory(
        stage_params,
        p.optimizer_bytes * stage_params / max(p.param_bytes, 1.0),
        acts,
        math.ceil(per_replica / o.accumulation_steps),
        stages,
        micro,
        schedule,
    )
    bubble = pipeline_bubble(stages, micro, schedule)
    note = f"bubble {bubble:.0%}, slowest stage {share:.0%} of the model's time"
    parts = {"compute": stage_compute * micro, "sync": grad_sync, "wakeups": wakeups * o.accumulation_steps}
    return step, o.global_batch / step, memory, note, parts


_PREDICTORS = {
    "one_device": _one_device,
    "sharded": _sharded,
    "mirrored": _data_parallel,
    "central_storage": _data_parallel,
    "multi_worker_mirrored": _data_parallel,
    "parameter_server": _parameter_server,
    "pipeline": _pipeline,
}


def candidates(
    profile: ModelProfile,
    cluster: ClusterModel,
    options: Options,
    strategies: tuple[str, ...] = STRATEGY_NAMES,
) -> list[Candidate]:
    """Every configuration of ``strategies`` that can run on ``cluster`` with this model."""
    unknown = set(strategies) - set(STRATEGY_NAMES)
    if unknown:
        raise ValueError(f"unknown strategy {sorted(unknown)[0]!r}; known: {', '.join(STRATEGY_NAMES)}")
    d = cluster.devices
    out: list[Candidate] = []
    if "one_device" in strategies:
        out.append(Candidate("one_device", 1))
    if d < 2:
        return out
    if cluster.nodes == 1:
        for name in ("mirrored", "central_storage"):
            if name in strategies:
                out.append(Candidate(name, d))
    if "multi_worker_mirrored" in strategies:
        algorithms = ["native", "ring", "reduce_to_one"] + (
            ["shm"] if cluster.nodes == 1 else ["hierarchical"]
        )
        out.extend(Candidate("multi_worker_mirrored", d, (("communication", a),)) for a in algorithms)
    if "parameter_server" in strategies and d >= 2:
        for servers in sorted({1, max(1, d // 4), max(1, d // 2)}):
            if d - servers >= 1:
                out.append(Candidate("parameter_server", d, (("servers", servers),)))
    if "sharded" in strategies:
        out.extend(Candidate("sharded", d, (("shard", s),)) for s in ("optimizer", "gradients", "parameters"))
        out.extend(
            Candidate("sharded", d, (("shard", "parameters"), ("offload", where)))
            for where in ("optimizer", "parameters")
        )
        out.extend(
            Candidate("sharded", d, (("shard", "parameters"), ("shard_group_size", g)))
            for g in _hybrid_groups(cluster)
        )
    if "pipeline" in strategies and len(profile.layers) >= 2:
        for stages in (2, 4, 8, 16):
            if stages > len(profile.layers) or d % stages:
                continue
            per_replica = options.global_batch // (d // stages)
            for micro in (stages, 2 * stages, 4 * stages, 8 * stages):
                if micro > per_replica:
                    continue
                for schedule in ("1f1b", "zb"):  # GPipe: 1F1B's time with more memory, never better
                    settings = (("stages", stages), ("microbatches", micro), ("schedule", schedule))
                    out.append(Candidate("pipeline", d, settings))
    return out


def _hybrid_groups(cluster: ClusterModel) -> list[int]:
    """Shard-group sizes worth predicting: every proper divisor of the processes from 2 up; once there
    are several nodes, only groups that tile a node (a group across nodes gathers over the network:
    what hybrid sharding avoids)."""
    if cluster.nodes == 1:
        return [g for g in range(2, cluster.devices) if cluster.devices % g == 0]
    return [g for g in range(2, cluster.devices_per_node + 1) if cluster.devices_per_node % g == 0]
