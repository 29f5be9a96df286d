"""Profile a user's model on this device: step time, memory terms, sparse traffic, per-layer shares.

The planner predicts from measurements, not from FLOP counts: a few real forward/backward passes at
two batch sizes give a linear step-time model ``fixed + per_sample * batch`` per thread count; ``k``
copies stepping at once give the slowdown ``k`` replicas inflict on each other beyond sharing the
cores (memory bandwidth and caches, which matter on CPUs); :class:`~spread.memory.ActivationMeter`
counts the activation bytes autograd keeps (as ``Strategy.measure_activations`` measures them); one
optimizer step on a copy counts the optimizer's state. The user's model and optimizer are never
touched (everything runs on deep copies).
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from spread.memory.measure import ActivationMeter
from spread.pipeline import measured_costs
from spread.plan._forward import LossFn, forward_loss, samples_in
from spread.plan._timing import interleaved_medians, same_optimizer, take, wait_for_device
from spread.plan.concurrency import measure_contention, measure_in_process, measure_optimizer_contention


@dataclass(frozen=True)
class LayerProfile:
    """One top-level block, as a pipeline stage boundary or checkpoint unit sees it."""

    name: str
    time_share: float  # fraction of the model's forward+backward time
    param_bytes: float
    activation_bytes_per_sample: float  # what autograd saves inside the block
    output_bytes_per_sample: float  # what crosses to the next block


@dataclass(frozen=True)
class ModelProfile:
    """Measured figures of one model with one loss and optimizer."""

    name: str
    param_bytes: float
    sparse_bytes: float  # parameters of embedding tables (rows pulled on demand by a PS)
    sparse_row_bytes: float
    sparse_rows_per_sample: float  # distinct rows one sample touches (measured at ``batch``)
    optimizer_bytes: float
    activation_bytes_per_sample: float
    compute: dict[int, tuple[float, float]]  # threads -> (fixed s, s per sample) of forward+backward
    backward_fraction: float
    optimizer_seconds: float
    batch: int
    layers: tuple[LayerProfile, ...] = field(default_factory=tuple)
    # (fraction of backward elapsed, fraction of gradient bytes ready), measured; None: even pace
    gradient_arrival: tuple[tuple[float, float], ...] | None = None
    # replicas computing at once -> slowdown of each one's step beyond core sharing (>= 1), measured
    contention: dict[int, float] = field(default_factory=dict)
    # the same, for the slowest of them (a synchronous step waits for it): >= ``contention``'s
    slowest_contention: dict[int, float] = field(default_factory=dict)
    # intra-op threads -> seconds of one optimizer step (a process runs it at its share of the cores)
    optimizer_by_threads: dict[int, float] = field(default_factory=dict)
    # replicas stepping their own optimizers at once -> slowdown of each beyond core sharing (>= 1)
    optimizer_contention: dict[int, float] = field(default_factory=dict)
    # in-process replicas (threads of one process, as MirroredStrategy runs them) -> slowdown of the
    # replicated forward+backward with gradients combined in one address space, beyond ``contention``
    in_process: dict[int, float] = field(default_factory=dict)
    # threads -> measured (batch, seconds) points of forward+backward, smallest batch first: small
    # batches (pipeline micro-batches) cost more per sample than the straight line ``compute`` says
    compute_curve: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # micro-batch samples -> how much slower a zero-bubble stage's split backward (input pass, then
    # one weight pass per entry node: spread.pipeline.split_backward) makes forward+backward than one
    # ordinary backward, measured on the blocks after the first (what a later stage runs)
    split_backward: dict[int, float] = field(default_factory=dict)
    # bytes of the model's buffers (BatchNorm statistics): multi-process data parallelism averages
    # them in one more all-reduce after every optimizer step
    buffer_bytes: float = 0.0
    # threads -> micro-batch samples -> forward+backward seconds of each block (``layers``' order),
    # as PipelineStrategy measures them to cut its stages: a block's share of the time moves with the
    # batch and thread count (a CNN's second conv block: 65% of the time at 128 samples, 58% at 32
    # on one thread), and a stage runs micro-batches at its process's share of the cores
    layer_seconds: dict[int, dict[int, tuple[float, ...]]] = field(default_factory=dict)

    def contention_factor(self, replicas: int) -> float:
        """How much slower each of ``replicas`` concurrent replicas computes than one alone would.

        1.0 for one replica or when nothing was measured; past the largest measured count, the
        largest count's factor (more replicas than cores are slowed by time-slicing on top, which
        the caller adds).
        """
        return _factor(self.contention, replicas)

    def slowest_contention_factor(self, replicas: int) -> float:
        """As :meth:`contention_factor`, for the slowest of ``replicas``: where a synchronous step's
        ranks meet, each waits for it. Profiles written before it was measured: the typical factor."""
        if not self.slowest_contention:
            return self.contention_factor(replicas)
        return _factor(self.slowest_contention, replicas)

    def optimizer_contention_factor(self, replicas: int) -> float:
        """As :meth:`contention_factor`, for ``replicas`` optimizer steps running at once."""
        return _factor(self.optimizer_contention, replicas)

    def in_process_factor(self, replicas: int) -> float:
        """Extra slowdown of ``replicas`` in-process replicas (thread replicas) over separate ones."""
        return _factor(self.in_process, replicas)

    def layer_costs(self, batch: float, threads: int | None = None) -> list[float]:
        """Each block's forward+backward cost on a micro-batch of ``batch`` samples with ``threads``
        intra-op threads (the nearest measured batch and thread count), in ``layers``' order.

        Profiles without per-batch figures: the blocks' shares at the profiled batch.
        """
        if not self.layer_seconds:
            return [layer.time_share for layer in self.layers]
        by_batch = self.layer_seconds[_nearest_threads(sorted(self.layer_seconds), threads)]
        nearest = min(by_batch, key=lambda n: (abs(math.log(max(batch, 1e-9) / n)), -n))
        return list(by_batch[nearest])

    def optimizer_time(self, threads: int | None = None) -> float:
        """Seconds of one optimizer step with ``threads`` intra-op threads (nearest measured count).

        Falls back to ``optimizer_seconds`` (measured with the most threads) when no per-thread
        figures were taken.
        """
        if threads is None or not self.optimizer_by_threads:
            return self.optimizer_seconds
        return self.optimizer_by_threads[_nearest_threads(sorted(self.optimizer_by_threads), threads)]

    @property
    def dense_bytes(self) -> float:
        return self.param_bytes - self.sparse_bytes

    def compute_seconds(self, batch: float, threads: int | None = None) -> float:
        """Forward+backward seconds for ``batch`` samples with ``threads`` intra-op threads."""
        threads = _nearest_threads(sorted(self.compute), threads)
        if batch <= 0:
            return 0.0
        curve = self.compute_curve.get(threads, ())
        if len(curve) >= 2:
            return _on_curve(curve, batch)
        fixed, per_sample = self.compute[threads]
        return fixed + per_sample * batch

    def split_backward_factor(self, batch: float) -> float:
        """Forward+backward time with zero-bubble's split backward over the ordinary one, at a
        micro-batch of ``batch`` samples (the nearest measured size; 1.0 when none was measured)."""
        if not self.split_backward:
            return 1.0
        nearest = min(self.split_backward, key=lambda n: abs(math.log(max(batch, 1e-9) / n)))
        return self.split_backward[nearest]

    def checkpointed_activation_bytes_per_sample(self) -> float:
        """Activations with each block checkpointed: block outputs kept, one block's inside at a time."""
        if not self.layers:
            return self.activation_bytes_per_sample
        kept = sum(layer.output_bytes_per_sample for layer in self.layers)
        return kept + max(layer.activation_bytes_per_sample for layer in self.layers)


