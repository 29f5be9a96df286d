"""Execute one stage's schedule: forwards and backwards of micro-batches, transfers in between.

The runner is the only code that touches autograd across stages. A stage's forward output is sent
detached; the next stage makes its copy a leaf that requires grad, so after that stage's backward the
leaf's ``.grad`` is exactly the gradient to send back; the sending stage then resumes autograd with
``torch.autograd.backward(output, grad)``. A stage of a traced model passes several tensors (GPT-2:
hidden states and attention mask); each is one part of the micro-batch's transfer, and only parts
that require grad get a gradient back. The last stage's backward starts from its loss, scaled by
the micro-batch's share of the global batch, so summed gradients are those of the global mean loss.

Gradient exchange between data-parallel replicas (hybrid) is left to the caller through ``no_sync``:
every backward but the stage's last one runs inside it, and the last one triggers the exchange
(overlapped with that backward by :class:`~spread.comm.GradientReducer`).

Zero-bubble schedules split a backward into ``backward_input`` and ``backward_weight``
(:class:`~spread.pipeline.split_backward.SplitBackward`; a traced stage's several outputs and inputs
alike); the weight part counts as the micro-batch's backward above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.profiler import record_function

from spread.memory import SavedTensorBytes
from spread.pipeline.p2p import StageLink
from spread.pipeline.schedules import Action, Op
from spread.pipeline.split_backward import MicrobatchGraph, SplitBackward

LossFn = Callable[[Any, Any], torch.Tensor]


class TracedStage(Protocol):
    """What the runner needs from a stage cut out of a traced model (see
    :mod:`spread.pipeline.graph_split`): it is called as ``module(pipeline_input, *received)`` and
    returns a tuple of tensors for the next stage (the model's output on the last stage)."""

    def num_received(self, pipeline_input: Any) -> int:
        """How many tensors this stage receives per micro-batch of this input."""
        ...


OnLoss = Callable[[int, torch.Tensor, Any, torch.Tensor], None]


@dataclass
class StepTimes:
    """Wall-clock seconds of one step on this stage: all of it, and the part spent computing."""

    total: float = 0.0
    compute: float = 0.0
    per_action: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start, end)
    peak_saved_bytes: int = 0  # most bytes saved for backward alive at once (recorded runs only)

    @property
    def idle_fraction(self) -> float:
        return 1.0 - self.compute / self.total if self.total > 0 else 0.0


