"""ShardedStrategy: data parallelism whose optimizer state, gradients and parameters are split over the
processes instead of copied on each (ZeRO stages 1-3; ``shard="parameters"`` is FSDP's full sharding).

Every process still computes forward and backward of its slice of each global batch, like
:class:`~spread.strategies.MultiWorkerMirroredStrategy` (whose process group, launch paths, data
distribution, buffer averaging and timeouts it reuses); what differs is who holds what:

=================  ==========================  ===============================  ===================
``shard=``         parameters between steps     gradients after backward         optimizer state
=================  ==========================  ===============================  ===================
``"optimizer"``    full                         full (all-reduced)               1/N
``"gradients"``    full                         1/N (reduce-scatter)             1/N
``"parameters"``   1/N (gathered per unit)      1/N (reduce-scatter)             1/N
=================  ==========================  ===============================  ===================

Layout (:mod:`spread.comm.sharding`): every parameter is flattened and cut into N equal chunks;
rank r owns chunk r of each. Parameters are exchanged in *blocks* (one collective per block): at
``"parameters"`` a block is one *unit*'s parameters (``units=``: the whole model by default, or
chosen layers as with FSDP2's ``fully_shard``), gathered by the unit module's forward pre-hook,
released after its forward, gathered again when backward reaches its outputs and released once its
gradients are reduced; otherwise blocks of up to ``bucket_cap_mb``. Blocks are reduced in the
reverse order of their creation, each as soon as its gradients are complete and every earlier block
was started, so every rank issues the same collectives in the same order.

The optimizer steps the shards: :meth:`ShardedStrategy.prepare_optimizer` (``Trainer`` calls it; a
custom loop's first ``optimizer.step()`` does it through a step pre-hook) replaces each managed
parameter in the optimizer's groups by a 1-D parameter holding this rank's chunk, so the optimizer
object, its param groups, hyperparameters and schedulers stay the user's, and its state covers the
shard only. Below ``"parameters"`` a shard is a view of its model parameter's own chunk (no second
copy of the parameters); at ``"parameters"`` the shards are the only copy between steps. After
each step the other ranks' chunks are all-gathered into the model (``"optimizer"``,
``"gradients"``, a few blocks at a time) or left to the next forward (``"parameters"``). This equals
one device exactly for optimizers that update each element from that element's own state (SGD,
momentum, Adam, AdamW, RMSprop, Adagrad, ...); ones that look across a tensor (LAMB's trust ratio,
Adafactor, Shampoo, Muon) would see a chunk, not the tensor, and are not supported.

Gradients: each backward pass ends with ``.grad`` of the model's parameters gone (``None``) and the
weighted sum over ranks of what it produced added to the shards' ``.grad`` (the same weights as
MultiWorkerMirrored: each replica's share of the global batch, so uneven final batches equal one
device). A shard's ``.grad`` is a view of the reduced buffer, not a copy: at ``"optimizer"`` the
all-reduced full gradients, which stay (as ZeRO-1 keeps them) until the optimizer's ``zero_grad``;
otherwise this rank's row of the reduce-scatter. A parameter that got no gradient on any rank keeps
its shard's ``grad is None`` (a flag per parameter travels with the reduction). Inside
:meth:`no_sync` the model's ``.grad`` accumulate in full (as DDP and FSDP's
``set_requires_gradient_sync(False)``) until the next synchronised backward.

Requirements: every rank runs the same modules in forward and backward (collectives happen in hook
order). At ``"parameters"`` a parameter must be read inside its unit's forward (a model that reads
a layer's weight in its own forward, like a tied LM head, is right with the default and with layer
classes as units; with ``units="modules"`` it is not). Between forwards a released parameter reads
as zeros of its shape (one element of memory; writing into it raises), and ``model.state_dict()``
raises rather than return them: use ``strategy.full_state_dict(model)`` or
:meth:`ShardedStrategy.unsharded` to see the values.

Hybrid sharding (``shard_group_size=``, :mod:`spread.strategies.sharded_groups`): N above is then
the size of this rank's group, not the job's: the state is split within groups of consecutive ranks
(one machine's processes with ``"node"``) and each group holds a whole copy. Every stage takes it:
the block's reduction runs over the group (reduce-scatter; all-reduce at ``"optimizer"``) and its
result is then all-reduced among the ranks holding the same shard in the other groups; parameters
are gathered within the group; the clipping norm sums over the group. The data are still split over
every process (``num_replicas_in_sync`` is the job's size).

Checkpoints (:class:`~spread.strategies.sharded_state.ShardedLayout`) are per rank, through DCP,
and never gathered; the one-device state for export is ``full_state_dict`` (collective, gathered).

Under ``spread run --recover`` each rank also keeps a buddy copy of its ring neighbour's shard, so
the survivors of a lost rank rebuild the state and go on at the smaller world size
(:mod:`spread.strategies.sharded_buddy`); a machine that comes back (or a new one) joins the running
job at a step boundary, its shards of the state streamed from the live ranks, and every rank cuts the
state again for the larger world the same way.
"""

from __future__ import annotations

import os
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from itertools import pairwise
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from spread import env
from spread.cluster import ClusterSpec, resolve_cluster
from spread.cluster.rendezvous import default_collective_timeout
from spread.comm import DEFAULT_BUCKET_CAP_MB
from spread.data import StepInfo
from spread.errors import SpreadError
from spread.memory.meta_init import MetaInitRecorder
from spread.memory.report import MemoryReport, offloaded_bytes, optimizer_state_tensors, storage_bytes
from spread.strategies.base import replica_weights
from spread.strategies.checkpointing import StateLayout
from spread.strategies.clipping import clip_by_norm, local_norm
from spread.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy, _signature
from spread.strategies.sharded_block import ParameterBlock, is_per_element
from spread.strategies.sharded_buddy import (
    BuddyCopy,
    RollbackPoint,
    check_recoverable_loss,
    entries_from_plain,
    entries_to_plain,
    pack,
    reassemble,
    restore_rollback_settings,
    take_rollback_point,
)
from spread.strategies.sharded_groups import (
    ShardGroups,
    check_shard_group_size,
    make_shard_groups,
    resolve_shard_group_size,
)
from spread.strategies.sharded_meta import InitFn, materialise
from spread.strategies.sharded_offload import ShardOffload, check_offload
from spread.strategies.sharded_state import ShardedLayout
from spread.strategies.tensor_parallel import refuse_dtensor_parameters

