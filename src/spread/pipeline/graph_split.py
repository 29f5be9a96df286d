"""Split any ``nn.Module`` into pipeline stages before named submodules, by tracing it.

Why a trace: a model that is not an ``nn.Sequential`` passes more than one value between its parts
(GPT-2 carries the hidden states and an attention mask from block to block, computed once before
the first block), and its ``forward`` does work between submodule calls (embedding sums, reshapes).
Cutting it at a module path therefore needs its data flow, which only a graph of the whole forward
gives. The graph comes from ``torch.export`` through ``torch.distributed.pipelining.pipeline`` (the
same tracer and splitter as torch's own pipelining, whose ``SplitPoint.BEGINNING`` this mirrors):
a marker op runs before each named module, the exported graph is cut at the markers into one
``GraphModule`` per stage, and the values live across a cut become the stage's inputs and outputs.

What this module adds to torch's splitter:

* the stage modules use the user's own ``Parameter`` objects (torch's splitter copies a parameter
  that two stages use, e.g. GPT-2's tied embedding and LM head): the optimizer built on the user's
  model steps what the stages train, and a tied parameter stays one parameter per process;
* a plan per stage of which values it receives, which it computes and which it passes on (a value
  made on stage 0 and used on stage 2 is relayed through stage 1); the pipeline's input is known to
  every stage (every rank of a pipeline replica reads the same batch), so it is never sent;
* the pipeline input is one tensor (``model(x)``) or a dict of keyword tensors (``model(**batch)``,
  Hugging Face style): each tensor is one input of the traced graph and goes to the stages that use
  it (``input_ids`` to the first, ``labels`` to the one that computes the model's loss);
* outputs that are not tensors (a Hugging Face ``past_key_values`` cache) are dropped: the last
  stage returns the model's output structure (``ModelOutput`` included) with ``None`` in their place.

An exported graph is specialised to its input's shape and to train/eval mode, so a split is made per
``(names, shapes, dtypes, training)``; every rank traces the same model on the same input, so every
rank gets the same split without talking to the others.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from spread.memory.forward_wrap import unwrap_forward, wrap_forward

_MARK = "pipeline_split_point"
_PREFIX = "model."


PipelineInput = torch.Tensor | Mapping[str, torch.Tensor]  # model(x), or model(**batch)


def input_names(x: Any) -> tuple[str, ...] | None:
    """The keyword names of a dict pipeline input (None for one tensor); refuses anything else."""
    if isinstance(x, torch.Tensor):
        return None
    if isinstance(x, Mapping) and x and all(isinstance(k, str) for k in x):
        odd = sorted(k for k, v in x.items() if not isinstance(v, torch.Tensor))
        if odd:
            raise TypeError(
                f"a model split at named modules takes a batch dict of tensors; {odd} are not tensors "
                "(pass non-tensor arguments through the model's config or a wrapper module)"
            )
        return tuple(x)
    raise TypeError(
        "a model split at named modules takes one tensor (e.g. input_ids) or a dict of keyword tensors "
        f"(e.g. {{'input_ids': ..., 'labels': ...}}) per batch, got {type(x).__name__}"
    )


def flat_input(x: PipelineInput) -> tuple[torch.Tensor, ...]:
    """The traced graph's inputs, in order: the tensor, or the dict's values in key order."""
    return (x,) if isinstance(x, torch.Tensor) else tuple(x.values())


class _Tracee(nn.Module):
    """What is traced: the user's model (as ``self.model``, so split points are ``model.<path>``)
    called through ``call`` with one tensor, or with keyword tensors named ``names``; its output
    flattened to tensors (the structure kept for the last stage)."""

    def __init__(
        self,
        model: nn.Module,
        call: Callable[..., Any] | None,
        names: tuple[str, ...] | None,
        found: list[OutputStructure],
    ) -> None:
        super().__init__()
        self.model = model
        self._call = [call if call is not None else model]  # in a list: never a registered submodule
        self._names = names
        self._found = (found,)  # the output structure goes here while tracing

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call = self._call[0]
        out = call(*inputs) if self._names is None else call(**dict(zip(self._names, inputs, strict=True)))
        leaves, spec = pytree.tree_flatten(out)
        self._found[0].append(OutputStructure(spec, tuple(isinstance(leaf, torch.Tensor) for leaf in leaves)))
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))


@dataclass(frozen=True)
class OutputStructure:
    """The model's output structure: puts the last stage's tensors back into it."""

    spec: pytree.TreeSpec
    kept: tuple[bool, ...]

    @property
    def num_tensors(self) -> int:
        return sum(self.kept)

    def __call__(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if k else None for k in self.kept], self.spec)


class StageProgram(nn.Module):
    """One stage of a traced model: ``forward(inputs, *received)`` runs the stage's graph on the
    pipeline's input tensors (:func:`flat_input`) and the values received from the previous stage; it
    returns the values the next stage needs (a tuple, in the order of :attr:`sends`) or, on the last
    stage, the model's output."""

    def __init__(
        self,
        graph: nn.Module,
        args: Sequence[str | int],
        receives: Sequence[str],
        produces: dict[str, int | None],
        sends: Sequence[str],
        rebuild: OutputStructure | None,
    ) -> None:
        super().__init__()
        self.graph = graph
        self.args = list(args)  # per graph argument: a carried value's name, or a pipeline input's index
        self.receives = list(receives)
        self.produces = produces  # value name -> index in the graph's output tuple (None: all of it)
        self.sends = list(sends)  # the last stage: the model's flat outputs, in order
        self.rebuild = rebuild
        self.user_tensors: list[torch.Tensor] = []  # the user's parameters and buffers it uses

    def forward(self, inputs: Sequence[torch.Tensor], *received: torch.Tensor) -> Any:
        if len(received) != len(self.receives):
            raise ValueError(f"stage expects {len(self.receives)} received values, got {len(received)}")
        env: dict[str, Any] = dict(zip(self.receives, received, strict=True))
        out = self.graph(*[inputs[a] if isinstance(a, int) else env[a] for a in self.args])
        for name, index in self.produces.items():
            env[name] = out if index is None else out[index]
        values = tuple(env[name] for name in self.sends)
        return self.rebuild(values) if self.rebuild is not None else values