class StageRunner:
    """Runs ``module`` (this stage's layers) under a schedule, talking to neighbours over ``link``."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        stages: int,
        link: StageLink,
        *,
        record: bool = False,
        traced: TracedStage | None = None,
    ) -> None:
        self.module, self.stage, self.stages, self.link = module, stage, stages, link
        self.traced = traced  # a traced stage takes (pipeline input, *received) and passes several
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        self.record = record
        self.last_times = StepTimes()
        self._split: SplitBackward | None = None  # made at the first zero-bubble step

    def close(self) -> None:
        """Remove the hooks a zero-bubble schedule put on the stage's modules."""
        if self._split is not None:
            self._split.close()
            self._split = None

    def train(
        self,
        actions: Sequence[Action],
        inputs: Sequence[Any] | None,
        targets: Sequence[Any] | None,
        loss_fn: LossFn | None,
        weights: Sequence[float],
        *,
        no_sync: Callable[[], AbstractContextManager] | None = None,
        on_loss: OnLoss | None = None,
        forward_context: Callable[[], AbstractContextManager] | None = None,
    ) -> None:
        """One mini-batch: ``inputs`` (first stage) and ``targets`` (last stage) are per micro-batch;
        ``weights[i]`` is micro-batch i's share of the global batch. Gradients accumulate in ``.grad``.
        Every stage should pass the micro-batches' pipeline inputs (their shapes key the transfers,
        see :mod:`spread.pipeline.p2p`); only the first stage computes on them. ``forward_context``
        (autocast for mixed precision) wraps each forward and loss, not the backward."""
        num_backward = sum(1 for a in actions if a.op in (Op.BACKWARD, Op.BACKWARD_WEIGHT))
        done_backward = 0
        split = None
        if any(a.op is Op.BACKWARD_INPUT for a in actions):
            if self._split is None:
                self._split = SplitBackward(self.module)
            split = self._split
        graphs: dict[int, MicrobatchGraph] = {}
        received: dict[int, tuple[torch.Tensor, ...]] = {}
        wants_grad: dict[int, tuple[bool, ...]] = {}
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        grads: dict[int, list[torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}
        times = StepTimes()
        started = time.perf_counter()
        keys = _shape_keys(inputs, len(weights))
        recv_order = [a.microbatch for a in actions if a.op is Op.RECV_ACT]
        if recv_order:  # post the first receive now when its shape is known from an earlier step
            self._prefetch(recv_order[0], inputs, keys)
        received_count = 0
        saved: dict[int, int] = {}  # micro-batch -> bytes its forward saved for backward (recorded runs)
        live_saved = 0
        for a in actions:
            with record_function(f"spread.pipeline.{a.op.name.lower()} mb{a.microbatch}"):  # traces
                i = a.microbatch
                if a.op is Op.RECV_ACT:
                    parts = [self.link.recv_activation(i, keys[i], j) for j in range(self._parts(inputs, i))]
                    wants_grad[i] = tuple(w for _, w in parts)
                    received[i] = tuple(data.requires_grad_(w) for data, w in parts)
                    received_count += 1
                    if received_count < len(recv_order):  # overlap the next transfer with this compute
                        self._prefetch(recv_order[received_count], inputs, keys)
                elif a.op is Op.SEND_ACT:
                    for j, out in enumerate(outputs[i]):
                        self.link.send_activation(out, i, keys[i], j)
                    for j, out in enumerate(outputs[i]):
                        if out.requires_grad:  # its gradient may arrive while we compute others
                            self.link.prefetch_grad(out, i, j)
                elif a.op is Op.RECV_GRAD:
                    grads[i] = [
                        self.link.recv_grad(out, i, j)
                        for j, out in enumerate(outputs[i])
                        if out.requires_grad
                    ]
                elif a.op is Op.SEND_GRAD:
                    pairs = zip(received.get(i, ()), wants_grad.get(i, ()), strict=True)
                    for j, (data, w) in enumerate(pairs):
                        if w:
                            grad = data.grad
                            self.link.send_grad(grad if grad is not None else torch.zeros_like(data), i, j)
                    received.pop(i, None)
                elif a.op is Op.FORWARD:
                    t0 = time.perf_counter()
                    args = self._args(inputs, received, i)
                    with (
                        self._meter(args[0] if self.is_first else None) as meter,
                        forward_context() if forward_context is not None else nullcontext(),
                    ):
                        out = self.module(*args)
                        if self.is_last:
                            loss = loss_fn(out, targets[i])  # type: ignore[misc,index]
                    if meter is not None:
                        saved[i] = meter.bytes
                        live_saved += meter.bytes
                        times.peak_saved_bytes = max(times.peak_saved_bytes, live_saved)
                    if self.is_last:
                        if on_loss is not None:
                            on_loss(i, out, targets[i], loss)  # type: ignore[index]
                        losses[i] = loss
                    else:
                        outputs[i] = _as_parts(out)
                    self._account(times, a, t0)
                elif a.op is Op.BACKWARD:
                    t0 = time.perf_counter()
                    live_saved -= saved.pop(i, 0)
                    done_backward += 1
                    last = done_backward == num_backward
                    with nullcontext() if last or no_sync is None else no_sync():
                        if self.is_last:
                            (losses.pop(i) * weights[i]).backward()
                        else:
                            roots = [o for o in outputs.pop(i) if o.requires_grad]
                            if roots:
                                torch.autograd.backward(roots, grads.pop(i))
                    self._account(times, a, t0)
                elif a.op is Op.BACKWARD_INPUT:
                    t0 = time.perf_counter()
                    assert split is not None
                    root_grads: list[torch.Tensor | None]
                    if self.is_last:
                        roots, root_grads = [losses.pop(i) * weights[i]], [None]
                    else:
                        roots = [o for o in outputs.pop(i) if o.requires_grad]
                        root_grads = list(grads.pop(i, []))
                    stage_inputs = [
                        d for d, w in zip(received.get(i, ()), wants_grad.get(i, ()), strict=True) if w
                    ]
                    with nullcontext() if no_sync is None else no_sync():
                        graphs[i] = split.backward_input(roots, root_grads, stage_inputs)
                    self._account(times, a, t0)
                elif a.op is Op.BACKWARD_WEIGHT:
                    t0 = time.perf_counter()
                    assert split is not None
                    live_saved -= saved.pop(i, 0)
                    done_backward += 1
                    graph = graphs.pop(i)
                    if done_backward == num_backward:  # the exchange (hybrid) follows its last engine call
                        split.backward_weight(graph, no_sync)
                    else:
                        with nullcontext() if no_sync is None else no_sync():
                            split.backward_weight(graph)
                    self._account(times, a, t0)
        self.link.wait_sends()
        times.total = time.perf_counter() - started
        self.last_times = times

    def forward(self, inputs: Sequence[Any]) -> list[Any] | None:
        """Inference: run every micro-batch through this stage (no gradients). The last stage returns
        the outputs, the others None. Every stage passes the micro-batches' pipeline inputs."""
        outputs = []
        with torch.no_grad():
            for i in range(len(inputs)):
                received = {}
                if not self.is_first:
                    parts = range(self._parts(inputs, i))
                    received[i] = tuple(self.link.recv_activation(i, None, j)[0] for j in parts)
                out = self.module(*self._args(inputs, received, i))
                if self.is_last:
                    outputs.append(out)
                else:
                    for j, part in enumerate(_as_parts(out)):
                        self.link.send_activation(part, i, None, j)
        self.link.wait_sends()
        return outputs if self.is_last else None

    def _parts(self, inputs: Sequence[Any] | None, i: int) -> int:
        if self.traced is None:
            return 1
        assert inputs is not None, "a traced stage needs the pipeline inputs on every stage"
        return self.traced.num_received(inputs[i])

    def _args(
        self, inputs: Sequence[Any] | None, received: dict[int, tuple[torch.Tensor, ...]], i: int
    ) -> tuple[Any, ...]:
        """The stage module's arguments: the pipeline input (first stage), the received tensor
        (later stages), or both (a traced stage: it may use the input and several tensors)."""
        if self.traced is not None:
            return (inputs[i], *received.get(i, ()))  # type: ignore[index]
        return (inputs[i],) if self.is_first else received[i]  # type: ignore[index]

    def _prefetch(self, i: int, inputs: Sequence[Any] | None, keys: list[Any]) -> None:
        for j in range(self._parts(inputs, i)):
            self.link.prefetch_activation(i, keys[i], j)

    def _meter(self, data: Any) -> AbstractContextManager:
        """Count the bytes a forward saves for backward when recording: activations, not parameters
        and not the pipeline's input batch (a micro-batch is a view of it, whose whole storage would
        otherwise be counted once per micro-batch)."""
        if not self.record:
            return nullcontext()
        batch = [t for t in pytree.tree_leaves(data) if isinstance(t, torch.Tensor)]
        return SavedTensorBytes(exclude=[*self.module.parameters(), *batch])

    def _account(self, times: StepTimes, action: Action, t0: float) -> None:
        t1 = time.perf_counter()
        times.compute += t1 - t0
        if self.record:
            times.per_action.append((repr(action), t0, t1))


def _as_parts(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _shape_keys(inputs: Sequence[Any] | None, count: int) -> list[Any]:
    """Per micro-batch, what fixes the shapes of every activation: the pipeline input's shape (each
    tensor's, by name, for a dict of keyword tensors)."""
    if inputs is None or len(inputs) != count:
        return [None] * count
    return [_shape_key(x) for x in inputs]


def _shape_key(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("train", tuple(x.shape), x.dtype)
    if isinstance(x, Mapping) and all(isinstance(v, torch.Tensor) for v in x.values()):
        return ("train", tuple((k, tuple(v.shape), v.dtype) for k, v in x.items()))
    return None
