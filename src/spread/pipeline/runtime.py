"""Execute one stage's schedule: forwards and backwards of micro-batches, transfers in between.

The runner is the only code that touches autograd across stages. A stage's forward output is sent
detached; the next stage makes its copy a leaf that requires grad, so after that stage's backward the
leaf's ``.grad`` is exactly the gradient to send back; the sending stage then resumes autograd with
``torch.autograd.backward(output, grad)``. The last stage's backward starts from its loss, scaled by
the micro-batch's share of the global batch, so summed gradients are those of the global mean loss.

Gradient exchange between data-parallel replicas (hybrid) is left to the caller through ``no_sync``:
every backward but the stage's last one runs inside it, and the last one triggers the exchange
(overlapped with that backward by :class:`~spread.comm.GradientReducer`).

Zero-bubble schedules split a backward into ``backward_input`` and ``backward_weight``
(:class:`~spread.pipeline.split_backward.SplitBackward`); the forward of such a schedule records
what the split needs, and the weight part counts as the micro-batch's backward above.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spread.memory import SavedTensorBytes
from spread.pipeline.p2p import StageLink
from spread.pipeline.schedules import Action, Op
from spread.pipeline.split_backward import MicrobatchGraph, SplitBackward

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]
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
        self, module: nn.Module, stage: int, stages: int, link: StageLink, *, record: bool = False
    ) -> None:
        self.module, self.stage, self.stages, self.link = module, stage, stages, link
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
        received: dict[int, torch.Tensor] = {}
        wants_grad: dict[int, bool] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        times = StepTimes()
        started = time.perf_counter()
        keys = _shape_keys(inputs, len(weights))
        recv_order = [a.microbatch for a in actions if a.op is Op.RECV_ACT]
        if recv_order:  # post the first receive now when its shape is known from an earlier step
            self.link.prefetch_activation(recv_order[0], keys[recv_order[0]])
        received_count = 0
        saved: dict[int, int] = {}  # micro-batch -> bytes its forward saved for backward (recorded runs)
        live_saved = 0
        for a in actions:
            i = a.microbatch
            if a.op is Op.RECV_ACT:
                data, wants_grad[i] = self.link.recv_activation(i, keys[i])
                received[i] = data.requires_grad_(wants_grad[i])
                received_count += 1
                if received_count < len(recv_order):  # overlap the next transfer with this compute
                    nxt = recv_order[received_count]
                    self.link.prefetch_activation(nxt, keys[nxt])
            elif a.op is Op.SEND_ACT:
                self.link.send_activation(outputs[i], i, keys[i])
                if outputs[i].requires_grad:  # its gradient may arrive while we compute others
                    self.link.prefetch_grad(outputs[i], i)
            elif a.op is Op.RECV_GRAD:
                if outputs[i].requires_grad:
                    grads[i] = self.link.recv_grad(outputs[i], i)
            elif a.op is Op.SEND_GRAD:
                if wants_grad.get(i):
                    grad = received[i].grad
                    self.link.send_grad(grad if grad is not None else torch.zeros_like(received[i]), i)
                received.pop(i, None)
            elif a.op is Op.FORWARD:
                t0 = time.perf_counter()
                x = inputs[i] if self.is_first else received[i]  # type: ignore[index]
                with (
                    self._meter(x if self.is_first else None) as meter,
                    split.forward() if split is not None else nullcontext() as graph,
                    forward_context() if forward_context is not None else nullcontext(),
                ):
                    out = self.module(x)
                    if self.is_last:
                        loss = loss_fn(out, targets[i])  # type: ignore[misc,index]
                if graph is not None:
                    graphs[i] = graph
                if meter is not None:
                    saved[i] = meter.bytes
                    live_saved += meter.bytes
                    times.peak_saved_bytes = max(times.peak_saved_bytes, live_saved)
                if self.is_last:
                    if on_loss is not None:
                        on_loss(i, out, targets[i], loss)  # type: ignore[index]
                    losses[i] = loss
                else:
                    outputs[i] = out
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
                        out = outputs.pop(i)
                        if out.requires_grad:
                            torch.autograd.backward(out, grads.pop(i))
                self._account(times, a, t0)
            elif a.op is Op.BACKWARD_INPUT:
                t0 = time.perf_counter()
                assert split is not None
                if self.is_last:
                    root, grad = losses.pop(i) * weights[i], None
                else:
                    root, grad = outputs.pop(i), grads.pop(i, None)
                if root.requires_grad:
                    stage_input = received.get(i) if wants_grad.get(i) else None
                    with nullcontext() if no_sync is None else no_sync():
                        split.backward_input(graphs[i], root, grad, stage_input)
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

    def forward(self, inputs: Sequence[Any]) -> list[torch.Tensor] | None:
        """Inference: run every micro-batch through this stage (no gradients). The last stage returns
        the outputs, the others None."""
        outputs = []
        with torch.no_grad():
            for i in range(len(inputs)):
                x = inputs[i] if self.is_first else self.link.recv_activation(i)[0]
                out = self.module(x)
                if self.is_last:
                    outputs.append(out)
                else:
                    self.link.send_activation(out, i)
        self.link.wait_sends()
        return outputs if self.is_last else None

    def _meter(self, data: Any) -> AbstractContextManager:
        """Count the bytes a forward saves for backward when recording: activations, not parameters
        and not the pipeline's input batch (a micro-batch is a view of it, whose whole storage would
        otherwise be counted once per micro-batch)."""
        if not self.record:
            return nullcontext()
        exclude = [*self.module.parameters(), *([data] if isinstance(data, torch.Tensor) else [])]
        return SavedTensorBytes(exclude=exclude)

    def _account(self, times: StepTimes, action: Action, t0: float) -> None:
        t1 = time.perf_counter()
        times.compute += t1 - t0
        if self.record:
            times.per_action.append((repr(action), t0, t1))


def _shape_keys(inputs: Sequence[Any] | None, count: int) -> list[Any]:
    """Per micro-batch, what fixes the shapes of every activation: the pipeline input's shape."""
    if inputs is None or len(inputs) != count:
        return [None] * count
    return [("train", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else None for x in inputs]
