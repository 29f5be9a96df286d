"""ShardedStrategy's offload: the shards the optimizer steps and its state live off the device.

``offload="optimizer"`` takes the optimizer's side of training off the device; ``"parameters"``
(``shard="parameters"`` only) the parameter shards between uses too:

==================  =====================================  =========================================
                    beside an accelerator (host, pinned)    on a CPU machine (memory-mapped files)
==================  =====================================  =========================================
``"optimizer"``     optimizer state, the shards it steps    optimizer state
                    and their gradients; the optimizer
                    steps on the CPU (ZeRO-Offload)
``"parameters"``    the same, and no shard on the device:   optimizer state and parameter shards
                    each gather copies it there             (their gradients stay in memory)
                    (FSDP2's ``CPUOffloadPolicy``)
==================  =====================================  =========================================

Beside an accelerator, below ``"parameters"`` the model keeps its full parameters on the device and
gathers them from the host shards after each step; at ``"parameters"`` with ``"optimizer"`` the device
keeps a copy of the shard, refreshed when the host's changed (so a gather copies nothing).

On a CPU, host memory is where everything is already: the state goes to files
(:class:`~spread.memory.host_store.DiskStore`), paged in while the optimizer steps and written back by
the kernel, so a model whose optimizer state exceeds the memory a process may hold trains. Torch's
optimizers create their state on the first step (``zeros_like`` of the parameter: anonymous memory),
so the managed shards are stepped here, a chunk of about ``STEP_CHUNK_BYTES`` of parameters at a time,
by the optimizer's own ``step`` (unhooked) on param groups holding only that chunk; each chunk's new
state moves to the files before the next chunk's is made. The optimizer's real ``step`` then finds the
managed shards without ``.grad`` and leaves them alone (torch's optimizers skip those); their
``.grad`` are back after it. Per-element optimizers step each element alone, so stepping in chunks
equals stepping at once (and ShardedStrategy supports no other kind).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from spread.errors import SpreadError
from spread.memory.host_store import DiskStore, HostStore, PinnedStore, copy_into, is_offloaded
from spread.strategies.sharded_block import ParameterBlock, is_per_element

OFFLOADS = ("optimizer", "parameters")
STEP_CHUNK_BYTES = 32 * 2**20  # parameters stepped at once: their new state is made in memory first


def check_offload(offload: str | None, shard: str, offload_dir: str | os.PathLike[str] | None) -> None:
    """Refuse what cannot be offloaded, naming the argument."""
    if offload is None:
        if offload_dir is not None:
            raise ValueError(
                "offload_dir= is where offload='optimizer' or 'parameters' puts state; offload is None"
            )
        return
    if offload not in OFFLOADS:
        raise ValueError(f"offload must be None, 'optimizer' or 'parameters', got {offload!r}")
    if offload == "parameters" and shard != "parameters":
        raise ValueError(
            f"offload='parameters' needs shard='parameters': at shard={shard!r} every process holds every "
            "parameter whole between steps, so there is no parameter shard to take off it; use "
            "offload='optimizer' (optimizer state, and beside an accelerator the shards it steps)"
        )


class ShardOffload:
    """Places one ShardedStrategy's shards and optimizer state, and steps its shards (see the module)."""

    def __init__(
        self, what: str, device: torch.device, *, rank: int, directory: str | os.PathLike[str] | None
    ) -> None:
        self.what = what
        self.device = device
        # Beside an accelerator the optimizer's shards are host tensors apart from the device's values;
        # on a CPU they are the same tensors, and files hold what is offloaded.
        self.separate = device.type != "cpu"
        self.store: HostStore = PinnedStore() if self.separate else DiskStore(directory, rank=rank)
        self._hidden: dict[nn.Parameter, torch.Tensor] = {}  # .grad kept from the optimizer's own step

    @property
    def directory(self) -> str | None:
        """Where the files are (on a CPU), else None."""
        return self.store.directory if isinstance(self.store, DiskStore) else None

    # -- placement ---------------------------------------------------------------------------------
    def place(self, block: ParameterBlock) -> None:
        """Move a new (materialised) block's shards where they live under this offload."""
        if block.flat_shard is not None:  # shard="parameters": the shards are views of the flat shard
            if not (self.separate or self.what == "parameters"):
                return  # on a CPU with offload="optimizer", only the state leaves memory
            host = copy_into(self.store, block.flat_shard)
            block.flat_shard = host
            for i, shard in enumerate(block.shards):
                off, c = block.layout.offsets[i], block.layout.chunks[i]
                shard.data = host[off : off + c]
            block.keep_device_copy = self.separate and self.what == "optimizer"
        elif self.separate:  # the model's parameters stay on the device; the optimizer steps copies
            for shard in block.shards:
                shard.data = copy_into(self.store, shard.detach())

    def adopt_state(self, optimizer: torch.optim.Optimizer, shards: Iterable[torch.Tensor]) -> None:
        """Per-element state of ``shards`` (momentum, moments) into the files (on a CPU) or beside its
        shard on the host (state cut from a device tensor, or loaded)."""
        for p in shards:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in list(state.items()):
                if not is_per_element(key, value, p.shape):
                    continue
                if isinstance(self.store, DiskStore):
                    if not is_offloaded(value):
                        state[key] = copy_into(self.store, value)
                elif value.device != p.device:
                    state[key] = value.to(p.device)

    # -- the optimizer step ------------------------------------------------------------------------
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        managed: Callable[[nn.Parameter], bool],
        args: tuple,
        kwargs: dict,
    ) -> None:
        """Step the managed shards of ``optimizer`` in chunks, then keep their ``.grad`` from the
        optimizer's own step until :meth:`after_step` (called from a step pre-hook)."""
        if args[1:] or kwargs:
            raise SpreadError(
                "ShardedStrategy(offload=...) steps the optimizer in chunks and cannot re-run a closure: "
                "call optimizer.step() without one"
            )
        step = _unhooked_step(optimizer)
        groups = optimizer.param_groups
        originals = [group["params"] for group in groups]
        chunks = _chunks(
            [[p for p in params if managed(p) and p.grad is not None] for params in originals],
            STEP_CHUNK_BYTES,
        )
        try:
            for chunk in chunks:
                for group, mine in zip(groups, chunk, strict=True):
                    group["params"] = mine
                step(optimizer)
                self.adopt_state(optimizer, [p for mine in chunk for p in mine])
        finally:
            for group, params in zip(groups, originals, strict=True):
                group["params"] = params
        for chunk in chunks:
            for mine in chunk:
                for p in mine:
                    assert p.grad is not None
                    self._hidden[p] = p.grad
                    p.grad = None

    def after_step(self) -> None:
        """Give the stepped shards their ``.grad`` back (``zero_grad`` and clipping see them as usual)."""
        for p, grad in self._hidden.items():
            p.grad = grad
        self._hidden.clear()

    def close(self) -> None:
        self._hidden.clear()
        self.store.close()


def _unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The optimizer class's ``step`` without torch's hook wrapper (ours would run again)."""
    step = type(optimizer).step
    inner = getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None
    if inner is None:
        raise SpreadError(
            f"ShardedStrategy(offload=...) cannot step {type(optimizer).__name__} in chunks: its step is "
            "not torch.optim.Optimizer's hooked step"
        )
    return inner


def _chunks(per_group: Sequence[list[nn.Parameter]], cap_bytes: int) -> list[list[list[nn.Parameter]]]:
    """Consecutive parameters (group by group) in chunks of at most ``cap_bytes`` (a larger one alone),
    each chunk as one list per group."""
    chunks: list[list[list[nn.Parameter]]] = []
    current: list[list[nn.Parameter]] | None = None
    size = 0
    for g, params in enumerate(per_group):
        for p in params:
            nbytes = p.numel() * p.element_size()
            if current is None or (size + nbytes > cap_bytes and size > 0):
                current = [[] for _ in per_group]
                chunks.append(current)
                size = 0
            current[g].append(p)
            size += nbytes
    return chunks
