"""BackupAndRestore: resume an interrupted ``fit`` at the exact step, with TF's semantics.

A policy over the state seam: this callback decides *when* to back up (every epoch or every N
optimizer steps, and on a preemption notice) and restores when ``fit`` starts again; *what* is
saved and how it is laid out is the Trainer's and the strategy's business. A backup is
``strategy.save_checkpoint(backup_dir, {"model", "optimizer", "trainer"})``: the model and
optimizer in the strategy's layout (whole on the chief, pieces per rank under ShardedStrategy,
gathered pipeline stages, the servers' shards), and the Trainer's own state (``Trainer.state_dict``:
step, data position, the epoch's running sums, schedule, loss scaler, every rank's RNG streams,
and every callback's state: History, EarlyStopping's patience, ModelCheckpoint's best, EMA's
average, ...). On the next ``fit`` with the same directory every rank restores them, and training
continues after the last saved batch: no sample repeated or skipped, and the final weights equal an
uninterrupted run's.

A backup that cannot continue exactly is refused before any weight is overwritten
(:class:`~spread.errors.CheckpointMismatchError` listing every difference): another model or
optimizer, another global batch size or data seed, or a strategy of another kind. The replica
count may change, and so may the strategy within synchronous data parallelism (MultiWorkerMirrored
to Sharded and back): their backups hold the one-device state (or its pieces, which DCP reshards)
and count data in global batches, so a job backed up at 2 processes resumes at 1, 3 or 4 and ends
with the weights the 2-process run would have had (float tolerance: the sums are split
differently). Random layers (dropout) draw from each rank's own stream, so they cannot repeat what
ranks that no longer exist would have drawn.

Every rank must use the callback (the save is collective where the strategy's layout is). Writes
are atomic and checksummed; a corrupt newest backup is skipped with a warning for the previous one.

Backups are asynchronous by default (``async_save=True``): at the step boundary the state is copied
off the training state (``strategy.save_checkpoint(..., blocking=False)``: a host copy) and written
and committed on a background thread while training goes on; the stall is the copy. The next backup
waits for the previous write and raises its failure on every rank; so do the end of ``fit`` (no
backup lost, no thread left behind) and a preemption notice (the backup is committed before the
process exits). A crash during a background write leaves the previous backup as the latest, so a
restart repeats at most one more backup interval than with ``async_save=False``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from spread.train.callbacks._monitor import invalid
from spread.train.callbacks.base import Callback, Logs
from spread.train.preemption import PreemptionWatch, TrainingPreempted


class BackupAndRestore(Callback):
    """Back up training state to ``backup_dir`` and restore it when ``fit`` starts again.

    Args:
        backup_dir: directory for the backups (shared by all ranks when they run on several machines).
        save_freq: ``"epoch"`` or a positive number of optimizer steps between backups.
        delete_checkpoint: remove ``backup_dir`` when training finishes normally.
        keep: how many backups to keep (older ones are deleted after each save).
        save_on_preemption: on SIGTERM, back up at the next step boundary and exit with code 143
            (:mod:`spread.train.preemption`; not under parameter servers, whose tasks step alone).
        async_save: write each backup on a background thread after copying the state at the step
            boundary (the default); False: every rank waits until each backup is committed.
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        keep: int = 2,
        save_on_preemption: bool = True,
        async_save: bool = True,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1
        ):
            raise invalid("save_freq", save_freq, '"epoch" or a positive integer')
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(
                f"Invalid value for argument `keep`. Expected a positive integer. Received: keep={keep!r}"
            )
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.keep = keep
        self.save_on_preemption = save_on_preemption
        if not isinstance(async_save, bool):
            raise invalid("async_save", async_save, "True or False")
        self.async_save = async_save
        self.preemption = PreemptionWatch()
        self.restored_step: int | None = None  # the step of the backup the last fit resumed from
        self.resumed_from_replicas: int | None = None  # set when that backup had another replica count

    def _state(self) -> dict[str, Any]:
        trainer = self.trainer
        return {"model": trainer.model, "optimizer": trainer.optimizer, "trainer": trainer}

    # -- restore ---------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        trainer = self.trainer
        if self.save_on_preemption and trainer.strategy.steps_together:
            self.preemption.start()
        if trainer.strategy.awaiting_state:  # joined a running job: a live peer streams the state
            return
        restored = trainer.strategy.load_checkpoint(self.backup_dir, self._state())
        if restored is None:
            return
        if not restored.restored_objects:  # the servers hold this task's step count, nothing more
            trainer.resume_at(restored.resume_step)
        self.restored_step = restored.step
        if restored.written_at_replicas not in (None, trainer.strategy.num_replicas_in_sync):
            self.resumed_from_replicas = restored.written_at_replicas

    # -- back up ---------------------------------------------------------------------------------
    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        saved = isinstance(self.save_freq, int) and self.trainer.global_step % self.save_freq == 0
        # A SIGTERM during the save is agreed on by the vote after it.
        stop_after_save = self._save() if saved else False
        if self.preemption.installed and (self.trainer.stop_voted or stop_after_save):
            if not saved:
                self._save()
            self.trainer.strategy.wait_for_checkpoint()  # committed before the process exits
            self.preemption.acknowledge()
            preempted = TrainingPreempted(self.trainer.global_step, self.backup_dir)
            if self.trainer.is_chief:  # SystemExit prints nothing: say what happened, once
                print(f"spread: {preempted}", file=sys.stderr, flush=True)
            raise preempted

    def asks_to_stop(self) -> bool:
        """A SIGTERM reached this rank: every rank backs up after this step and exits (the Trainer
        carries the vote with the step's statistics)."""
        return self.preemption.installed and self.preemption.requested

    def on_fit_exit(self) -> None:
        """Leaving ``fit`` by an exception: the backup in flight is still committed (or its failure
        warned about) before this returns, so no write outlives ``fit``; after a normal end,
        :meth:`on_train_end` has confirmed it already."""
        self.preemption.stop()
        self.trainer.strategy.finish_checkpoint_writes()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        self.trainer.strategy.wait_for_checkpoint()  # the last backup is committed (or fails here)
        if self.delete_checkpoint and self.trainer.is_chief:
            self.trainer.strategy.delete_checkpoints(self.backup_dir)

    def _save(self) -> bool:
        """Back up this step; returns on every rank once it is durable: whether some rank asks to
        stop (a SIGTERM, also one that came during the save).

        With ``async_save=False`` the save is a synchronisation point (the strategy returns once the
        backup is committed, and raises on every rank when it is not): no rank runs past step N
        until the backup of step N is durable. Asynchronously, the backup of step N is committed
        before the one of step N + save_freq starts (and its failure raised on every rank then);
        a rank that dies meanwhile can cost that backup, never the previous one.
        """
        trainer = self.trainer
        strategy = trainer.strategy
        strategy.save_checkpoint(
            self.backup_dir,
            self._state(),
            step=trainer.global_step,
            keep=self.keep,
            blocking=not self.async_save,
        )
        stop = self.asks_to_stop()
        if strategy.steps_together:
            votes = strategy.gather_from_every_rank(torch.tensor([[1.0 if stop else 0.0]]))
            stop = bool((votes > 0).any())
        return stop