def _nearest_threads(known: list[int], threads: int | None) -> int:
    """The measured thread count closest to ``threads`` (the larger on a tie; the most when None)."""
    wanted = known[-1] if threads is None else threads
    return min(known, key=lambda t: (abs(t - wanted), -t))


def _on_curve(points: tuple[tuple[float, float], ...], batch: float) -> float:
    """Seconds at ``batch`` on the piecewise-linear curve through ``points`` (sorted by batch).

    Between two measured batches: the line between them. Outside: the line through the two nearest,
    never below what the nearest point's per-sample cost gives for the smaller side (a line with a
    negative intercept would make tiny batches free).
    """
    i = 1
    while i < len(points) - 1 and batch > points[i][0]:
        i += 1
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    line = t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    if batch < b0:
        return max(line, t0 * batch / b0)
    return max(line, 0.0)


def _factor(table: dict[int, float], replicas: int) -> float:
    """The factor measured at the largest count <= ``replicas`` (1.0 below every measured count)."""
    if replicas <= 1 or not table:
        return 1.0
    known = [k for k in sorted(table) if k <= replicas]
    return table[known[-1]] if known else 1.0


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    return 0


def measure_model(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: Any,
    targets: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    threads: Sequence[int] = (1,),
    concurrency: Sequence[int] = (),
    repeats: int = 3,
    min_seconds: float = 0.0,
    name: str | None = None,
) -> ModelProfile:
    """Profile ``model`` on ``inputs``/``targets`` (a batch whose first dimension is the sample axis).

    The model runs as the Trainer runs it (:func:`spread.plan._forward.forward_loss`): a dict of
    inputs as keyword arguments, ``loss_fn`` on the output's prediction (a ``ModelOutput``'s
    ``logits``), or with ``loss_fn=None`` the loss the model computes.

    ``threads``: intra-op thread counts to time compute at (a CPU process of a job that runs ``k``
    processes per ``c``-core node gets ``c // k``). ``concurrency``: replica counts ``k >= 2`` whose
    mutual slowdown to measure (:mod:`spread.plan.concurrency`: forward+backward of separate copies,
    their optimizer steps, and thread replicas under MirroredStrategy; CPU only, where replicas share
    a node's memory system). The model, its parameters and ``optimizer`` are copied, never modified.
    A model on a GPU is timed there, at the process's thread count, without the concurrency terms:
    each replica has a device of its own. ``min_seconds``: time the compute rounds (what every
    predicted step scales with) over at least this long, past ``repeats`` if need be (see
    :func:`spread.plan._timing.interleaved_medians`).
    """
    batch = samples_in(inputs, targets)
    if batch < 2:
        raise ValueError(f"profiling needs a batch of at least 2 samples, got {batch}")
    work = copy.deepcopy(model)
    work.train()
    params = [p for p in work.parameters() if p.requires_grad]
    param_bytes = float(sum(p.numel() * p.element_size() for p in work.parameters()))
    buffer_bytes = float(sum(b.numel() * b.element_size() for b in work.buffers()))

    sparse_bytes = sparse_row_bytes = 0.0
    touched: list[torch.Tensor] = []
    handles = []
    for module in work.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag):
            sparse_bytes += module.weight.numel() * module.weight.element_size()
            sparse_row_bytes = max(sparse_row_bytes, module.weight.shape[1] * module.weight.element_size())
            handles.append(module.register_forward_pre_hook(lambda m, args: touched.append(args[0].detach())))

    def step(n: int) -> None:
        x, y = take(inputs, n), take(targets, n)
        for p in params:
            p.grad = None
        forward_loss(work, loss_fn, x, y).backward()

    # The meter Strategy.measure_activations uses: the figure predicted is the figure measured.
    counter = ActivationMeter(exclude=work.buffers())
    arrivals: list[tuple[float, int]] = []
    hooks = [
        p.register_post_accumulate_grad_hook(
            lambda p: arrivals.append((time.perf_counter(), p.numel() * p.element_size()))
        )
        for p in params
    ]
    with counter:
        x, y = take(inputs, batch), take(targets, batch)
        loss = forward_loss(work, loss_fn, x, y)
    wait_for_device()
    started = time.perf_counter()
    loss.backward()
    wait_for_device()
    ended = time.perf_counter()
    for hook in hooks:
        hook.remove()
    gradient_arrival = _arrival_curve(arrivals, started, ended)
    for handle in handles:
        handle.remove()
    rows = sum(int(torch.unique(t).numel()) for t in touched) / batch if touched else 0.0

    previous_threads = torch.get_num_threads()
    compute: dict[int, tuple[float, float]] = {}
    optimizer_by_threads: dict[int, float] = {}
    opt = same_optimizer(optimizer, params) if optimizer is not None else None
    # at least 2 samples: BatchNorm refuses to train on one. Every halving down to a 16th: the
    # per-sample cost is not a straight line between far-apart sizes (a CNN's 1-thread step: 2.95 ms
    # per sample at 32, 3.9 at 128, 3.2 at 64, where the line through 32 and 128 said 3.6), and the
    # batches a rank or pipeline stage runs are mostly a power-of-two share of the global batch.
    smallest, small = max(2, batch // 16), max(2, batch // 4)
    sizes = sorted({max(2, batch >> halvings) for halvings in range(5)})
    curves: dict[int, tuple[tuple[float, float], ...]] = {}
    on_cpu = all(p.device.type == "cpu" for p in work.parameters())
    thread_counts = sorted({int(t) for t in threads}) if on_cpu else [previous_threads]
    most = thread_counts[-1]
    x, y = take(inputs, batch), take(targets, batch)

    def forward_only() -> None:
        forward_loss(work, loss_fn, x, y)

    # Every thread count, batch size and optimizer step in one set of interleaved rounds: their
    # ratios (one process on all cores vs one replica per core) decide the recommendation, and timed
    # block after block they took the VM's drift (W2's 2-thread speed-up over 1 thread read 1.9x to
    # 2.5x on 2 cores).
    calls: dict[tuple[Any, ...], Callable[[], None]] = {}
    for t in thread_counts:
        for n in sizes:
            calls[("step", t, n)] = functools.partial(step, n)
        if opt is not None:  # each process steps its optimizer at its own share of the cores
            calls[("optimizer", t)] = opt.step
    calls[("forward", most)] = forward_only
    split_sizes = sorted({smallest, small})
    split_steps = _split_backward_steps(work, loss_fn, inputs, targets, split_sizes)
    for n, (plain, split) in split_steps.items():
        calls[("plain_later_blocks", most, n)] = plain
        calls[("split_later_blocks", most, n)] = split
    try:
        step(batch)  # gradients for the optimizer's first (warm-up) step
        medians = interleaved_medians(
            calls, repeats, before=lambda key: torch.set_num_threads(key[1]), min_seconds=min_seconds
        )
        for t in thread_counts:
            measured = {n: medians[("step", t, n)] for n in sizes}
            t_small, t_full = measured[small], measured[batch]
            per_sample = max((t_full - t_small) / (batch - small), 0.0)
            fit = (t_full - per_sample * batch, per_sample)
            if fit[0] < 0:  # a negative intercept clamped to 0 would overstate every larger batch
                fit = (0.0, t_full / batch)
            curve = tuple((float(n), measured[n]) for n in sizes)
            fewer = [k for k in sorted(compute) if k < t]
            if fewer and compute[fewer[-1]][0] + compute[fewer[-1]][1] * batch < t_full:
                # more threads measured slower (busy cores): a process can use fewer
                fit, curve = compute[fewer[-1]], curves.get(fewer[-1], ())
            curves[t] = curve
            compute[t] = fit
            if opt is not None:
                seconds = medians[("optimizer", t)]
                fewer_opt = [optimizer_by_threads[k] for k in sorted(optimizer_by_threads) if k < t]
                optimizer_by_threads[t] = min(seconds, fewer_opt[-1]) if fewer_opt else seconds
        torch.set_num_threads(most)
        forward = medians[("forward", most)]
        full = medians[("step", most, batch)]
        backward_fraction = min(max(1.0 - forward / full, 0.0), 0.95) if full > 0 else 0.66

        optimizer_bytes = 0.0
        optimizer_seconds = 0.0
        if opt is not None:
            optimizer_seconds = optimizer_by_threads[max(optimizer_by_threads)]
            optimizer_bytes = float(sum(_tensor_bytes(s) for s in opt.state.values()))
        layers = _layer_profiles(work, x)
        layer_seconds = _layer_seconds(work, x, [n for n in sizes if n < batch] or [batch], thread_counts)
        split_backward = {
            n: max(1.0, medians[("split_later_blocks", most, n)] / medians[("plain_later_blocks", most, n)])
            for n in split_steps
        }
    finally:
        torch.set_num_threads(previous_threads)
    profile = ModelProfile(
        name=name or type(model).__name__,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        sparse_bytes=sparse_bytes,
        sparse_row_bytes=sparse_row_bytes,
        sparse_rows_per_sample=rows,
        optimizer_bytes=optimizer_bytes,
        activation_bytes_per_sample=counter.peak_bytes / batch,
        compute=compute,
        backward_fraction=backward_fraction,
        optimizer_seconds=optimizer_seconds,
        batch=batch,
        layers=layers,
        gradient_arrival=gradient_arrival,
        optimizer_by_threads=optimizer_by_threads,
        compute_curve={t: c for t, c in curves.items() if len(c) >= 2},
        split_backward=split_backward,
        layer_seconds=layer_seconds,
    )
    counts = sorted({int(k) for k in concurrency if 2 <= k <= batch}) if on_cpu else []
    if not counts:
        return profile
    cores = max(threads)
    computing = {
        k: measure_contention(profile, work, loss_fn, inputs, targets, k, cores, repeats) for k in counts
    }
    profile = replace(
        profile,
        contention={k: s.each for k, s in computing.items()},
        slowest_contention={k: s.slowest for k, s in computing.items()},
    )
    batch_args = (loss_fn, inputs, targets)
    if isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor):  # what a dataset splits
        in_process = {k: measure_in_process(profile, work, *batch_args, k, cores, repeats) for k in counts}
        profile = replace(profile, in_process=in_process)
    if optimizer is None:
        return profile
    slowdowns = [
        measure_optimizer_contention(profile, work, optimizer, *batch_args, k, cores, repeats) for k in counts
    ]
    return replace(profile, optimizer_contention=dict(zip(counts, slowdowns, strict=True)))


