"""EMA: an exponential moving average of the weights, kept beside training and evaluated on request.

Averaged weights generalise better than the last ones for many models (Polyak averaging; the
``ema_momentum`` of Keras optimizers, timm's ``ModelEma``). After every optimizer step the callback
moves its copy towards the weights: ``ema = decay * ema + (1 - decay) * w``. It starts from the
weights before the first step of the first ``fit`` (as Keras's EMA does), so after ``t`` steps
``ema = decay**t * w_0 + (1 - decay) * sum_i decay**(t-i) * w_i``.

What is averaged: every floating-point entry of the model's ``state_dict`` (parameters, and buffers
such as BatchNorm's running statistics, as timm does, so the statistics match the averaged weights);
integer buffers (``num_batches_tracked``) are not averaged and not swapped.

Under every data-parallel strategy the weights are the same on every rank after a step (and buffers
are kept in sync), so each rank keeps the same average without communicating. Under a pipeline each
rank's average is current for its own stage's layers, which is what its stage evaluates with; its
backup state is gathered to the one-device layout through ``strategy.full_state_dict``. Parameter
servers and ShardedStrategy at ``"parameters"`` are refused (``Strategy.local_state_dict`` raises
there): a task's model is a cache, a sharded rank's holds 1/N of each parameter.

``BackupAndRestore`` saves the average with every backup (:meth:`EMA.state_dict`) and restores it
before the first step, so a resumed run continues the average exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from spread.errors import SpreadError
from spread.train.callbacks._monitor import invalid
from spread.train.callbacks.base import Callback, Logs


class EMA(Callback):
    """Exponential moving average of the model's weights, updated after each optimizer step.

    Args:
        decay: weight of the old average at each update, in ``[0, 1)`` (0.999: an average over
            roughly the last 1000 steps).
        use_for_evaluate: ``Trainer.evaluate``, ``predict`` and ``fit``'s validation run with the
            averaged weights (swapped in, and back afterwards). The trainer looks for this callback
            among ``Trainer(callbacks=...)``, the running ``fit``'s and ``evaluate(callbacks=...)``.

    Use :meth:`applied` to do anything else with the averaged weights (save them, export them).
    """

    def __init__(self, decay: float = 0.999, use_for_evaluate: bool = True) -> None:
        super().__init__()
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 <= decay < 1.0:
            raise invalid("decay", decay, "a number in [0, 1)")
        if not isinstance(use_for_evaluate, bool):
            raise invalid("use_for_evaluate", use_for_evaluate, "True or False")
        self.decay = float(decay)
        self.use_for_evaluate = use_for_evaluate
        self.shadow: dict[str, torch.Tensor] | None = None  # state_dict key -> averaged value
        self.num_updates = 0
        self._step_before: int | None = None  # global step when the current batch began
        self._updated_at: int | None = None  # global step the average last took in

    # -- training ----------------------------------------------------------------------------------
    def _live(self) -> dict[str, torch.Tensor]:
        """The model's floating-point state, as tensors sharing the model's storage."""
        return {
            k: v
            for k, v in self.trainer.strategy.local_state_dict(self.trainer.model).items()
            if v.is_floating_point()
        }

    def on_train_begin(self, logs: Logs | None = None) -> None:
        try:
            self._live()
        except SpreadError as exc:  # the strategy's model is not the current weights on every rank
            raise SpreadError(f"EMA needs the current weights in every process: {exc}") from None

    def on_train_batch_begin(self, step: int, logs: Logs | None = None) -> None:
        if self.shadow is None:  # the weights before the first step (after any restore)
            self.shadow = {k: v.detach().clone() for k, v in self._live().items()}
        self._step_before = self.trainer.global_step

    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        self._catch_up()

    @torch.no_grad()
    def _catch_up(self) -> None:
        """Fold in the weights of this batch's optimizer step, once. Also called by
        :meth:`state_dict` and :meth:`applied`, so a backup taken by a callback that runs before this
        one in the same ``on_train_batch_end`` already holds this step's average."""
        trainer = self.trainer
        step = trainer.global_step
        if self.shadow is None or self._step_before is None or step in (self._step_before, self._updated_at):
            return  # before training, no optimizer step this batch (skip_step), or done already
        for key, value in self._live().items():
            self.shadow[key].mul_(self.decay).add_(value.to(self.shadow[key].dtype), alpha=1.0 - self.decay)
        self.num_updates += 1
        self._updated_at = step

    # -- the averaged weights ----------------------------------------------------------------------
    @contextmanager
    def applied(self) -> Iterator[None]:
        """Inside, the model holds the averaged weights; on exit its own weights come back."""
        if self.shadow is None:
            raise RuntimeError("EMA has no average yet: it starts with the first training step")
        self._catch_up()
        live = self._live()
        saved = {k: live[k].detach().clone() for k in self.shadow}
        with torch.no_grad():
            for key, value in self.shadow.items():
                live[key].copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for key, value in saved.items():
                    live[key].copy_(value)

    def evaluation_weights(self) -> AbstractContextManager[None]:
        if self.use_for_evaluate and self.shadow is not None:
            return self.applied()
        return nullcontext()

    # -- backups -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The average in the one-device layout (collective under a pipeline), the update count and
        the decay; ``{}`` before the first step."""
        if self.shadow is None:
            return {}
        with self.applied():
            full = self.trainer.strategy.full_state_dict(self.trainer.model)
            shadow = {k: full[k].detach().clone() for k in self.shadow}
        return {"decay": self.decay, "num_updates": self.num_updates, "shadow": shadow}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        live = self._live()
        saved = state["shadow"]
        missing = sorted(set(live) - set(saved))
        unexpected = sorted(set(saved) - set(live))
        if missing or unexpected:
            raise ValueError(
                f"the saved EMA does not fit this model: missing {missing}, unexpected {unexpected}"
            )
        if float(state["decay"]) != self.decay:
            warnings.warn(
                f"EMA: the backup was averaged with decay={state['decay']}, this callback uses "
                f"decay={self.decay}; continuing with {self.decay}",
                stacklevel=2,
            )
        self.shadow = {k: saved[k].to(device=live[k].device, dtype=live[k].dtype).clone() for k in live}
        self.num_updates = int(state["num_updates"])
        self._step_before = self._updated_at = None
