"""A stage's backward in two parts: the input gradient now, the weight gradients later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) rest on one fact: the
previous stage waits only for the gradient of this stage's *input*. The gradients of the weights
are needed by nobody until the optimizer step, so they can be computed later, in the time a stage
would otherwise sit idle waiting for a neighbour. For a linear layer the two parts cost about the
same, so moving the second one fills most of a 1F1B pipeline's bubble.

How the split is done with autograd alone, without recomputing anything:

* **Forward** (:meth:`SplitBackward.forward`): forward hooks on every module that owns parameters
  note its output tensors' gradient edges, and a pre-hook on each such autograd node keeps the
  gradient that flows into it during the input pass.
* **Input pass** (:meth:`SplitBackward.backward_input`): ``torch.autograd.backward(root, grad,
  inputs=[stage input], retain_graph=True)``. The engine computes only what leads to the input, so
  the weight-gradient products of every layer are skipped; the pre-hooks keep each module's output
  gradient; the graph stays alive.
* **Weight pass** (:meth:`SplitBackward.backward_weight`): per module, ``backward(module output
  edges, kept gradients, inputs=module's own parameters)``, which runs only that module's few nodes.
  One call per module, not one for all: a single call would also send each module's kept gradient
  on through its input into the earlier modules, counting their weights twice.

When that is exact: a module's parameters must reach the loss only through that module's outputs.
Each micro-batch's graph is checked (:func:`_splittable`, ~0.5 ms for two GPT blocks and an LM head,
so a graph that changes from step to step is safe): every autograd node that consumes one of the
module's parameters must lie between the module's outputs and its inputs.
Parameters that fail (tied weights used by two modules, a module called twice, a parameter used
functionally elsewhere), parameters of modules whose nodes the input pass did not reach, and
parameters owned by no module that ran, all get their gradient in one ordinary backward from the
root, restricted to them, in the weight pass: correct in every case, merely not split.

Activation checkpointing inside the stage is correct too but wasteful: every engine call of the
weight pass that unpacks a checkpointed region's saved tensors recomputes that region. A forward
hook firing during the weight pass shows it; a warning says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class _Call:
    """One run of a parameter-owning module in one micro-batch's forward."""

    module: nn.Module
    inputs: list[torch.Tensor]  # tensor inputs that require grad (where its graph region stops)
    edges: list[GradientEdge]  # gradient edges of its outputs that require grad


@dataclass
class MicrobatchGraph:
    """What one micro-batch's forward left for its split backward."""

    calls: list[_Call] = field(default_factory=list)
    # (id(edge node), output_nr) -> the gradient that reached it in the input pass (None: none did);
    # an edge whose node the input pass never ran has no entry
    kept: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)
    hooked: set[tuple[int, int]] = field(default_factory=set)
    split: set[int] = field(default_factory=set)  # ids of the modules whose weight pass may be split
    root: torch.Tensor | None = None
    root_grad: torch.Tensor | None = None


def _edge_key(edge: GradientEdge) -> tuple[int, int]:
    return id(edge.node), edge.output_nr


