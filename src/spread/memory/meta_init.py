"""Models built on the meta device, given exactly the values the same code draws on a real one.

Why: a model built under ``torch.device("meta")`` has shapes and no values, so no process ever holds
all of it; but then nothing was drawn, and initialising each shard on its own (FSDP2's
``to_empty`` and ``reset_parameters`` on the shards) gives other values than one device running
the same code, so training no longer equals one device. Here every aten operation touching meta
tensors while a :class:`MetaInitRecorder` is active is recorded, with the random generator's state
wherever something else than these operations changed it (a ``manual_seed``). :meth:`MetaInit.replay`
runs the operations again on a real device in the same order: the random draws come out of the
same generator in the same sequence and give the same values, bit for bit.

Replay keeps a tensor's storage only while a later operation needs it and hands each requested
tensor's final value to a callback after its last operation (a sharded strategy keeps its chunk and
lets the rest go), so about one tensor's values are alive at a time, whatever the model's size.
Operations whose results are overwritten before anything reads them (a layer's own initialisation
redone by a model-wide one, as in Hugging Face models) are skipped; the random ones among them still
draw, into a scratch tensor dropped at once, so that every later draw stays the same.

Exact: values made by torch operations on the meta tensors from the replay device's default
generator (``torch.nn.init``, ``reset_parameters``, ``torch.randn``, ``copy.deepcopy``, casts,
buffers computed from other tensors). Refused with :class:`~spread.errors.SpreadError`: a random
operation on meta tensors with a generator of its own; a random draw on real tensors from the same
generator after a meta one with no seed set in between (one device would have drawn it later in
the sequence, from another state); an operation reading a meta tensor made before recording
started. A real tensor an operation copied into a meta one is read at replay, not when copied.

``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_`` return at once
on a meta tensor, running no operation; while recording, ``torch.nn.init`` holds versions that
record the call instead (``trunc_normal_`` through its helper, which every caller reaches; the other
three only when looked up in ``torch.nn.init``, not through a reference taken earlier, as
transformers' ``initialization`` module keeps: such a call is lost, and the values are not exact).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from spread.errors import SpreadError

# In-place operations that write every element of ``self`` without reading it (when ``self`` spans
# its whole storage): earlier values of that storage are dead.
_OVERWRITING = frozenset(
    {
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "bernoulli_",
        "fill_",
        "zero_",
        "copy_",
    }
)
_RUN, _DRAW_ONLY = 1, 2  # what replay does with an operation (absent: skip it)
# torch.nn.init functions that return at once on a meta tensor, with no operation to record (name:
# whether they draw); the recorder records calls to them instead. trunc_normal_ is caught in its
# helper, which every caller reaches (transformers keeps references to the public functions); the
# others only when called as torch.nn.init.<name>.
_SKIPPING_META = {"_no_grad_trunc_normal_": True, "orthogonal_": True, "sparse_": True, "dirac_": False}


def default_generator(device: torch.device) -> torch.Generator:
    """The generator random operations on ``device`` draw from when given none."""
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device)
    index = device.index if device.index is not None else module.current_device()
    return module.default_generators[index]


def become(t: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``t`` (a parameter or buffer on the meta device) hold ``value``, keeping its identity:
    the modules, optimizers and strategies holding ``t`` see a real tensor (its Python attributes stay).
    """
    new = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
    torch.utils.swap_tensors(t, new)
    t.__dict__.update(new.__dict__)  # swapped along with the rest: take the attributes back


class _MetaDevice:
    """Stands for ``torch.device("meta")`` in a recorded operation's arguments (the replay device)."""


_META_DEVICE = _MetaDevice()


@dataclass(frozen=True, slots=True)
class _Ref:
    """A meta tensor in a recorded operation: which storage, and how it views it."""

    key: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    nbytes: int  # of the whole storage

    @classmethod
    def of(cls, t: torch.Tensor) -> _Ref:
        storage = t.untyped_storage()
        return cls(
            storage._cdata,
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            int(t.storage_offset()),
            storage.nbytes(),
        )

    @property
    def spans_storage(self) -> bool:
        """Whether this view is the whole storage, contiguously (writing it all leaves nothing old)."""
        expected, numel = [], 1
        for n in reversed(self.shape):
            expected.append(numel)
            numel *= n
        dense = all(
            s == e for n, s, e in zip(self.shape, self.stride, reversed(expected), strict=True) if n > 1
        )
        return self.offset == 0 and dense and numel * self.dtype.itemsize == self.nbytes

    def view(self, storage: torch.UntypedStorage) -> torch.Tensor:
        t = torch.empty(0, dtype=self.dtype, device=storage.device)
        return t.set_(storage, self.offset, self.shape, self.stride)


