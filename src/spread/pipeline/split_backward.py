"""A stage's backward in two parts: the input gradient now, the weight gradients later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) rest on one fact: the
previous stage waits only for the gradient of this stage's *inputs*. The gradients of the weights
are needed by nobody until the optimizer step, so they can be computed later, in the time a stage
would otherwise sit idle waiting for a neighbour. For a linear layer the two parts cost about the
same, so moving the second one fills most of a 1F1B pipeline's bubble.

How the split is done with autograd alone, on the autograd graph (so it works the same for a stage
of ``nn.Module`` layers and for a stage cut out of a ``torch.export`` graph, whose operations belong
to no module that is called), without recomputing anything:

* **Input pass** (:meth:`SplitBackward.backward_input`): the graph between the stage's outputs and
  its inputs is read first. Its nodes on a path to an input are the *input part*; those off it lead
  only to parameters. An input-part node with an edge off the input part is an *entry*: a pre-hook
  on it keeps the gradient that flows into it. Then ``torch.autograd.backward(roots, grads,
  inputs=stage inputs, retain_graph=True)``: the engine computes only what leads to the inputs, so
  every weight-gradient product is skipped; the graph stays alive.
* **Weight pass** (:meth:`SplitBackward.backward_weight`): per entry, ``backward(entry, kept
  gradient, inputs=the parameters off its input-part edges)``, which runs that node's weight outputs
  and the few nodes between it and its parameters (a transpose, a dtype cast). One call per entry,
  not one for all: a single call would also send an entry's kept gradient on through its input part
  into the entries below it, counting their weights twice.

When that is exact: every path from the outputs to a parameter leaves the input part at exactly one
entry, and the weight pass adds up the gradient of each such path once; the per-entry calls are
linear in their gradients, so a cast or transpose shared by two entries still adds up. It fails only
when a parameter is reached from an entry *through the input part too* (a layer called twice in a
chain, a weight tied between two layers of the stage): such parameters get their gradient in one
ordinary backward from the roots, restricted to them, in the weight pass: correct in every case,
merely not split. So do the parameters when no input wants a gradient (the first stage). The graph
is read again for every micro-batch (a graph may change between steps).

Activation checkpointing inside the stage is correct too but wasteful: every engine call of the
weight pass that unpacks a checkpointed region's saved tensors recomputes that region. A forward
hook on a parameter-owning module firing during the weight pass shows it; a warning says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge


@dataclass
class _Entry:
    """An input-part node with edges off the input part: what its weight pass starts from."""

    node: Any  # torch.autograd.graph.Node
    params: list[torch.Tensor]  # the parameters reached through its edges off the input part
    kept: tuple[torch.Tensor | None, ...] | None = None  # the gradient flowing into it (input pass)


@dataclass
class MicrobatchGraph:
    """What one micro-batch's input pass left for its weight pass."""

    entries: list[_Entry] = field(default_factory=list)
    rest: list[torch.Tensor] = field(default_factory=list)  # parameters left to one root run
    roots: list[torch.Tensor] = field(default_factory=list)
    root_grads: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def split_params(self) -> int:
        """How many parameters the weight pass computes from entries (not by the root run)."""
        return len({id(p) for e in self.entries for p in e.params})