class SplitBackward:
    """Split backward for one stage module; one :class:`MicrobatchGraph` per micro-batch in flight."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.owners = [m for m in module.modules() if any(p.requires_grad for p in m.parameters(False))]
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._recording: MicrobatchGraph | None = None
        self._in_weight_pass = False
        self._warned = False
        self._handles = [m.register_forward_hook(self._on_forward) for m in self.owners]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def forward(self) -> Iterator[MicrobatchGraph]:
        """Record the module calls of the forward run inside this block."""
        graph = MicrobatchGraph()
        self._recording = graph
        try:
            yield graph
        finally:
            self._recording = None

    def _on_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        graph = self._recording
        if graph is None and self._in_weight_pass and not self._warned:
            self._warned = True
            warnings.warn(
                "a zero-bubble weight pass is recomputing checkpointed activations, once per module; "
                "use schedule='1f1b' with activation checkpointing",
                RuntimeWarning,
                stacklevel=2,
            )
        if graph is None or not torch.is_grad_enabled():
            return  # inference, or a recomputation in backward: nothing to split
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        edges = [
            get_gradient_edge(t)
            for t in outputs
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None
        ]
        hooked = graph.hooked
        for edge in edges:
            key = _edge_key(edge)
            if key in hooked:
                continue
            hooked.add(key)

            def keep(grad_outputs: tuple, key: tuple[int, int] = key, nr: int = edge.output_nr) -> None:
                graph.kept[key] = grad_outputs[nr]

            edge.node.register_prehook(keep)
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        graph.calls.append(_Call(module, inputs, edges))

    def backward_input(
        self,
        graph: MicrobatchGraph,
        root: torch.Tensor,
        grad: torch.Tensor | None,
        stage_input: torch.Tensor | None,
    ) -> None:
        """The input pass: ``stage_input.grad`` (when it wants one); weights untouched, graph kept."""
        graph.root, graph.root_grad = root, grad
        if stage_input is not None and stage_input.requires_grad:
            # Without an input pass no output gradient is kept, so nothing could be split anyway.
            graph.split = _splittable(graph, root, self.owners)
            torch.autograd.backward(root, grad, inputs=[stage_input], retain_graph=True)

    def backward_weight(
        self, graph: MicrobatchGraph, no_sync: Callable[[], AbstractContextManager] | None = None
    ) -> None:
        """The weight pass: accumulate every parameter's gradient into ``.grad``, then free the graph.

        ``no_sync``: a gradient exchange (hybrid) triggered at the end of a backward must happen once,
        after the last of this pass's engine calls; the calls before it run inside ``no_sync``."""
        if graph.root is None:
            return  # nothing required a gradient (backward_input was not run)
        runs: list[tuple[list, list, list]] = []  # (roots, their gradients, parameters)
        covered: set[int] = set()
        for call in graph.calls:
            if id(call.module) not in graph.split:  # (a module that ran twice is never in it)
                continue
            if any(_edge_key(e) not in graph.kept for e in call.edges):
                continue  # the input pass did not run all its outputs' nodes: the root run decides
            pairs = [(e, graph.kept[_edge_key(e)]) for e in call.edges]
            pairs = [(e, g) for e, g in pairs if g is not None]
            if not pairs:
                continue  # no gradient reached its outputs
            params = [p for p in call.module.parameters(False) if p.requires_grad]
            runs.append(([e for e, _ in pairs], [g for _, g in pairs], params))
            covered.update(id(p) for p in params)
        rest = [p for p in self.params if id(p) not in covered]
        if rest:
            runs.append(([graph.root], [graph.root_grad], rest))
        self._in_weight_pass = True
        try:
            for n, (roots, grads, params) in enumerate(runs):
                last = n == len(runs) - 1
                with nullcontext() if last or no_sync is None else no_sync():
                    torch.autograd.backward(roots, grads, inputs=params, retain_graph=not last)
        finally:
            self._in_weight_pass = False
        graph.calls.clear()
        graph.kept.clear()
        graph.hooked.clear()
        graph.split.clear()
        graph.root = graph.root_grad = None


def _splittable(graph: MicrobatchGraph, root: torch.Tensor, owners: list[nn.Module]) -> set[int]:
    """Ids of the modules whose weight gradients the weight pass may compute from their outputs.

    A module qualifies when it ran once, and every autograd node that consumes one of its own
    parameters lies in its own part of the graph: reachable from its outputs without passing
    through its inputs. Then its outputs' gradients are all the loss says about its parameters.
    """
    if root.grad_fn is None:
        return set()
    consumers: dict[int, set[int]] = {}  # id(AccumulateGrad node) -> ids of nodes with an edge to it
    seen: set[int] = set()
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt).__name__ == "AccumulateGrad":
                consumers.setdefault(id(nxt), set()).add(id(node))
            stack.append(nxt)
    runs: dict[int, int] = {}
    for call in graph.calls:
        runs[id(call.module)] = runs.get(id(call.module), 0) + 1
    ok: set[int] = set()
    for call in graph.calls:
        module = call.module
        if runs[id(module)] != 1 or not call.edges:
            continue
        stop = {id(t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node) for t in call.inputs}
        region: set[int] = set()
        stack = [e.node for e in call.edges]
        while stack:
            node = stack.pop()
            if id(node) in region or id(node) in stop:
                continue
            region.add(id(node))
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        params = [p for p in module.parameters(False) if p.requires_grad]
        if all(consumers.get(id(get_gradient_edge(p).node), set()) <= region for p in params):
            ok.add(id(module))
    return ok
