"""Which stage owns which tensor, and what follows from it: tied gradients and stale copies.

Every rank of a pipeline holds the whole model but trains only its stage. Two consequences need
care, and both follow from ``stage_tensors`` (per stage, the user's parameters and buffers it uses):

* a parameter several stages use (GPT-2's tied embedding and LM head) gets a part of its gradient on
  each of their ranks: :class:`TiedGradients` sums those parts after each step, so every copy takes
  the same optimizer step and it stays one parameter (DeepSpeed's ``TiedLayerSpec`` does the same);
* the layers other stages train go out of date in this rank's copy: :class:`StaleStateGuard` makes
  ``model.state_dict()`` refuse then, instead of returning a half-trained model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spread.comm import Collectives
from spread.comm.ops import destroy_group
from spread.errors import SpreadError


def first_owned(stage_tensors: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Per stage, the tensors it is the first stage to use (a tied tensor goes with its first)."""
    seen: set[int] = set()
    owned = []
    for tensors in stage_tensors:
        owned.append([t for t in tensors if id(t) not in seen])
        seen.update(id(t) for t in tensors)
    return owned


class TiedGradients:
    """Sum the gradients of parameters shared by several stages over those stages' ranks.

    Collective to build: every rank creates every group (one per set of stages sharing parameters,
    per pipeline replica), in the same order, as ``dist.new_group`` requires. Global rank
    ``replica * stages + stage`` holds stage ``stage`` of pipeline replica ``replica``.
    """

    def __init__(
        self,
        stage_tensors: Sequence[Sequence[torch.Tensor]],
        stage: int,
        replica: int,
        replicas: int,
        device: torch.device,
    ) -> None:
        stages = len(stage_tensors)
        users: dict[int, list[int]] = {}
        params: dict[int, nn.Parameter] = {}
        for s, tensors in enumerate(stage_tensors):
            for t in tensors:
                if isinstance(t, nn.Parameter):
                    users.setdefault(id(t), []).append(s)
                    params[id(t)] = t
        by_set: dict[tuple[int, ...], list[nn.Parameter]] = {}
        self.counted_elsewhere: set[int] = set()  # ids of tied parameters an earlier stage counts
        for pid, sharing in users.items():
            if len(sharing) > 1:
                by_set.setdefault(tuple(sharing), []).append(params[pid])
                if stage != sharing[0]:
                    self.counted_elsewhere.add(pid)
        self._groups: list[Any] = []
        self._mine: list[tuple[list[nn.Parameter], Collectives]] = []
        for stage_set, shared in sorted(by_set.items(), key=lambda item: item[0]):
            for r in range(replicas):
                group = dist.new_group([r * stages + s for s in stage_set])
                self._groups.append(group)
                if r == replica and stage in stage_set:
                    self._mine.append((shared, Collectives(group, device=device)))

    @property
    def shared(self) -> list[nn.Parameter]:
        """The parameters this rank shares with other stages."""
        return [p for shared, _ in self._mine for p in shared]

    def sum(self) -> None:
        """After this rank's backward (and the hybrid exchange): each shared parameter's ``.grad``
        becomes the sum over the stages using it (a stage that produced none adds zeros)."""
        for shared, collectives in self._mine:
            for p in shared:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in shared])  # type: ignore[union-attr]
            collectives.all_reduce(flat, name="tied_grads")
            offset = 0
            for p in shared:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))  # type: ignore[union-attr]
                offset += p.numel()

    def close(self) -> None:
        """Destroy the groups and drop every reference to them (their threads are joined now)."""
        for _, collectives in self._mine:
            collectives.close()
        self._mine.clear()
        for group in self._groups:
            destroy_group(group)
        self._groups.clear()


class StaleStateGuard:
    """``state_dict()`` of ``model`` (or of a submodule holding another stage's tensors) raises
    :class:`SpreadError` while :attr:`stale` is set, outside :meth:`reading`.

    Why refuse rather than not materialise other stages' layers: every rank holding every layer is
    what lets a one-device ``state_dict`` load on every rank, ``gather_state_dict`` fill the copies
    in place and an empty batch run locally. Why not gather inside ``state_dict()``: that would be a
    collective, and a script calling it on rank 0 alone would hang until the deadline. A
    ``load_state_dict`` on the model makes the copy current (every rank loads the same state).
    """

    def __init__(
        self, model: nn.Module, stage_tensors: Sequence[Sequence[torch.Tensor]], stage: int, rank: int
    ) -> None:
        self.stale = False
        self._reading = False
        self.stage, self.rank = stage, rank
        mine = {id(t) for t in stage_tensors[stage]}
        others = {id(t) for s, ts in enumerate(stage_tensors) if s != stage for t in ts} - mine
        self._hooks: list[Any] = []
        if not others:
            return
        for name, module in model.named_modules():
            held = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if any(id(t) in others for t in held):
                self._hooks.append(module.register_state_dict_pre_hook(partial(self._refuse, name)))
        self._hooks.append(model.register_load_state_dict_post_hook(self._loaded))

    @contextmanager
    def reading(self) -> Iterator[None]:
        """The strategy's own reads of the whole state (tracing, the gather) pass the guard."""
        self._reading, before = True, self._reading
        try:
            yield
        finally:
            self._reading = before

    def _refuse(self, name: str, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.stale and not self._reading:
            where = f"module {name!r}" if name else "the model"
            raise SpreadError(
                f"rank {self.rank} (pipeline stage {self.stage}) trains only its own stage: {where} "
                "holds layers other stages train, whose values here are out of date, so its "
                "state_dict() would be a half-trained model. Call strategy.gather_state_dict(model) on "
                "every rank instead (it returns the full, current state_dict; model.state_dict() works "
                "again until the next training step)"
            )

    def _loaded(self, module: nn.Module, incompatible: Any) -> None:
        self.stale = False

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