@dataclass(frozen=True)
class GraphSplit:
    """A model traced at one input and cut into ``len(stages)`` stage programs."""

    stages: list[StageProgram]

    def stage_tensors(self, stage: int) -> list[torch.Tensor]:
        """The user's parameters and buffers stage ``stage`` uses, each once (constants the trace
        lifted out of the code are not the user's and not listed)."""
        return list(self.stages[stage].user_tensors)


def check_split_points(model: nn.Module, split_points: Sequence[str]) -> None:
    """Refuse names that are not submodules of ``model``, by value, before any tracing."""
    names = dict(model.named_modules(remove_duplicate=False))
    missing = [p for p in split_points if p not in names or p == ""]
    if missing:
        hint = ", ".join(n for n in list(names)[1:8])
        raise ValueError(
            f"split_points {missing!r} are not submodules of {type(model).__name__} (module paths "
            f"as in model.named_modules(), e.g. {hint}, ...)"
        )
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"split_points must be distinct module paths, got {list(split_points)!r}")


def split_model(
    model: nn.Module,
    split_points: Sequence[str],
    example: PipelineInput,
    call: Callable[..., Any] | None = None,
) -> GraphSplit:
    """Trace ``call(example)`` (default ``model``; ``call(**example)`` for a dict of keyword tensors)
    with ``torch.export`` and cut it before each module in ``split_points``: ``len(split_points) + 1``
    stages, in execution order.

    Raises ``ValueError`` for unknown module paths or a split point that is not called exactly once,
    and ``RuntimeError`` (from torch) when the model cannot be exported as one graph.
    """
    from torch.distributed.pipelining import pipe_split, pipeline

    check_split_points(model, split_points)
    marked = [model.get_submodule(p) for p in split_points]

    calls = dict.fromkeys(split_points, 0)

    def before(name: str, inner: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        pipe_split()
        return inner(*args, **kwargs)

    names = input_names(example)
    found: list[OutputStructure] = []
    tracee = _Tracee(model, call, names, found)
    for name, module in zip(split_points, marked, strict=True):
        wrap_forward(module, _MARK, partial(before, name))
    try:
        pipe = pipeline(tracee, flat_input(example))
    finally:
        for module in marked:
            unwrap_forward(module, _MARK)
    expected = len(split_points) + 1
    if pipe.num_stages != expected or any(n != 1 for n in calls.values()):
        raise ValueError(
            f"split_points {list(split_points)!r} cut {type(model).__name__}'s forward into "
            f"{pipe.num_stages} stages, not {expected} (calls per split point: {calls}): each split "
            f"point must name a module that forward calls exactly once"
        )
    rebuild = found[-1]
    return GraphSplit(_programs(pipe.split_gm, model, rebuild))


def _programs(root: fx.GraphModule, model: nn.Module, rebuild: OutputStructure) -> list[StageProgram]:
    """One :class:`StageProgram` per ``call_module`` node of the split's root graph."""
    calls = [n for n in root.graph.nodes if n.op == "call_module"]
    output = next(n for n in root.graph.nodes if n.op == "output")
    index_of = {n: i for i, n in enumerate(n for n in root.graph.nodes if n.op == "placeholder")}
    stage_of = {n: s for s, n in enumerate(calls)}

    def producer(node: fx.Node) -> int:  # the stage computing node's value; -1 for the input
        if node.op == "placeholder":
            return -1
        if node.op == "call_function" and node.target is operator.getitem:
            return producer(node.args[0])  # type: ignore[arg-type]
        if node in stage_of:
            return stage_of[node]
        raise ValueError(
            f"cannot pipeline: the split graph has an operation between stages ({node.format_node()})"
        )

    def values(args: Any) -> list[fx.Node]:
        found: list[fx.Node] = []
        fx.node.map_arg(args, found.append)
        return found

    finals = values(output.args)
    uses: list[tuple[int, fx.Node]] = [(s, v) for s, n in enumerate(calls) for v in values(n.args)]
    uses += [(len(calls) - 1, v) for v in finals]
    for s, n in enumerate(calls):
        if n.kwargs:
            raise ValueError(f"stage {s} of the split graph takes keyword arguments; not supported")
    # carried[b]: the values made before stage b and used at or after it (what b receives), in graph order.
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    carried: list[list[fx.Node]] = [[]]
    for b in range(1, len(calls)):
        live = {v for s, v in uses if s >= b and 0 <= producer(v) < b}
        carried.append(sorted(live, key=order.__getitem__))
    programs = []
    for s, call in enumerate(calls):
        graph = root.get_submodule(str(call.target))
        user_tensors = _bind_user_tensors(graph, model)
        getitems = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
        produces: dict[str, int | None] = (
            {u.name: int(u.args[1]) for u in getitems}
            if getitems and len(getitems) == len(call.users)
            else {call.name: None}
        )
        last = s == len(calls) - 1
        sends = [v.name for v in (finals if last else carried[s + 1])]
        programs.append(
            StageProgram(
                graph,
                [index_of[a] if a.op == "placeholder" else a.name for a in values(call.args)],
                [v.name for v in carried[s]],
                produces,
                sends,
                rebuild if last else None,
            )
        )
        programs[-1].user_tensors = user_tensors
    return programs


def _bind_user_tensors(stage: nn.Module, model: nn.Module) -> list[torch.Tensor]:
    """Point the stage's parameters and buffers at the user's own objects, by name (torch's splitter
    gives a parameter used by two stages a copy in one of them); return those objects, each once."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    bound: dict[int, torch.Tensor] = {}
    for name, _ in list(stage.named_parameters(remove_duplicate=False)):
        path = name.removeprefix(_PREFIX)
        if path not in params:
            raise ValueError(f"the traced stage holds a parameter {path!r} that the model does not have")
        _set(stage, name, params[path])
        bound[id(params[path])] = params[path]
    for name, _ in list(stage.named_buffers(remove_duplicate=False)):
        path = name.removeprefix(_PREFIX)
        if path in buffers:  # else a constant the trace lifted out of the code
            _set(stage, name, buffers[path])
            bound[id(buffers[path])] = buffers[path]
    return list(bound.values())


def _set(root: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    if isinstance(value, nn.Parameter):
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value


class GraphStage(nn.Module):
    """This rank's stage of a model split at ``split_points``: the stage program of every trace made
    so far (one per input names, shapes and dtypes, and train/eval mode), chosen by the pipeline
    input's key.

    Its parameters are the user's parameters the stage uses (each trace's program is a child). Call
    :meth:`prepare` with every micro-batch's input before running it: tracing happens there, outside
    any autocast or saved-tensor context of the step.
    """

    def __init__(
        self,
        model: nn.Module,
        split_points: Sequence[str],
        stage: int,
        call: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self._model = (model,)  # in a tuple: not a submodule (its parameters are not all this stage's)
        self.split_points = list(split_points)
        self.stage = stage
        self._call = (call,)
        self._programs: dict[tuple, StageProgram] = {}
        self._rebuilds: dict[tuple, OutputStructure | None] = {}

    def key(self, x: PipelineInput) -> tuple:
        names = input_names(x)
        shapes = tuple((tuple(t.shape), t.dtype) for t in flat_input(x))
        return (names, shapes, self._model[0].training)

    def prepare(self, x: PipelineInput) -> GraphSplit | None:
        """Trace the model for ``x``'s key unless done already; the new split, or None."""
        key = self.key(x)
        if key in self._programs:
            return None
        split = split_model(self._model[0], self.split_points, x, self._call[0])
        program = split.stages[self.stage]
        self.add_module(f"trace{len(self._programs)}", program)
        self._programs[key] = program
        self._rebuilds[key] = split.stages[-1].rebuild
        return split

    def rebuild(self, x: PipelineInput) -> OutputStructure:
        """How the model's output for ``x`` is put together from its tensors (every stage knows)."""
        found = self._rebuilds[self.key(x)]
        assert found is not None
        return found

    def num_received(self, pipeline_input: Any) -> int:
        return len(self._programs[self.key(pipeline_input)].receives)

    def forward(self, x: PipelineInput, *received: torch.Tensor) -> Any:
        return self._programs[self.key(x)](flat_input(x), *received)