def _split_backward_steps(
    model: nn.Module, loss_fn: LossFn, inputs: Any, targets: Any, sizes: list[int]
) -> dict[int, tuple[Callable[[], None], Callable[[], None]]]:
    """Per micro-batch size, ``(ordinary, split)`` forward+backward of the blocks after the first of
    a chain, on the first block's output (what a later pipeline stage receives: a float tensor that
    wants its gradient). Empty when the model is not a chain of at least 2 blocks taking a tensor."""
    from spread.pipeline.split_backward import SplitBackward

    if not isinstance(model, nn.Sequential) or len(model) < 2 or not isinstance(inputs, torch.Tensor):
        return {}
    rest = copy.deepcopy(model[1:])  # its own copy: the split's forward hooks stay off the timed model
    with torch.no_grad():
        first = model[0](take(inputs, max(sizes)))
    if not isinstance(first, torch.Tensor) or not first.is_floating_point():
        return {}
    splitter = SplitBackward(rest)
    params = [p for p in rest.parameters() if p.requires_grad]
    steps: dict[int, tuple[Callable[[], None], Callable[[], None]]] = {}
    for n in sizes:
        x, y = first[:n].detach().requires_grad_(True), take(targets, n)

        def plain(x=x, y=y) -> None:
            for p in params:
                p.grad = None
            x.grad = None
            forward_loss(rest, loss_fn, x, y).backward()

        def split(x=x, y=y) -> None:
            for p in params:
                p.grad = None
            x.grad = None
            loss = forward_loss(rest, loss_fn, x, y)
            splitter.backward_weight(splitter.backward_input(loss, None, x))

        steps[n] = (plain, split)
    return steps