SHARD_STAGES = ("optimizer", "gradients", "parameters")
REDUCTIONS_IN_FLIGHT = 2  # gradient reductions a rank keeps open during backward
GATHERS_IN_FLIGHT = 2  # parameter all-gathers a rank keeps open after an optimizer step
Units = str | tuple[type[nn.Module], ...]  # "model", "modules", or module classes


class ShardedStrategy(MultiWorkerMirroredStrategy):
    """Synchronous data parallelism, one replica per process, with model state split over them.

    Args:
        shard: what is split over the processes: ``"optimizer"`` (ZeRO-1: optimizer state),
            ``"gradients"`` (ZeRO-2: and gradients, reduce-scattered), ``"parameters"`` (ZeRO-3 /
            FSDP: and the parameters, gathered around each module's forward and backward).
        units: at ``"parameters"``, which modules gather their parameters around their forward and
            backward (one block, one all-gather each; FSDP2's ``fully_shard`` units). ``"model"``
            (default): each model (a module that is no other's child) is one unit: its parameters
            are full during one forward and backward and 1/N between steps; right for any model.
            A tuple of module classes, e.g. ``(nn.TransformerEncoderLayer,)``: each such module is a
            unit of its own and the rest stays with the model's unit (full parameters one layer at
            a time). ``"modules"``: every module holding parameters of its own is a unit (least
            memory; each parameter may be read only inside the forward of a module holding it).
            A parameter read by a module outside its unit reads as zeros (see the module doc).
        shard_group_size: hybrid sharding (HSDP): split the state over groups of this many
            consecutive ranks instead of over every process, each group holding one whole copy
            (see :mod:`spread.strategies.sharded_groups`). ``None`` (default): one group, the whole
            job; ``"node"``: the processes of one machine (``LOCAL_WORLD_SIZE``); an integer that
            divides the number of processes. Gradients are reduce-scattered within the group, then
            all-reduced among the ranks holding the same shard in the other groups; parameters are
            gathered within the group. Every ``shard=`` stage takes it. :attr:`mesh` is then the
            ``("replicate", "shard")`` DeviceMesh (FSDP2's HSDP mesh).
        cluster: the cluster spec; default: resolved from the environment.
        bucket_cap_mb: size of a parameter block at ``"optimizer"`` and ``"gradients"`` (one
            collective each); at ``"parameters"`` a block is one unit's parameters.
        offload: ``"optimizer"``: the optimizer's state (and beside an accelerator the shards it
            steps, their gradients, and the step itself) lives off the device: in pinned host
            memory beside an accelerator, in memory-mapped files on a CPU. ``"parameters"``
            (``shard="parameters"`` only): the parameter shards too. See
            :mod:`spread.strategies.sharded_offload`. Default None: nothing offloaded.
        offload_dir: on a CPU, where each rank's offload files are made (a directory of its own,
            removed at :meth:`close`; the files are unlinked once mapped). Default: ``TMPDIR``.
        init_timeout, collective_timeout, sync_batchnorm: as for MultiWorkerMirroredStrategy.

    Collectives are torch.distributed's ``reduce_scatter_single`` (on gloo an in-place
    ``all_reduce`` and a copy of the rank's row, see :meth:`~spread.comm.Collectives.reduce_scatter`)
    and ``all_gather_single``, and ``all_reduce`` at ``"optimizer"``; buffers (BatchNorm statistics)
    are not sharded and are averaged after each step as with MultiWorkerMirrored.
    """

    def __init__(
        self,
        shard: str = "parameters",
        *,
        units: Units = "model",
        shard_group_size: int | str | None = None,
        cluster: ClusterSpec | None = None,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        init_timeout: float | None = None,
        collective_timeout: float | None = None,
        sync_batchnorm: bool = False,
        offload: str | None = None,
        offload_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if shard not in SHARD_STAGES:
            raise ValueError(f"shard must be one of {SHARD_STAGES}, got {shard!r}")
        check_offload(offload, shard, offload_dir)
        if not (
            units in ("model", "modules")
            or (
                isinstance(units, tuple)
                and units
                and all(isinstance(c, type) and issubclass(c, nn.Module) for c in units)
            )
        ):
            raise ValueError(
                f"units must be 'model', 'modules' or a non-empty tuple of nn.Module classes, got {units!r}"
            )
        check_shard_group_size(shard_group_size)
        cluster = cluster if cluster is not None else resolve_cluster()
        group_size = resolve_shard_group_size(shard_group_size, cluster)  # refused before joining the job
        if os.environ.get(env.RECOVER, "") == "1" and (offload or group_size < cluster.world_size):
            # The buddy copy (sharded_buddy) keeps a neighbour's shard in ordinary memory over the whole
            # job's ring; offloaded shards and hybrid groups would need a copy of their own layout.
            raise ValueError(
                "spread run --recover (recovery without restart) is not available for ShardedStrategy with "
                f"offload={offload!r} or shard_group_size={shard_group_size!r} yet: drop --recover and use "
                "--max-restarts with BackupAndRestore, or drop offload / shard_group_size"
            )
        self.shard = shard
        self.units = units
        self.shard_group_size = shard_group_size
        super().__init__(
            "native",
            cluster=cluster,
            bucket_cap_mb=bucket_cap_mb,
            init_timeout=init_timeout,
            collective_timeout=collective_timeout,
            sync_batchnorm=sync_batchnorm,
        )
        self._resources.owner = f"ShardedStrategy rank {self.cluster.rank}"
        if self.awaiting_state:  # joined a running job (--recover: one group): the group it was admitted to
            group_size = self.collectives.world_size
        try:
            self._groups: ShardGroups = make_shard_groups(
                self.collectives, self.device, group_size, collective_timeout or default_collective_timeout()
            )
        except BaseException:
            self._resources.release()
            raise
        self._resources.push(self._groups.release)
        self._blocks: list[ParameterBlock] = []  # in creation order; reduced in reverse
        self._block_of: dict[int, tuple[ParameterBlock, int]] = {}  # id(model parameter) -> (block, index)
        self._shard_to_block: dict[int, ParameterBlock] = {}  # id(shard parameter) -> its block
        self._pending: list[nn.Parameter] = []  # adopted, not yet in a block
        self._module_blocks: dict[nn.Module, list[ParameterBlock]] = {}
        self._handles: list[RemovableHandle] = []
        self._prepared: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._grad_scale = 1.0 / self.collectives.world_size
        self._sync = True
        self._queued = False
        self._next_reduce = 0  # index into the reverse block order of the next block to reduce
        # Blocks whose reduction is in flight, oldest first: each holds a packed full-size copy of
        # its gradients until finished, so at most REDUCTIONS_IN_FLIGHT stay open (all of them
        # open until the end of backward held the whole model's gradients once more).
        self._reducing: deque[ParameterBlock] = deque()
        # "parameters": blocks in the order the first training forward used them, then which block
        # to prefetch after each one in forward and in backward (None until recorded).
        self._forward_order: list[ParameterBlock] = []
        self._next_in_forward: dict[int, ParameterBlock] | None = None
        self._next_in_backward: dict[int, ParameterBlock] | None = None
        self._pre_step_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        self._reading_state = False  # the layout reads released parameters' names and buffers
        self._recorder: MetaInitRecorder | None = None  # the last scope's, until its models are adopted
        self._init_fn: InitFn | None = None  # prepare_model's, while it runs
        self.offload = offload
        self._offload = (
            ShardOffload(offload, self.device, rank=self.cluster.rank, directory=offload_dir)
            if offload
            else None
        )
        # Recovery without restart (spread run --recover only): the ring neighbour's shard, kept at
        # each step boundary (sharded_buddy), this rank's own state before its latest optimizer step,
        # and after a regroup (old rank, old world, lost ranks) until the state is rebuilt for the new
        # world.
        self._buddy = BuddyCopy() if os.environ.get(env.RECOVER, "") == "1" else None
        self._rollback: RollbackPoint | None = None
        self._regrouped: tuple[int, int, list[int]] | None = None

    # -- variables ---------------------------------------------------------------------------------
    def _check_new_parameters(self, params: list[nn.Parameter]) -> None:
        refuse_dtensor_parameters(
            "ShardedStrategy", params, "ZeRO splits whole tensors over the processes", planned=True
        )

    def _on_new_variables(self, params: list[nn.Parameter], buffers: list[torch.Tensor]) -> None:
        tensors = [*params, *buffers]
        if not self.awaiting_state:  # joined a running job: its ranks are training, the values come later
            signature = [*_signature(tensors), sum(t.is_meta for t in tensors)]
            self.collectives.check_same(signature, what="the model's parameter shapes and dtypes")
            real = [t for t in tensors if not t.is_meta]  # meta ones get the chief's values in materialise
            self.collectives.broadcast_tensors(real, src=0, name="broadcast_initial_weights")
        self._buffers_stale = True
        self._pending.extend(params)

    @contextmanager
    def _scope_context(self) -> Iterator[None]:
        """At ``"parameters"``: record what the scope's code does with meta tensors (for
        :mod:`spread.strategies.sharded_meta`)."""
        if self.shard != "parameters":
            yield
            return
        recorder = MetaInitRecorder(self.device)
        with recorder:
            yield
        self._recorder = recorder

    def _meta_refusal(self) -> str | None:
        if self.shard == "parameters":
            return None
        return f"at shard={self.shard!r} every process holds every parameter whole"

    def prepare_model(self, model: nn.Module, *, init_fn: InitFn | None = None) -> nn.Module:
        """As :meth:`Strategy.prepare_model`. A model on the meta device (``shard="parameters"``
        only) is materialised module by module, each rank keeping its shards: each module holding
        meta tensors of its own gets them on the device, then ``init_fn(module)`` or its
        ``reset_parameters()`` (see :mod:`spread.strategies.sharded_meta` for when that equals one
        device; built inside the scope instead, any model does)."""
        self._init_fn = init_fn
        try:
            return super().prepare_model(model)
        finally:
            self._init_fn = None

    def _on_new_modules(self, modules: list[nn.Module]) -> None:
        recorder, self._recorder = self._recorder, None
        pending, self._pending = self._pending, []
        regions: list[tuple[nn.Module, list[nn.Module]]] = []
        groups: list[list[nn.Parameter]] = []
        if pending and self.shard == "parameters":
            regions = _unit_regions(modules, self.units)
            groups = _blocks_by_unit(pending, regions)
        elif pending:
            groups = _blocks_by_size(pending, int(self.bucket_cap_mb * 2**20))
        created: dict[int, ParameterBlock] = {}  # id(model parameter) -> its new block
        for params in groups:
            block = ParameterBlock(params, self._groups.shard, self.shard, self._groups.replicas)
            self._blocks.append(block)
            for i, p in enumerate(params):
                created[id(p)] = block
                self._block_of[id(p)] = (block, i)
                self._shard_to_block[id(block.shards[i])] = block
        if self.shard == "parameters":
            materialise(self, recorder, modules, self._init_fn)
        if self._offload is not None:
            for block in {id(b): b for b in created.values()}.values():
                self._offload.place(block)
        super()._on_new_modules(modules)  # BatchNorm and buffer averaging, as MultiWorkerMirrored
        for params in groups:
            for p in params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._after_accumulate))
        for owner, region in regions:
            # The unit's module gathers every block a module of its region holds a parameter of (a
            # tied weight's other block too) for its whole forward.
            held = [p for m in region for p in m._parameters.values() if p is not None and id(p) in created]
            if not held:
                continue
            if owner not in self._module_blocks:
                self._module_blocks[owner] = []
                self._handles.append(owner.register_forward_pre_hook(self._before_forward))
                self._handles.append(owner.register_forward_hook(self._after_forward))
            blocks = self._module_blocks[owner]  # a module adopted again (prepare_model) keeps its own
            for p in held:
                if all(b is not created[id(p)] for b in blocks):
                    blocks.append(created[id(p)])
        for block in {id(b): b for b in created.values()}.values():
            if self.shard == "parameters":
                block.release()
        if self.shard == "parameters":
            for module in _unique_modules(modules):
                if any(p is not None and id(p) in created for p in module._parameters.values()):
                    self._handles.append(module.register_state_dict_pre_hook(self._refuse_released_state))

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        blocks = self._module_blocks[module]
        if self._next_in_forward is None:
            for block in blocks:  # the first training step records the order blocks are used in
                if all(b is not block for b in self._forward_order):
                    self._forward_order.append(block)
        self._gather(blocks)
        if self._next_in_forward is not None and (ahead := self._next_in_forward.get(id(blocks[-1]))):
            ahead.start_gather()  # prefetch: its all-gather overlaps this module's forward

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        blocks = self._module_blocks[module]
        if torch.is_grad_enabled():
            needing = [t for t in _tensors(output) if t.requires_grad]
            if needing:
                # Backward reaches this module's outputs before it needs the parameters it saved.
                register_multi_grad_hook(needing, lambda grad: self._gather_for_backward(blocks), mode="any")
        for block in blocks:
            block.release()

    def _gather_for_backward(self, blocks: Sequence[ParameterBlock]) -> None:
        self._gather(blocks)
        if self._next_in_backward is not None and (ahead := self._next_in_backward.get(id(blocks[0]))):
            ahead.start_gather()  # prefetch the block backward reaches next

    def _gather(self, blocks: Sequence[ParameterBlock]) -> None:
        for block in blocks:
            block.gather()

    # -- gradients ---------------------------------------------------------------------------------
    def _after_accumulate(self, p: torch.Tensor) -> None:
        block, _ = self._block_of[id(p)]
        block.ready.add(id(p))
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        order = self._blocks[::-1]
        while (
            self._next_reduce < len(order)
            and len(order[self._next_reduce].ready) >= order[self._next_reduce].trainable
        ):
            self._start_block(order[self._next_reduce])
            self._next_reduce += 1

    def _start_block(self, block: ParameterBlock) -> None:
        """A block's gradients are complete: start its reduction (it overlaps the rest of backward);
        at ``"parameters"`` its full parameters are not needed any more."""
        if self._sync and block.trainable:
            block.start_reduce(self._grad_scale)
            self._reducing.append(block)
            if self._groups.replicas is not None:
                # Hybrid: each block's all-reduce among the replicas starts once its reduction in the
                # group is over (in issue order), overlapping the rest of backward.
                for started in self._reducing:
                    if not started.advance_reduce(block=False):
                        break
            while len(self._reducing) > REDUCTIONS_IN_FLIGHT:
                self._reducing.popleft().finish_reduce()
        if self.shard == "parameters" and block.resident and block.trainable:
            block.release()  # a frozen block's backward may still come: released at the end

    def _end_of_backward(self) -> None:
        self._queued = False
        try:
            for block in self._blocks[::-1][self._next_reduce :]:
                self._start_block(block)
            for block in self._blocks[::-1]:
                block.finish_reduce()
        finally:
            self._reducing.clear()
            self._next_reduce = 0
            for block in self._blocks:
                block.ready.clear()
                if self.shard == "parameters" and (block.resident or block.gathering):
                    block.release()  # a frozen module's, or a prefetch nobody used
            if self._next_in_forward is None and self._forward_order:
                order = self._forward_order
                self._next_in_forward = {id(a): b for a, b in pairwise(order)}
                self._next_in_backward = {id(b): a for a, b in pairwise(order)}

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _set_step_info(self, info: StepInfo) -> None:
        super()._set_step_info(info)
        self._grad_scale = replica_weights(self)[0]

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        self._grad_scale = replica_weights(self)[0]
        return super().run(fn, args, kwargs)

    def _shards_of(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """The shard parameters standing for ``params`` (model parameters or shards themselves)."""
        out: dict[int, nn.Parameter] = {}
        for p in params:
            if id(p) in self._shard_to_block:
                out[id(p)] = p
            elif id(p) in self._block_of:
                block, i = self._block_of[id(p)]
                out[id(block.shards[i])] = block.shards[i]
            else:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not managed by this ShardedStrategy; "
                    f"build the model inside strategy.scope() or pass it to strategy.prepare_model"
                )
        return list(out.values())

    def clip_gradients(
        self, params: Sequence[nn.Parameter], *, max_norm: float | None = None, max_value: float | None = None
    ) -> torch.Tensor:
        """The norm over every rank's shards (squared shard norms summed over ranks, collective);
        each rank clips its shards' gradients by it. Takes model parameters or shards. With hybrid
        sharding the sum runs over this rank's group (the other groups hold the same gradients)."""
        shards = self._shards_of(params)
        local = local_norm(shards, self.device).double()
        squares = local * local
        self._groups.shard.all_reduce(squares, name="sharded.grad_norm")  # each group holds them all once
        return clip_by_norm(shards, squares.sqrt().float(), max_norm, max_value)

    def check_precision(self, precision: str) -> None:
        if precision == "fp16":
            raise ValueError(
                "ShardedStrategy does not train in precision='fp16': the loss scaler's overflow check "
                "would see each rank's gradient shard and could skip a step on some ranks only; use 'bf16'"
            )

    # -- the optimizer -----------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make ``optimizer`` step this rank's shards: each managed parameter in its groups is replaced
        by its shard (groups, hyperparameters and the object itself stay), and state it already
        holds is cut to the shard. Idempotent; a custom loop's first ``optimizer.step()`` calls it."""
        if optimizer in self._prepared:
            return optimizer
        for group in optimizer.param_groups:
            group["params"] = self._shards_of(group["params"]) if group["params"] else []
        for p in list(optimizer.state):
            if id(p) in self._block_of:
                block, i = self._block_of[id(p)]
                state = optimizer.state.pop(p)
                optimizer.state[block.shards[i]] = {
                    k: self._chunk_state(block, i, k, v) for k, v in state.items()
                }
        if self._offload is not None:
            self._offload.adopt_state(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
        self._prepared.add(optimizer)
        if self._buddy is not None and self._blocks and not self.awaiting_state:
            # A loss before the first step is recoverable too (a joiner's copy comes at its admission).
            self._buddy.refresh(self.collectives, self._blocks, optimizer, self.steps_applied)
        return optimizer

    def _chunk_state(self, block: ParameterBlock, i: int, key: str, value: Any) -> Any:
        if is_per_element(key, value, block.layout.shapes[i]):
            return block.layout.chunk_of(i, value, self._groups.shard.rank)
        return value

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for block in self._blocks:
            if block.gathering:  # a prefetch must not read shards the step is changing
                block.release()
        if optimizer not in self._prepared and any(
            id(p) in self._block_of for group in optimizer.param_groups for p in group["params"]
        ):
            self.prepare_optimizer(optimizer)
        if self._offload is not None and optimizer in self._prepared:
            self._offload.step(optimizer, lambda p: id(p) in self._shard_to_block, args, kwargs)
        if self._buddy is not None and optimizer in self._prepared and not self._closed:
            # Where the survivors go back to when a loss comes before every rank has the copy of
            # the step this one is about to take (sharded_buddy).
            self._rollback = take_rollback_point(
                self._blocks, optimizer, self.steps_applied, self._buffers, self.steps_with_buffers
            )

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._offload is not None:
            self._offload.after_step()
        if self._closed:
            return
        stepped = {
            id(b)
            for group in optimizer.param_groups
            for p in group["params"]
            if (b := self._shard_to_block.get(id(p))) is not None
        }
        if not stepped:
            return
        self.steps_applied += 1
        if self._buddy is not None:  # first: a loss in the gathers after it stays recoverable
            self._buddy.refresh(self.collectives, self._blocks, optimizer, self.steps_applied)
        blocks = [b for b in self._blocks if id(b) in stepped]
        gathering: deque[ParameterBlock] = deque()
        for block in blocks:
            block.resident = False  # the step changed the shards: the model's values are stale
            if self.shard == "parameters":
                block.release()  # the next forward gathers the new values
                continue
            # A few all-gathers in flight at once, each with a packed block of its own.
            block.start_gather()
            gathering.append(block)
            while len(gathering) > GATHERS_IN_FLIGHT:
                gathering.popleft().gather()
        for block in gathering:
            block.gather()
        if self._buffers is not None:
            self._buffers.sync(self._buffer_weight)
        self.steps_with_buffers += 1

    # -- state: the seam's layout (spread.strategies.sharded_state) -------------------------------
    def local_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Refused at ``"parameters"``, where each rank keeps 1/N of every parameter between steps."""
        if self.shard == "parameters":
            raise SpreadError(
                "under ShardedStrategy(shard='parameters') each rank keeps 1/N of every parameter "
                "between steps: use strategy.full_state_dict(model) (collective) for the weights"
            )
        return model.state_dict()

    @contextmanager
    def unsharded(self) -> Iterator[None]:
        """Collective: inside, every managed parameter holds its full current value (gathered at
        ``shard="parameters"``, released again on the way out)."""
        gathered = [b for b in self._blocks if not b.resident]
        for block in gathered:
            block.gather()
        try:
            yield
        finally:
            for block in gathered:
                block.release()

    def _state_layout(self) -> StateLayout:
        return ShardedLayout(self)

    @contextmanager
    def reading_released_state(self) -> Iterator[None]:
        """The layout's own reads of the model's state while parameters are released (it takes
        buffers and names from it, never the released values)."""
        previous, self._reading_state = self._reading_state, True
        try:
            yield
        finally:
            self._reading_state = previous

    def _refuse_released_state(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``model.state_dict()`` would return released parameters' zeros: raise, naming the calls
        that give the weights (a chief-only ``save_pretrained`` must not write zeros silently)."""
        if self._reading_state:
            return
        for p in module._parameters.values():
            if p is not None and id(p) in self._block_of and not self._block_of[id(p)][0].resident:
                raise SpreadError(
                    f"{type(module).__name__}.state_dict() under ShardedStrategy(shard='parameters') "
                    "would hold zeros: each rank keeps 1/N of every parameter between steps. Call "
                    "strategy.full_state_dict(model) on every rank (collective) for the one-device "
                    "weights (spread.export.save_pretrained(strategy, model, path) and save_safetensors "
                    "do it on every rank and write on the chief), or read the model inside "
                    "`with strategy.unsharded():` on every rank"
                )

    def _optimizer_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        self.prepare_optimizer(optimizer)
        return [p for group in optimizer.param_groups for p in group["params"]]

    def _gather_state(self, block: ParameterBlock, i: int, key: str, value: Any) -> Any:
        """One optimizer state entry of a shard, whole: per-element state gathered from every rank."""
        if not is_per_element(key, value, block.shards[i].shape):
            return value
        layout = block.layout
        local = value.to(self.collectives.device).contiguous()  # offloaded state is on the host
        gathered = local.new_empty(layout.world_size * layout.chunks[i])
        self._groups.shard.all_gather_into(gathered, local, name="sharded.gather_optimizer_state")
        return gathered[: layout.numel(i)].view(layout.shapes[i]).to(value.device, copy=True)

    # Each parameter's (and per-element optimizer state's) chunk is this rank's piece of the flat
    # one-device tensor, at offset rank * chunk: torch.chunk's split, which is DTensor's Shard(0)
    # on a 1-D mesh (``(Replicate(), Shard(0))`` on the hybrid mesh: each group holds every piece).
    # Saved as DTensors, DCP stores each piece once with its offset and, at another world size or
    # group size, reads each rank the saved ranges overlapping its new piece: no rank holds more than
    # its shard (plus one saved chunk's overlap) on the way in or out.
    def _mesh(self) -> DeviceMesh:
        if self._groups.mesh is not None:
            return self._groups.mesh
        group = self.collectives.group or torch.distributed.group.WORLD
        assert group is not None, "ShardedStrategy runs inside a process group"
        return DeviceMesh.from_group(group, self.collectives.device.type)

    def _piece(self, block: ParameterBlock, i: int, chunk: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """This rank's ``chunk`` of tensor ``i`` (padding cut off) as its piece of the flat tensor."""
        numel, c = block.layout.numel(i), block.layout.chunks[i]
        local = chunk[: max(0, min(c, numel - self._groups.shard.rank * c))]
        placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size([numel]), stride=(1,)
        )

    @property
    def mesh(self) -> DeviceMesh | None:
        """With ``shard_group_size``: the ``("replicate", "shard")`` DeviceMesh of the groups (FSDP2's
        HSDP mesh); None when the state is split over every process."""
        return self._groups.mesh

    @property
    def shard_rank(self) -> int:
        """This rank's position in its group: which chunk of every parameter it holds."""
        return self._groups.shard.rank

    def _managed_names(self, model: nn.Module) -> dict[str, tuple[ParameterBlock, int]]:
        return {
            name: self._block_of[id(p)] for name, p in model.named_parameters() if id(p) in self._block_of
        }

    def _restore_blocks(self, blocks: Sequence[ParameterBlock]) -> None:
        """After shards were overwritten: the model's full values follow (gathered at ``"optimizer"``
        and ``"gradients"``; at ``"parameters"`` left to the next forward). Same order on every rank."""
        for block in blocks:
            if self.shard == "parameters":
                if block.resident:
                    block.release()
            else:
                block.resident = False
                block.gather()

    # -- memory ------------------------------------------------------------------------------------
    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Bytes this rank holds: the model's parameters (0 for released ones) and its shards (views
        of them below ``"parameters"``: counted once); the model's and the shards' gradients (with
        the reduced buffers they are views of); ``optimizer``'s state. With ``offload``, the part of
        them held off the device is ``offloaded_bytes`` (the device's copies of host shards count as
        parameters held on it). Under ``--recover`` the copies kept to recover are
        ``recovery_copy_bytes``."""
        seen: set[int] = set()
        shards = [s for b in self._blocks for s in b.shards]
        copies = [c for b in self._blocks if (c := b.device_copy) is not None]
        params = storage_bytes(
            [*self.managed_parameters, *(f for b in self._blocks for f in b.full), *shards, *copies], seen
        )
        grads = storage_bytes(
            [*(p.grad for p in self.managed_parameters), *(s.grad for s in shards)],
            seen,
        )
        state_tensors = optimizer_state_tensors(optimizer)
        state = storage_bytes(state_tensors, seen)
        everything = [
            *self.managed_parameters,
            *(f for b in self._blocks for f in b.full),
            *shards,
            *(p.grad for p in self.managed_parameters),
            *(s.grad for s in shards),
            *state_tensors,
        ]
        return MemoryReport(
            parameter_bytes=params,
            gradient_bytes=grads,
            optimizer_state_bytes=state,
            activation_bytes=self._activation_bytes,
            offloaded_bytes=offloaded_bytes(everything, self.device),
            recovery_copy_bytes=self._recovery_copy_bytes(),
        )

    def _recovery_copy_bytes(self) -> int:
        """The buddy copy and the rollback point (``--recover`` only; packed: storages of their own)."""
        kept: list[torch.Tensor] = []
        if self._buddy is not None:
            kept += self._buddy.flats.values()
        if self._rollback is not None:
            kept += [*self._rollback.flats.values()]
            if self._rollback.buffers is not None:
                kept.append(self._rollback.buffers)
        return storage_bytes(kept)

    # -- recovery without restart (spread run --recover; sharded_buddy) ------------------------------
    def check_recoverable(self) -> None:
        super().check_recoverable()
        if self._buddy is None:
            raise SpreadError(
                "ShardedStrategy recovers without restart only when built under spread run --recover "
                "(SPREAD_RECOVER=1 in the environment before the strategy): it then keeps a buddy copy "
                "of its ring neighbour's shard at each step boundary"
            )

    def regroup(self) -> None:
        """As MultiWorkerMirrored's (after a lost rank, or to admit processes waiting to join), after
        dropping what the broken group left in flight; the shards are rebuilt for the new world by
        :meth:`broadcast_training_state` (collective)."""
        self.check_recoverable()
        old_rank = self.collectives.rank
        for block in self._blocks:
            block.abandon_in_flight()
        self._reducing.clear()
        self._queued, self._next_reduce = False, 0
        super().regroup()
        # One group, the survivors (--recover refuses hybrid groups): what the blocks, the clipping norm
        # and the state's chunks use from now on, never the broken group's.
        self._groups = ShardGroups(self.collectives)
        assert self._regrouped is not None
        _, old_world, lost = self._regrouped
        self._regrouped = (old_rank, old_world, lost)

    def _after_regroup(self, old_world: int, lost: list[int]) -> None:
        check_recoverable_loss(old_world, lost)
        self._regrouped = (-1, old_world, lost)  # regroup() fills in the old rank

    def broadcast_training_state(self, src: int, optimizer: torch.optim.Optimizer | None) -> None:
        """After a regroup: every old rank's shard rebuilt from the survivors' own and the buddy copies
        of the lost ranks' (:func:`~spread.strategies.sharded_buddy.reassemble`), cut again for the
        new world (the survivors are at the same step: checked); buffers from ``src``; then a fresh
        buddy copy for the new ring. A process that joined the running job (a regroup that admitted
        it) takes part with no shard of its own: what it needs besides the shards comes from ``src``
        (:meth:`_join_plan`), the shards from every survivor, and it is cut its part like the others."""
        self.check_recoverable()
        assert self._buddy is not None, "check_recoverable: built under --recover"
        joined = self.awaiting_state
        if optimizer is not None:
            self.prepare_optimizer(optimizer)
        admitting = self._rendezvous is not None and any(isinstance(m, str) for m in self._rendezvous.members)
        if admitting:  # a joiner built its model on its own: every rank checks it is the job's
            params: list[torch.Tensor] = [p for block in self._blocks for p in block.params]
            blocks = zlib.crc32(repr([len(block.params) for block in self._blocks]).encode())
            self.collectives.check_same(
                [*_signature(params), blocks], what="the model's parameter shapes, dtypes and blocks"
            )
        plan = self._join_plan(src, optimizer) if admitting else None
        old_rank: int | None
        if joined:
            assert plan is not None, "a process that joined is on its first group's member list"
            old_rank, old_world, lost = None, int(plan["old_world"]), [int(r) for r in plan["lost"]]
        else:
            assert self._regrouped is not None, "broadcast_training_state follows regroup"
            old_rank, old_world, lost = self._regrouped
        whole, version = reassemble(
            self.collectives,
            old_rank,
            old_world,
            lost,
            self._blocks,
            optimizer,
            self._buddy,
            self.steps_applied,
            self._rollback,
            entries_from_plain(plan["entries"]) if joined and plan is not None else (),
        )
        self._regrouped = None
        rollback = self._rollback if not joined and version != self.steps_applied else None
        self._rollback = None
        old_shards = {id(s): (j, i) for j, b in enumerate(self._blocks) for i, s in enumerate(b.shards)}
        kept: dict[tuple[int, int], dict[str, Any]] = {}  # old shard's place -> its optimizer state
        if optimizer is not None and joined:
            assert plan is not None
            self._take_optimizer_settings(optimizer, plan)
            # Per-element entries are None there: they come from ``whole``, like a survivor's.
            kept = {(int(j), int(i)): dict(state) for j, i, state in plan["state"]}
        elif optimizer is not None and rollback is not None:  # back to the step before this rank's last
            restore_rollback_settings(optimizer, rollback, self._buffers)
            kept = rollback.optimizer_states()
        elif optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) in old_shards:
                        kept[old_shards[id(p)]] = dict(optimizer.state.get(p, {}))
        if rollback is not None:
            self.steps_applied, self.steps_with_buffers = version, rollback.steps_with_buffers
        self._shard_to_block.clear()
        for j, block in enumerate(self._blocks):
            block.reshard(self.collectives, [whole[(j, i, "")] for i in range(len(block.params))])
            for shard in block.shards:
                self._shard_to_block[id(shard)] = block
            if self.shard == "parameters":
                block.release()
        if optimizer is not None:
            stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in old_shards]
            for p in stale:
                optimizer.state.pop(p, None)
            for group in optimizer.param_groups:
                group["params"] = [
                    self._blocks[old_shards[id(p)][0]].shards[old_shards[id(p)][1]]
                    if id(p) in old_shards
                    else p
                    for p in group["params"]
                ]
            for (j, i), state in kept.items():
                block = self._blocks[j]
                optimizer.state[block.shards[i]] = {
                    key: self._chunk_state(block, i, key, whole.get((j, i, key), value))
                    for key, value in state.items()
                }
        if joined:
            assert plan is not None
            self.steps_applied, self.steps_with_buffers = (int(c) for c in plan["steps"])
            self._follow_forward_order([int(j) for j in plan["forward_order"]], bool(plan["prefetching"]))
            self.awaiting_state = False
        self._grad_scale = 1.0 / self.collectives.world_size
        with torch.no_grad():  # averaged after every step: equal, unless the lost step's forward moved them
            self.collectives.broadcast_tensors(
                list(self._managed_buffers.values()), src=src, name="recover_buffers"
            )
        self._buffers_now_equal()
        self._buddy.refresh(self.collectives, self._blocks, optimizer, self.steps_applied)

    def _join_plan(self, src: int, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Collective (a broadcast from ``src``, a survivor): what a process joining the running job
        needs besides the shards, as plain values and tensors (never a pickle): the old world and its
        lost ranks, the layout of a packed shard, each shard's optimizer state but its per-element
        tensors (those are in the shards), the optimizer's hyperparameters (a schedule moved the
        learning rate), the step counts, and the order of the blocks in forward (which prefetches
        follow: every rank must issue the same collectives in the same order)."""
        plan: dict[str, Any] | None = None
        if self.rank == src:
            assert self._regrouped is not None, "the source of the state is a survivor"
            _, old_world, lost = self._regrouped
            entries, _ = pack(self._blocks, optimizer)
            per_element = {(e.block, e.index, e.key) for e in entries}
            state: list[list[Any]] = []
            groups: list[dict[str, Any]] = []
            if optimizer is not None:
                places = {id(s): (j, i) for j, b in enumerate(self._blocks) for i, s in enumerate(b.shards)}
                for group in optimizer.param_groups:
                    groups.append({k: v for k, v in group.items() if k != "params"})
                    for p in group["params"]:
                        if id(p) in places:
                            j, i = places[id(p)]
                            values = optimizer.state.get(p, {})
                            plain = {k: None if (j, i, k) in per_element else v for k, v in values.items()}
                            state.append([j, i, plain])
            blocks = {id(b): j for j, b in enumerate(self._blocks)}
            plan = {
                "old_world": old_world,
                "lost": list(lost),
                "entries": entries_to_plain(entries),
                "state": state,
                "groups": groups,
                "steps": [self.steps_applied, self.steps_with_buffers],
                "forward_order": [blocks[id(b)] for b in self._forward_order],
                "prefetching": self._next_in_forward is not None,
            }
        return self.broadcast_object(plan, src)

    def _take_optimizer_settings(self, optimizer: torch.optim.Optimizer, plan: Mapping[str, Any]) -> None:
        """A joiner's optimizer takes the running job's hyperparameters (each group's, but its params)."""
        groups = plan["groups"]
        if len(groups) != len(optimizer.param_groups):
            raise SpreadError(
                f"rank {self.rank}: this process's optimizer has {len(optimizer.param_groups)} parameter "
                f"groups, the running job's has {len(groups)}: a process that joins must build the same "
                "optimizer as the job's ranks"
            )
        for group, settings in zip(optimizer.param_groups, groups, strict=True):
            group.update(settings)

    def _follow_forward_order(self, order: list[int], prefetching: bool) -> None:
        """A joiner takes the order its peers recorded blocks in at their first forward, and prefetches
        as they do from its first step."""
        self._forward_order = [self._blocks[j] for j in order]
        if prefetching:
            self._next_in_forward = {id(a): b for a, b in pairwise(self._forward_order)}
            self._next_in_backward = {id(b): a for a, b in pairwise(self._forward_order)}

    def close(self) -> None:
        self._pre_step_hook.remove()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._offload is not None:
            self._offload.close()
        super().close()

    def __repr__(self) -> str:
        hybrid = "" if self.shard_group_size is None else f", shard_group_size={self.shard_group_size!r}"
        offload = f", offload={self.offload!r}" if self.offload else ""
        replicas = self.num_replicas_in_sync
        return f"ShardedStrategy(shard={self.shard!r}{hybrid}{offload}, num_replicas_in_sync={replicas})"


