"""BackupAndRestore: resume an interrupted ``fit`` at the exact step, with TF's semantics.

Saved at every ``save_freq`` (end of each epoch, or every N optimizer steps): model and optimizer
state, the Trainer's own state (learning-rate scheduler, fp16 loss scaler, the epoch's gradient-norm
sums: ``Trainer.training_state``), the step and epoch, the data pipeline's position (epoch and
batches consumed), the running loss/metric sums of the current epoch, the History so far, and the
RNG states (torch's for every rank, gathered to the chief; Python's and NumPy's of the chief). On
the next ``fit`` with the same directory every rank restores them, and training continues after the
last saved batch: no sample repeated or skipped, and the final weights equal an uninterrupted run's.

A backup records the strategy's class and replica count, the global batch size and the optimizer's
class; restoring into a model, optimizer or strategy that differs raises
:class:`~spread.errors.CheckpointMismatchError` listing every mismatched key and field, before any
weight is overwritten (an exact resume is impossible across such a change). The replica count alone
may change where the strategy says so
(:meth:`~spread.strategies.Strategy.replica_count_change_refusal`): data-parallel backups hold the
one-device state (ShardedStrategy: every rank's piece of it, which DCP reshards) and count data in
global batches, so a job backed up at 2 processes resumes at 1, 3
or 4 and ends with the weights the 2-process run would have had (float tolerance: the sums are split
differently). Random layers (dropout) draw from each rank's own stream, so they cannot repeat what
ranks that no longer exist would have drawn; ranks beyond the saved count get a stream derived
from a saved one.

Callbacks with state of their own (:class:`~spread.callbacks.EMA`) are part of the backup through
:meth:`Callback.state_dict`/:meth:`Callback.load_state_dict`, keyed by class name (``EMA``, then
``EMA#1`` for a second one): collected on every rank at each backup, restored on every rank that
reads it.

Every rank must use the callback (it gathers RNG states collectively); only the chief writes,
except a strategy's per-rank part (``BackupState.shards``), which every rank writes in parallel.
Writes are atomic (``spread.checkpoint.CheckpointManager``); a corrupt newest backup is skipped with
a warning in favour of the previous one.

What differs between strategies is the strategy's own business, through the methods of
:class:`~spread.strategies.Strategy` this callback calls: the model's and optimizer's state
(``backup_state``/``restore_backup_state``: by default the one-device layout of
``model_state_dict``/``optimizer_state_dict``, collective where ``state_is_collective``: a
pipeline's stages; ShardedStrategy: each rank's shards, ``backup_shards_like`` saying what a rank
reads back), every rank's RNG states (``gather_from_every_rank``), what the chief's backup
holds besides (``backup_extras``/``restore_backup_extras``: parameter servers' shards and ledgers),
ranks that learn where to resume from the chief instead of reading the backup
(``restores_on_chief_only``/``wait_for_chief_restore``), ranks that save their own part of each
backup because no collective reaches them (``ranks_with_own_backup``, under ``task-<rank>/``; the
chief then restores the newest backup every such rank saved too), and when backups may be deleted
(``wait_before_deleting_backups``).
"""

from __future__ import annotations