def _arrival_curve(
    arrivals: list[tuple[float, int]], started: float, ended: float
) -> tuple[tuple[float, float], ...] | None:
    """Cumulative gradient bytes over backward time, from post-accumulate hook timestamps."""
    total = sum(n for _, n in arrivals)
    span = ended - started
    if not arrivals or total <= 0 or span <= 0:
        return None
    points, done = [], 0
    for when, nbytes in sorted(arrivals):
        done += nbytes
        points.append((min(max((when - started) / span, 0.0), 1.0), done / total))
    return tuple(points)


def _is_chain(model: nn.Module, x: Any) -> bool:
    """Whether ``model`` is a chain of blocks a pipeline cuts (an ``nn.Sequential`` on a tensor)."""
    return isinstance(model, nn.Sequential) and len(model) >= 2 and isinstance(x, torch.Tensor)


def _layer_profiles(model: nn.Module, sample: Any) -> tuple[LayerProfile, ...]:
    """Per-block figures when the model is a chain of blocks; else none."""
    if not _is_chain(model, sample):
        return ()
    batch = sample.shape[0]
    out = []
    x = sample
    for name, block in model.named_children():
        counter = ActivationMeter(exclude=block.buffers())
        with counter:
            y = block(x)
        out.append(
            (
                name,
                float(sum(p.numel() * p.element_size() for p in block.parameters())),
                counter.peak_bytes / batch,
                _tensor_bytes(y) / batch,
            )
        )
        x = y.detach().requires_grad_(y.is_floating_point())
    times = measured_costs(list(model.children()), sample, repeats=3)
    total = sum(times) or 1.0
    return tuple(
        LayerProfile(
            name=n,
            time_share=t / total,
            param_bytes=p,
            activation_bytes_per_sample=a,
            output_bytes_per_sample=o,
        )
        for (n, p, a, o), t in zip(out, times, strict=True)
    )


def _layer_seconds(
    model: nn.Module, sample: Any, batches: list[int], thread_counts: list[int]
) -> dict[int, dict[int, tuple[float, ...]]]:
    """Per-block forward+backward seconds at each micro-batch size and thread count, measured as
    PipelineStrategy measures them to place its cuts (:func:`spread.pipeline.measured_costs`).
    Leaves the thread count as it found it; none for a model that is not a chain of blocks."""
    if not _is_chain(model, sample):
        return {}
    previous = torch.get_num_threads()
    table: dict[int, dict[int, tuple[float, ...]]] = {}
    try:
        for t in thread_counts:  # on a GPU, the process's own count: nothing changes
            torch.set_num_threads(t)
            table[t] = {
                n: tuple(measured_costs(list(model.children()), take(sample, n), repeats=3)) for n in batches
            }
    finally:
        torch.set_num_threads(previous)
    return table