class SplitBackward:
    """Split backward for one stage module; one :class:`MicrobatchGraph` per micro-batch in flight."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._in_weight_pass = False
        self._warned = False
        owners = [m for m in module.modules() if any(p.requires_grad for p in m.parameters(False))]
        self._handles = [m.register_forward_hook(self._on_forward) for m in owners]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _params(self) -> list[torch.Tensor]:
        """The stage's trainable parameters, read per micro-batch (a traced stage gains a program,
        with the same parameters, for every new input shape)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def _on_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        if self._in_weight_pass and not self._warned:
            self._warned = True
            warnings.warn(
                "a zero-bubble weight pass is recomputing checkpointed activations, once per entry "
                "node; use schedule='1f1b' with activation checkpointing",
                RuntimeWarning,
                stacklevel=2,
            )

    def backward_input(
        self,
        roots: torch.Tensor | Sequence[torch.Tensor],
        grads: torch.Tensor | Sequence[torch.Tensor | None] | None,
        stage_inputs: torch.Tensor | Sequence[torch.Tensor] | None,
    ) -> MicrobatchGraph:
        """The input pass: each stage input's ``.grad`` (those that require one); weights untouched,
        graph kept. Returns what the weight pass needs."""
        root_list = [roots] if isinstance(roots, torch.Tensor) else list(roots)
        if grads is None or isinstance(grads, torch.Tensor):
            grad_list: list[torch.Tensor | None] = [grads] * len(root_list)
        else:
            grad_list = list(grads)
        if stage_inputs is None:
            input_list: list[torch.Tensor] = []
        elif isinstance(stage_inputs, torch.Tensor):
            input_list = [stage_inputs]
        else:
            input_list = list(stage_inputs)
        input_list = [t for t in input_list if t.requires_grad]
        params = self._params()
        graph = MicrobatchGraph(roots=root_list, root_grads=grad_list)
        if not input_list or not any(r.grad_fn is not None for r in root_list):
            graph.rest = params  # nothing to split: no input pass, the weight pass does it all
            return graph
        graph.entries, graph.rest = _entries(root_list, input_list, params)
        for entry in graph.entries:
            entry.node.register_prehook(_keeper(entry))
        torch.autograd.backward(root_list, grad_list, inputs=input_list, retain_graph=True)
        return graph

    def backward_weight(
        self, graph: MicrobatchGraph, no_sync: Callable[[], AbstractContextManager] | None = None
    ) -> None:
        """The weight pass: accumulate every parameter's gradient into ``.grad``, then free the graph.

        ``no_sync``: a gradient exchange (hybrid) triggered at the end of a backward must happen once,
        after the last of this pass's engine calls; the calls before it run inside ``no_sync``."""
        runs: list[tuple[list, list, list]] = []  # (roots, their gradients, parameters)
        for entry in graph.entries:
            kept = entry.kept if entry.kept is not None else ()
            pairs = [(GradientEdge(entry.node, k), g) for k, g in enumerate(kept) if g is not None]
            if pairs:  # else no gradient reached it: nothing to add
                runs.append(([e for e, _ in pairs], [g for _, g in pairs], entry.params))
        rooted = [(r, g) for r, g in zip(graph.roots, graph.root_grads, strict=True) if r.requires_grad]
        if graph.rest and rooted:
            runs.append(([r for r, _ in rooted], [g for _, g in rooted], graph.rest))
        self._in_weight_pass = True
        try:
            for n, (roots, grads, params) in enumerate(runs):
                last = n == len(runs) - 1
                with nullcontext() if last or no_sync is None else no_sync():
                    torch.autograd.backward(roots, grads, inputs=params, retain_graph=not last)
        finally:
            self._in_weight_pass = False
        graph.entries.clear()
        graph.rest = []
        graph.roots, graph.root_grads = [], []


def _keeper(entry: _Entry) -> Callable[[tuple], None]:
    """A pre-hook keeping the gradient that reaches ``entry`` in the input pass (only the first time:
    the weight pass runs the node again)."""

    def keep(grad_outputs: tuple) -> None:
        if entry.kept is None:
            entry.kept = tuple(grad_outputs)

    return keep


def _entries(
    roots: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]
) -> tuple[list[_Entry], list[torch.Tensor]]:
    """The entries of the graph from ``roots`` to ``inputs``, each with the parameters it alone
    reaches off the input part, and the parameters left to the root run."""
    targets = {id(get_gradient_edge(t).node) for t in inputs}
    param_of = {id(get_gradient_edge(p).node): p for p in params}
    # Every node reachable from the roots, children first (an iterative post-order).
    order: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((nxt, False) for nxt, _ in node.next_functions if nxt is not None)
    # The input part: nodes with a path to an input. Off it, the parameters each node reaches.
    on_input: set[int] = set()
    reaches: dict[int, set[int]] = {}  # off the input part: id(node) -> ids of AccumulateGrad nodes
    for node in order:
        children = [nxt for nxt, _ in node.next_functions if nxt is not None]
        if id(node) in targets or any(id(c) in on_input for c in children):
            on_input.add(id(node))
            continue
        found = {id(node)} if id(node) in param_of else set()
        for c in children:
            found |= reaches[id(c)]
        reaches[id(node)] = found
    entries: list[_Entry] = []
    entries_of: dict[int, list[int]] = {}  # id(AccumulateGrad) -> indices of entries reaching it
    for node in order:
        if id(node) not in on_input or id(node) in targets:
            continue
        off = set()
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in on_input:
                off |= reaches[id(nxt)]
        if off:
            for acc in off:
                entries_of.setdefault(acc, []).append(len(entries))
            entries.append(_Entry(node, [param_of[a] for a in sorted(off)]))
    # A parameter two entries reach, one below the other in the input part: the upper entry's run
    # would pass its gradient down into the lower one and count it twice; the root run takes it.
    shared = [acc for acc, idx in entries_of.items() if len(idx) > 1]
    unsplit = {
        acc for acc in shared if _one_below_another([entries[i].node for i in entries_of[acc]], on_input)
    }
    for entry in entries:
        entry.params = [p for p in entry.params if id(get_gradient_edge(p).node) not in unsplit]
    entries = [e for e in entries if e.params]
    covered = {id(p) for e in entries for p in e.params}
    return entries, [p for p in params if id(p) not in covered]


def _one_below_another(nodes: list[Any], on_input: set[int]) -> bool:
    """Whether one of ``nodes`` lies below another within the input part."""
    wanted = {id(n) for n in nodes}
    for top in nodes:
        stack = [nxt for nxt, _ in top.next_functions if nxt is not None and id(nxt) in on_input]
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if id(node) in wanted:
                return True
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None and id(nxt) in on_input)
    return False