def _unit_regions(modules: list[nn.Module], units: Units) -> list[tuple[nn.Module, list[nn.Module]]]:
    """The units of the new modules, each with its *region*: the unit's module and its descendants
    that are not in a nested unit, in depth-first order from the roots (modules that are no other
    new module's child). Units: every root, plus (``units=`` classes) each module of those classes,
    or (``units="modules"``) every module holding parameters of its own instead."""
    children = {id(c) for m in modules for c in m.children()}
    roots = [m for m in _unique_modules(modules) if id(m) not in children]

    def is_unit(module: nn.Module, root: bool) -> bool:
        if units == "modules":
            return any(p is not None for p in module._parameters.values())
        if isinstance(units, str):  # "model"
            return root
        return root or isinstance(module, units)

    regions: list[tuple[nn.Module, list[nn.Module]]] = []

    def visit(module: nn.Module, region: list[nn.Module] | None, root: bool) -> None:
        if is_unit(module, root):
            region = [module]
            regions.append((module, region))
        elif region is not None:
            region.append(module)
        for child in module.children():
            visit(child, region, False)

    for root in roots:
        visit(root, None, True)
    return regions


def _blocks_by_unit(
    params: list[nn.Parameter], regions: list[tuple[nn.Module, list[nn.Module]]]
) -> list[list[nn.Parameter]]:
    """One block per unit: the new parameters its region's modules hold (first unit wins a tied
    weight); each parameter gets a storage of its own, released and regrown alone."""
    new = {id(p) for p in params}
    blocks: list[list[nn.Parameter]] = []
    owned: set[int] = set()
    for _, region in regions:
        mine = []
        for module in region:
            for p in module._parameters.values():
                if p is not None and id(p) in new and id(p) not in owned:
                    owned.add(id(p))
                    if not p.is_meta and (  # a meta one gets a storage of its own in materialise
                        p.storage_offset() != 0
                        or p.untyped_storage().nbytes() != p.numel() * p.element_size()
                    ):
                        p.data = p.detach().clone()
                    mine.append(p)
        if mine:
            blocks.append(mine)
    if len(owned) != len(new):
        raise SpreadError("ShardedStrategy(shard='parameters'): a new parameter belongs to no module")
    return blocks


def _unique_modules(modules: list[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for m in modules}.values())


def _blocks_by_size(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one device and dtype, at most ``cap_bytes`` a block (unless one
    parameter alone is larger)."""
    blocks: list[list[nn.Parameter]] = []
    open_by_key: dict[tuple, tuple[list[nn.Parameter], int]] = {}
    for p in params:
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        current = open_by_key.get(key)
        if current is None or (current[1] + nbytes > cap_bytes and current[0]):
            current = ([], 0)
            blocks.append(current[0])
        current[0].append(p)
        open_by_key[key] = (current[0], current[1] + nbytes)
    return blocks


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