@dataclass(slots=True)
class _Op:
    func: Any  # an OpOverload
    flat: list[Any]  # arguments, flattened: _Ref for meta tensors, _META_DEVICE for the meta device
    spec: Any  # their pytree spec
    created: dict[int, _Ref]  # output position -> the new storage it made
    written: frozenset[int]  # argument positions the operation writes into
    overwritten: frozenset[int]  # storages written whole without being read (and created ones)
    writes: frozenset[int]  # storages written or created
    reads: frozenset[int]  # storages read (besides those written into, whose old values are dead)
    random: bool
    state: torch.Tensor | None = None  # the generator's state to set before running it


class MetaInit:
    """What a :class:`MetaInitRecorder` recorded: the operations that gave meta tensors their values."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = default_generator(device)
        self._ops: list[_Op] = []
        self._inserted: list[tuple[int, list[_Op]]] = []  # (position, operations run there)
        self._storages: dict[int, torch.UntypedStorage] = {}  # keeps the keys' storages alive
        self._created_at: dict[int, int] = {}  # storage -> position of the operation creating it
        self._registered_at: dict[int, int] = {}  # id(module) -> position of its last registration
        self._last_state: torch.Tensor | None = None
        self.real_draws: list[str] = []  # real draws one device would have made from another state
        self.reseeded_at_end = False  # the generator was set after the last meta draw
        self.peak_bytes = 0  # the most bytes of storage the last replay held at once

    # -- what was recorded -------------------------------------------------------------------------
    def created(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (a meta tensor) got its storage from a recorded operation."""
        return t.is_meta and t.untyped_storage()._cdata in self._created_at

    @property
    def position(self) -> int:
        return len(self._ops)

    def registered_at(self, module: nn.Module) -> int | None:
        """The position after ``module``'s last parameter, buffer or submodule assignment."""
        return self._registered_at.get(id(module))

    @property
    def states(self) -> list[torch.Tensor]:
        """The generator states replay sets, in order (a strategy makes every rank use the chief's)."""
        return [op.state for op in self._operations() if op.state is not None]

    def _operations(self) -> list[_Op]:
        if not self._inserted:
            return self._ops
        merged: list[_Op] = []
        inserts = sorted(self._inserted, key=lambda item: item[0])
        j = 0
        for i, op in enumerate([*self._ops, None]):
            while j < len(inserts) and inserts[j][0] == i:
                merged.extend(inserts[j][1])
                j += 1
            if op is not None:
                merged.append(op)
        return merged

    # -- recording ---------------------------------------------------------------------------------
    def _record(
        self, func: Any, args: tuple, kwargs: dict, out: Any, into: list[_Op], position: int
    ) -> _Op | None:
        flat_in, spec = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        written_ids = {id(t) for t in _written_arguments(func, args, kwargs)}
        flat: list[Any] = []
        written: set[int] = set()
        overwritten: set[int] = set()
        writes: set[int] = set()
        reads: set[int] = set()
        overwrites = func._overloadpacket.__name__ in _OVERWRITING
        for i, x in enumerate(flat_in):
            if isinstance(x, torch.Tensor) and x.is_meta:
                ref = self._keep(x)
                flat.append(ref)
                if id(x) in written_ids:
                    written.add(i)
                    writes.add(ref.key)
                    if overwrites and ref.spans_storage:
                        overwritten.add(ref.key)
                        continue
                reads.add(ref.key)
            elif isinstance(x, torch.device) and x.type == "meta":
                flat.append(_META_DEVICE)
            else:
                flat.append(x)
        created: dict[int, _Ref] = {}
        for i, y in enumerate(flat_out):
            if isinstance(y, torch.Tensor) and y.is_meta and y.untyped_storage()._cdata not in self._storages:
                ref = self._keep(y)
                created[i] = ref
                self._created_at.setdefault(ref.key, position)
                writes.add(ref.key)
                overwritten.add(ref.key)
        if not written and not created:
            return None  # a view, or a query: replay rebuilds views from their storages
        op = _Op(
            func,
            flat,
            spec,
            created,
            frozenset(written),
            frozenset(overwritten),
            frozenset(writes),
            frozenset(reads),
            torch.Tag.nondeterministic_seeded in func.tags,
        )
        into.append(op)
        return op

    def _record_call(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, random: bool, into: list[_Op], position: int
    ) -> _Op:
        """A Python function writing its first argument, a meta tensor, which it leaves untouched on
        the meta device (``torch.nn.init.trunc_normal_`` and the like): replayed by calling it."""
        flat_in, spec = tree_flatten((args, kwargs))
        target = self._keep(args[0])
        flat = [self._keep(x) if isinstance(x, torch.Tensor) and x.is_meta else x for x in flat_in]
        overwritten = frozenset({target.key}) if target.spans_storage else frozenset()
        reads = frozenset({r.key for r in flat if isinstance(r, _Ref)} - overwritten)
        op = _Op(fn, flat, spec, {}, frozenset({0}), overwritten, frozenset({target.key}), reads, random)
        into.append(op)
        return op

    def _keep(self, t: torch.Tensor) -> _Ref:
        ref = _Ref.of(t)
        self._storages.setdefault(ref.key, t.untyped_storage())
        return ref

    # -- replay ------------------------------------------------------------------------------------
    def replay(
        self,
        targets: Sequence[torch.Tensor],
        on_value: Callable[[int, torch.Tensor], None],
        *,
        states: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Run the recorded operations on :attr:`device` and call ``on_value(i, value)`` once for
        each meta tensor ``targets[i]`` with its final value (a tensor on the device, valid during the
        call only: copy what you keep). ``states`` replaces :attr:`states` (the chief's, on every
        rank). Afterwards the generator is where one device's would be after the recorded draws,
        unless it was set after the last of them (then it is left as it was)."""
        ops = self._operations()
        drawn_states = states if states is not None else self.states
        state_iter = iter(drawn_states)
        wanted: dict[int, list[tuple[int, _Ref]]] = {}
        for i, t in enumerate(targets):
            if not self.created(t):
                raise SpreadError(f"a meta tensor of shape {tuple(t.shape)} was not made while recording")
            ref = _Ref.of(t)
            wanted.setdefault(ref.key, []).append((i, ref))
        plan = _plan(ops, set(wanted))
        last_use: dict[int, int] = {}
        for i, op in enumerate(ops):
            if plan[i] == _RUN:
                for key in op.reads | op.writes:
                    last_use[key] = i
            elif plan[i] == _DRAW_ONLY:
                for key in op.reads:
                    last_use[key] = i
        before = self.generator.get_state()
        real: dict[int, torch.UntypedStorage] = {}
        self.peak_bytes = 0
        try:
            with torch.no_grad():
                for i, op in enumerate(ops):
                    if op.state is not None:
                        self.generator.set_state(next(state_iter))
                    if plan[i] == 0:
                        continue
                    self._run(op, plan[i] == _RUN, real, position=i)
                    self.peak_bytes = max(self.peak_bytes, sum(r.nbytes() for r in real.values()))
                    for key in (op.reads | op.writes) if plan[i] == _RUN else op.reads:
                        if last_use.get(key) != i:
                            continue
                        storage = real.pop(key, None)
                        if storage is not None:
                            for index, ref in wanted.pop(key, []):
                                on_value(index, ref.view(storage))
            missing = [i for refs in wanted.values() for i, _ in refs]
            if missing:
                raise SpreadError(f"replay gave no value to {len(missing)} requested meta tensors")
        finally:
            real.clear()
        if self.reseeded_at_end:
            self.generator.set_state(before)

    def _run(self, op: _Op, keep: bool, real: dict[int, torch.UntypedStorage], position: int) -> None:
        args: list[Any] = []
        for i, x in enumerate(op.flat):
            if isinstance(x, _Ref):
                if not keep and i in op.written:  # only drawing: a scratch target of the same layout
                    storage = torch.UntypedStorage(x.nbytes, device=self.device)
                elif x.key in real:
                    storage = real[x.key]
                elif x.key in op.overwritten:
                    storage = real[x.key] = torch.UntypedStorage(x.nbytes, device=self.device)
                else:
                    raise SpreadError(
                        f"recorded operation #{position} ({op.func}) reads a meta tensor of shape "
                        f"{x.shape} that was made before recording started, or after this operation"
                    )
                args.append(x.view(storage))
            elif x is _META_DEVICE:
                args.append(self.device)
            else:
                args.append(x)
        call_args, call_kwargs = tree_unflatten(args, op.spec)
        out = op.func(*call_args, **call_kwargs)
        if keep and op.created:
            flat_out, _ = tree_flatten(out)
            for i, ref in op.created.items():
                real[ref.key] = flat_out[i].untyped_storage()


def _plan(ops: list[_Op], wanted: set[int]) -> list[int]:
    """Which operations to run (``_RUN``), to run for their draws only (``_DRAW_ONLY``) or to skip:
    backwards from the wanted storages' final values, an operation is needed when it writes a storage
    whose value something later needs."""
    live = set(wanted)
    plan = [0] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.writes & live:
            plan[i] = _RUN
            live -= op.overwritten
            live |= op.reads
        elif op.random:
            plan[i] = _DRAW_ONLY
            live |= op.reads - op.writes
    return plan


def _written_arguments(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an operation writes into (its ``Tensor(a!)`` arguments: an in-place one's ``self``,
    ``out``)."""
    written: list[torch.Tensor] = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written.extend(v for v in values if isinstance(v, torch.Tensor))
    return written


def _explicit_generator(args: tuple, kwargs: dict) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    return any(isinstance(x, torch.Generator) for x in flat)


class MetaInitRecorder(TorchDispatchMode):
    """Context manager: record every operation on meta tensors run inside into :attr:`recording`
    (other operations run untouched). ``device``: where the recording will be replayed; draws from
    its default generator are the ones tracked."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.recording = MetaInit(torch.device(device))
        self._inserting: list[_Op] | None = None
        self._insert_position = 0
        self._hooks: list[Any] = []
        self._patched: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> MetaInitRecorder:
        recording = self.recording

        def registered(module: nn.Module, name: str, value: Any) -> None:
            if self._inserting is None:
                recording._registered_at[id(module)] = recording.position

        self._hooks = [
            nn.modules.module.register_module_parameter_registration_hook(registered),
            nn.modules.module.register_module_buffer_registration_hook(registered),
            nn.modules.module.register_module_module_registration_hook(registered),
        ]
        self._patched = {name: getattr(nn.init, name) for name in _SKIPPING_META}
        for name, random in _SKIPPING_META.items():
            setattr(nn.init, name, self._recording_call(self._patched[name], random))
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, original in self._patched.items():
                setattr(nn.init, name, original)
            self._patched = {}
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
        last = self.recording._last_state
        if last is not None and not torch.equal(self.recording.generator.get_state(), last):
            self.recording.reseeded_at_end = True

    @contextmanager
    def inserted_at(self, position: int) -> Iterator[None]:
        """Record the operations run inside as if they had run at ``position`` (before the operation
        recorded there); their draws continue the generator's sequence at that point."""
        previous = (self._inserting, self._insert_position)
        self._inserting, self._insert_position = [], position
        try:
            with self:
                yield
            self.recording._inserted.append((position, self._inserting))
        finally:
            self._inserting, self._insert_position = previous

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        recording = self.recording
        random = torch.Tag.nondeterministic_seeded in func.tags
        # A real draw from the tracked generator in its state of the last meta draw: one device
        # would have drawn it after that draw's values, from another state (after a seed, it is fine).
        unseeded = (
            random
            and recording._last_state is not None
            and self._inserting is None
            and not _explicit_generator(args, kwargs)
            and torch.equal(recording.generator.get_state(), recording._last_state)
        )
        out = func(*args, **kwargs)
        touches_meta = any(
            isinstance(x, torch.Tensor) and x.is_meta
            for x in (*tree_flatten((args, kwargs))[0], *tree_flatten(out)[0])
        )
        if not touches_meta:
            if unseeded and _on_device_of(out, args, recording.device):
                recording.real_draws.append(str(func))
            return out
        if random and _explicit_generator(args, kwargs):
            raise SpreadError(
                f"{func} on a meta tensor was given a generator of its own: replay draws from the "
                f"default generator of {recording.device} only; build this tensor without generator=, "
                "or outside the meta device"
            )
        if self._inserting is not None:
            recording._record(func, args, kwargs, out, self._inserting, self._insert_position)
            return out
        self._note_draw(recording._record(func, args, kwargs, out, recording._ops, recording.position))
        return out

    def _note_draw(self, op: _Op | None) -> None:
        """A random operation just recorded carries the generator's state when something else than
        recorded draws changed it since the last one (a seed)."""
        recording = self.recording
        if op is not None and op.random:
            state = recording.generator.get_state()
            if recording._last_state is None or not torch.equal(state, recording._last_state):
                op.state = state
            recording._last_state = state

    def _recording_call(self, original: Callable[..., Any], random: bool) -> Callable[..., Any]:
        """``original`` (a ``torch.nn.init`` function that returns at once on a meta tensor),
        recorded when given a meta tensor."""

        @functools.wraps(original)
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return original(tensor, *args, **kwargs)
            if random and _explicit_generator(args, kwargs):
                raise SpreadError(
                    f"torch.nn.init.{original.__name__} on a meta tensor was given a generator of its "
                    f"own: replay draws from the default generator of {self.recording.device} only"
                )
            recording = self.recording
            if self._inserting is not None:
                recording._record_call(
                    original, (tensor, *args), kwargs, random, self._inserting, self._insert_position
                )
            else:
                op = recording._record_call(
                    original, (tensor, *args), kwargs, random, recording._ops, recording.position
                )
                self._note_draw(op)
            return tensor

        return call


def _on_device_of(out: Any, args: tuple, device: torch.device) -> bool:
    tensors = [x for x in (*tree_flatten(out)[0], *tree_flatten(args)[0]) if isinstance(x, torch.Tensor)]
    return any(t.device.type == device.type for t in tensors)