import random
import shutil
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spread.checkpoint import CheckpointManager
from spread.checkpoint.compat import field_mismatches, optimizer_mismatches, raise_if, tensor_mismatches
from spread.checkpoint.manager import SHARDS_KEY
from spread.errors import SpreadError
from spread.strategies import BackupState
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
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        keep: int = 2,
        save_on_preemption: bool = True,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq < 1
        ):
            raise invalid("save_freq", save_freq, '"epoch" or a positive integer')
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.manager = CheckpointManager(backup_dir, keep=keep)
        self.keep = keep
        self.save_on_preemption = save_on_preemption
        self.preemption = PreemptionWatch()
        self.restored_step: int | None = None
        self.resumed_from_replicas: int | None = None  # set when a backup of another count resumed

    # -- restore ---------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        trainer = self.trainer
        strategy = trainer.strategy
        if self.save_on_preemption and not strategy.restores_on_chief_only:
            self.preemption.start()
        if strategy.restores_on_chief_only and not trainer.is_chief:
            self._resume_after_the_chief()
            return
        own_parts = strategy.ranks_with_own_backup()
        if own_parts:
            found = self._load_for_every_task()
        else:
            found = self.manager.load_latest(shards_like=self._shards_like)
        if found is None:
            if trainer.is_chief:
                strategy.restore_backup_extras(None, 0)
            return
        step, state = found
        self._check_compatible(state, step)
        strategy.restore_backup_state(
            trainer.model,
            trainer.optimizer,
            BackupState(state["model"], state["optimizer"], state.get(SHARDS_KEY)),
        )
        trainer.load_training_state(state.get("trainer") or {})
        trainer.global_step = int(state["global_step"])
        trainer.history.history = {k: list(v) for k, v in state["history"].items()}
        trainer.history.epoch = list(state["history_epochs"])
        _set_rng(state["rng"], trainer.strategy.rank)
        self._restore_callbacks(state.get("callbacks") or {})
        trainer.resume_point = {
            "epoch": int(state["epoch"]),
            "batch": int(state["batch"]),
            "sums": state["sums"],
        }
        if trainer.is_chief:
            strategy.restore_backup_extras(state.get("strategy"), trainer.global_step)
        self.restored_step = step

    def _shards_like(self, saved: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        """What this rank reads of a backup's per-rank part (read per candidate backup, so a
        corrupt shard falls back to an older backup)."""
        return self.trainer.strategy.backup_shards_like(self.trainer.model, self.trainer.optimizer, saved)

    def _resume_after_the_chief(self) -> None:
        """A rank that does not read the backup: wait for the chief's word (a backup restored, or a
        fresh start), then resume at the step the strategy says (parameter servers: after this
        task's last step the servers hold; the model is the servers' variables). A rank that saves
        its own part of each backup gets its RNG states, History and running sums back from it, so
        it resumes bit for bit; otherwise they start afresh."""
        trainer = self.trainer
        strategy = trainer.strategy
        restore = strategy.wait_for_chief_restore()
        if restore is None:
            return
        held = restore.resume_step
        steps = trainer.params.get("steps")
        if not steps:
            raise SpreadError(
                f"BackupAndRestore under {type(strategy).__name__} needs a dataset with a length (or "
                "steps_per_epoch) to turn a task's step count back into a data position"
            )
        trainer.global_step = held
        trainer.resume_point = {
            "epoch": held // steps,
            "batch": held % steps,
            "sums": torch.zeros(2 + len(trainer.metrics), dtype=torch.float64),
        }
        self.restored_step = restore.backup_step
        own_part = strategy.rank in strategy.ranks_with_own_backup()
        own = self._task_manager(strategy.rank).load_latest(step=held) if own_part else None
        if own is None:  # no state of this rank's own: the schedule is replayed to the resume point
            trainer.replay_training_state(held, held // steps)
        else:  # this rank's RNG states, History, running sums and Trainer state too
            _, state = own
            trainer.load_training_state(state.get("trainer") or {})
            trainer.history.history = {k: list(v) for k, v in state["history"].items()}
            trainer.history.epoch = list(state["history_epochs"])
            trainer.resume_point["sums"] = state["sums"]
            _set_rng(state["rng"], 0)

    def _stateful_callbacks(self) -> dict[str, Callback]:
        """The running fit's other callbacks by backup key: class name, ``#k`` for the k-th repeat."""
        keyed: dict[str, Callback] = {}
        counts: dict[str, int] = {}
        for cb in self.trainer.active_callbacks:
            if cb is self:
                continue
            name = type(cb).__name__
            k = counts.get(name, 0)
            counts[name] = k + 1
            keyed[name if k == 0 else f"{name}#{k}"] = cb
        return keyed

    def _callback_states(self) -> dict[str, Any]:
        """Every callback's :meth:`Callback.state_dict` that is not empty (called on every rank)."""
        states = {key: cb.state_dict() for key, cb in self._stateful_callbacks().items()}
        return {key: state for key, state in states.items() if state}

    def _restore_callbacks(self, saved: Mapping[str, Any]) -> None:
        callbacks = self._stateful_callbacks()
        for key, state in saved.items():
            if key in callbacks:
                callbacks[key].load_state_dict(state)
            else:
                warnings.warn(
                    f"BackupAndRestore: the backup holds the state of a {key} callback that this fit "
                    "does not have; it is ignored",
                    stacklevel=2,
                )

    def _task_manager(self, rank: int) -> CheckpointManager:
        # One more than the chief keeps: a task may be one backup ahead of a chief that died saving.
        return CheckpointManager(Path(self.backup_dir) / f"task-{rank:05d}", keep=self.keep + 1)

    def _load_for_every_task(self) -> tuple[int, dict[str, Any]] | None:
        """The newest backup of the chief that every rank saving its own part also saved (RNG states,
        History), so that every rank resumes bit for bit."""
        steps = sorted((int(c.name.removeprefix("ckpt-")) for c in self.manager.checkpoints()), reverse=True)
        for step in steps:
            if all(
                (self._task_manager(r).directory / f"ckpt-{step:010d}").is_dir()
                for r in self.trainer.strategy.ranks_with_own_backup()
            ):
                found = self.manager.load_latest(step=step, shards_like=self._shards_like)
                if found is not None:
                    return found
        # No common step: resume anyway (tasks' RNG afresh).
        return self.manager.load_latest(shards_like=self._shards_like)

    def _config(self) -> dict[str, Any]:
        """What must be unchanged for an exact resume: the strategy, its replicas, the batch size."""
        trainer = self.trainer
        return {
            "strategy": type(trainer.strategy).__name__,
            "num_replicas_in_sync": trainer.strategy.num_replicas_in_sync,
            "global_batch_size": trainer.params.get("global_batch_size"),
            "optimizer": type(trainer.optimizer).__name__,
        }

    def _check_compatible(self, state: dict[str, Any], step: int) -> None:
        """Refuse, listing every difference, a backup made for another model, optimizer or strategy.

        Another replica count is no difference where the strategy resumes at any count
        (:meth:`~spread.strategies.Strategy.replica_count_change_refusal`); otherwise its reason is
        in the list."""
        trainer = self.trainer
        saved_config = state.get("config", {})
        expected = self._config()
        problems = field_mismatches(saved_config, expected)
        saved_replicas = saved_config.get("num_replicas_in_sync")
        if saved_config.get("strategy") == expected["strategy"] and saved_replicas not in (
            None,
            expected["num_replicas_in_sync"],
        ):  # the same strategy at another replica count: its own call
            refusal = trainer.strategy.replica_count_change_refusal(int(saved_replicas))
            replicas_line = next(p for p in problems if p.startswith("num_replicas_in_sync:"))
            if refusal is None:
                problems.remove(replicas_line)
                self.resumed_from_replicas = int(saved_replicas)
            else:
                problems[problems.index(replicas_line)] = f"{replicas_line} ({refusal})"
        strategy = trainer.strategy
        # A backup with a per-rank part holds the rest of the model; one without, all of it.
        model_like = strategy.backup_model_like if SHARDS_KEY in state else strategy.local_state_dict
        problems += tensor_mismatches(state["model"], model_like(trainer.model))
        problems += optimizer_mismatches(
            state["optimizer"],
            trainer.optimizer,
            trainer.strategy.optimizer_parameter_shapes(trainer.optimizer),
        )
        where = self.manager.directory / f"ckpt-{step:010d}"
        raise_if(problems, str(where), "model, optimizer and strategy")

    # -- back up ---------------------------------------------------------------------------------
    def on_train_batch_end(self, step: int, logs: Logs | None = None) -> None:
        saved = isinstance(self.save_freq, int) and self.trainer.global_step % self.save_freq == 0
        # A SIGTERM during the save is agreed on by the save's own closing exchange.
        stop_after_save = self._save() if saved else False
        if self.preemption.installed and (self.trainer.stop_voted or stop_after_save):
            if not saved:
                self._save()
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
        self.preemption.stop()

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save()

    def on_train_end(self, logs: Logs | None = None) -> None:
        if self.delete_checkpoint and self.trainer.is_chief:
            self.trainer.strategy.wait_before_deleting_backups()
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    def _save(self) -> bool:
        """Gather the RNG states, let the chief write, and return on every rank once it is durable:
        whether some rank asks to stop (a SIGTERM, also one that came during the save).

        The closing collective makes a backup a synchronisation point: no rank runs past step N until
        the backup of step N is committed, so a rank that dies just after a save never takes the
        chief's half-written backup down with it (the restart resumes from N, not from the one
        before). A chief that fails to write says so to the others instead of leaving them waiting.
        """
        trainer = self.trainer
        strategy = trainer.strategy
        rng = _torch_rng_states().unsqueeze(0)
        all_rng = strategy.gather_from_every_rank(rng)
        backup = strategy.backup_state(trainer.model, trainer.optimizer)  # collective where it must be
        callback_states = self._callback_states()  # may be collective too
        failure: BaseException | None = None
        if backup.shards is not None:
            # Every rank writes its part, the chief adds the replicated one: a collective save, so
            # a rank that fails makes DCP raise on every rank, and a chief that fails to commit
            # leaves the others at the commit barrier until its timeout names it.
            self._write(all_rng, backup, callback_states)
        elif trainer.is_chief:
            try:
                self._write(all_rng, backup, callback_states)
            except Exception as exc:  # reported to the other ranks below, then re-raised
                failure = exc
        elif strategy.rank in strategy.ranks_with_own_backup():  # its own part, beside the chief's
            self._task_manager(strategy.rank).save(trainer.global_step, self._common_state(rng))
        stop = self.asks_to_stop()
        if strategy.num_replicas_in_sync > 1 or strategy.state_is_collective:
            flags = torch.tensor([[0.0 if failure else 1.0, 1.0 if stop else 0.0]])
            gathered = strategy.gather_from_every_rank(flags)
            written, stop = gathered[:, 0], bool((gathered[:, 1] > 0).any())
            if failure is None and bool((written < 1).any()):
                raise SpreadError(
                    f"the chief failed to write the backup of step {trainer.global_step} to "
                    f"{self.backup_dir} (its log says why); stopping so that no rank runs ahead of it"
                )
        if failure is not None:
            raise failure
        return stop

    def _common_state(self, all_rng: torch.Tensor) -> dict[str, Any]:
        """Position, running sums, History and RNG states (torch's as given): what every backup holds."""
        trainer = self.trainer
        position = trainer.train_dataset.state_dict()
        if trainer.running_sums is None:
            raise RuntimeError("BackupAndRestore saves during fit only (no running sums outside it)")
        totals = trainer.running_sums.totals
        sums = totals.clone() if position["batch"] else torch.zeros_like(totals)
        version, internal, gauss = random.getstate()
        return {
            "global_step": trainer.global_step,
            "epoch": position["epoch"],
            "batch": position["batch"],
            "sums": sums,
            "history": {k: list(v) for k, v in trainer.history.history.items()},
            "history_epochs": list(trainer.history.epoch),
            "trainer": trainer.training_state(),
            "rng": {
                "torch": all_rng.cpu(),
                "python": (version, list(internal), gauss),
                "numpy": torch.from_numpy(_numpy_state()[1].astype(np.int64)),
            },
        }

    def _write(self, all_rng: torch.Tensor, backup: BackupState, callback_states: dict[str, Any]) -> None:
        """The chief writes the backup; with a per-rank part every rank calls this (a collective
        save: each rank's shards, the chief's replicated state, one commit)."""
        trainer = self.trainer
        if backup.shards is not None and not trainer.is_chief:
            self.manager.save(trainer.global_step, {}, shards=backup.shards)
            return
        state: dict[str, Any] = {
            "config": self._config(),
            "model": backup.model,
            "optimizer": backup.optimizer,
            **self._common_state(all_rng),
        }
        if callback_states:
            state["callbacks"] = callback_states
        extras = trainer.strategy.backup_extras(trainer.global_step)
        if extras:
            state["strategy"] = extras
        if backup.shards is None:
            self.manager.save(trainer.global_step, state)
        else:
            self.manager.save(trainer.global_step, state, shards=backup.shards)


def _torch_rng_states() -> torch.Tensor:
    """The CPU generator's state, then the current GPU's where there is one: dropout on a GPU draws
    from the GPU's generator, so resuming exactly needs both."""
    cpu = torch.get_rng_state()
    if torch.cuda.is_available():
        return torch.cat([cpu, torch.cuda.get_rng_state()])
    return cpu


def _set_rng(rng: dict[str, Any], row: int) -> None:
    """Restore torch's (row ``row`` of the saved states), Python's and NumPy's RNG states."""
    torch_states = rng["torch"]
    cpu_bytes = torch.get_rng_state().numel()
    if row < len(torch_states):
        torch.set_rng_state(torch_states[row][:cpu_bytes].clone())
        if torch_states.shape[1] > cpu_bytes and torch.cuda.is_available():  # saved on a GPU, resumed on one
            torch.cuda.set_rng_state(torch_states[row][cpu_bytes:].clone())
    else:  # a rank the backup did not have (resumed at more replicas): its own stream, derived
        cpu_state = torch_states[row % len(torch_states)][:cpu_bytes].clone()
        generator = torch.Generator().set_state(cpu_state)
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)) + row)  # seeds GPUs too
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = _numpy_state()
    np.random.set_state((np_state[0], rng["numpy"].numpy().astype(np.uint32), *np_state[2:]))


def _numpy_state() -> tuple[Any, ...]:
    """NumPy's global RNG state as the legacy tuple (``(name, keys, pos, has_gauss, gauss)``)."""
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):
        raise RuntimeError("numpy returned its RNG state as a dict with legacy=True")
    return state
