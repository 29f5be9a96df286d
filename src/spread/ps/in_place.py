"""A lost parameter server restored in place while the training tasks wait (``spread run --recover``).

Under ``spread run --ps P --recover`` the launcher starts a server that died again, at the same
address, as a *replacement* (:class:`spread.ps.server.ParameterServer` with ``replacement >= 1``):
it holds nothing and refuses pushes and pulls. A training task whose call to it fails (a
:class:`~spread.errors.ParameterServerError` carrying the server's index) waits here, within
``timeout``, for the replacement to answer and be restored:

* the chief restores it from the latest backup it wrote (``BackupAndRestore`` under this strategy,
  or :meth:`save_servers`): that server's shards, optimizer state and ledger (applied step ids), plus
  the other servers' word on which tasks finished and how the job started, and checks that the
  server holds what was sent (a SHA-256 of every tensor, :func:`~spread.ps.server.state_digest`);
* every task then continues: it repeats the call that failed. Its step id makes a repeated push
  exact once per server: the servers that applied it drop it as a duplicate, the restored one
  applies it.

What becomes of the steps the restored server applied after the backup:

* **sync mode, replayed: exact.** Every task keeps its own part of each push since its
  second-to-last backup (:class:`ReplayLog`; every sync task backs up at the same steps, and when a
  task backs up at step ``S`` the chief has committed the backup before ``S``, so the latest committed
  backup is never older than the log). After the restore each task pushes its logged parts of steps
  ``backup .. now`` to the restored server alone; it sums every task's share in task order and
  applies one update per step, as it did the first time, then the step in flight goes on. The
  restored server ends where it would have been: the weights equal the uninterrupted run's. Cost:
  each task holds up to two backup intervals of its own gradients (in CPU memory).
* **async mode, not replayed: those updates are lost** on the restored server's variables (the
  other servers keep theirs). Async tasks never wait for each other, so no task can say which of
  its pushes reached a server before it died, and a gradient replayed minutes late is a stale one;
  async SGD takes the restored server's values as a (staler) starting point and trains on, as
  TensorFlow's parameter-server training does after a restore. Only the step in flight is applied
  (once, by its id).

Not covered: a server lost before the chief's first backup (nothing to restore it from: the job
fails naming it, as does a replacement not restored within ``timeout``), a lost chief or worker
(the job fails as without ``--recover``; ``--max-restarts`` restarts it from the backup), the
evaluator (it stops evaluating when a server is gone, as at the end of training).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from spread import env
from spread.errors import ParameterServerError, SpreadError
from spread.ps.client import PSClient
from spread.ps.rpc_api import Message
from spread.ps.server import state_digest

T = TypeVar("T")
DEFAULT_RESTORE_TIMEOUT = 120.0
_POLL = 0.1  # seconds between looks at a replacement that is not restored yet
_STATS_TIMEOUT = 2.0  # seconds one look may take (a replacement that is still starting)


@dataclass(frozen=True)
class ServerBackup:
    """One server's part of a backup: what the chief loads into its replacement."""

    name: str  # the backup's id, as the servers report it once restored
    step: int
    tensors: dict[str, torch.Tensor]  # shards and optimizer slots (``opt:<shard>:<slot>``)
    ledger: dict[str, Any]  # version, applied, applied_ids
    optimizer: dict[str, Any] | None  # the optimizer spec


class ReplayLog:
    """Sync mode: this task's part of every push (by server) since its second-to-last backup."""

    def __init__(self) -> None:
        self._parts: dict[int, dict[int, Message]] = {}
        self._backups: list[int] = []  # the steps of this task's last two backups

    def record(self, step: int, parts: dict[int, Message]) -> None:
        """Keep step ``step``'s push (copies: the gradients are the model's until the push ends).
        Nothing before the first backup: there is nothing to restore a server from then."""
        if self._backups:
            self._parts[step] = {
                s: ({**meta, "pull": []}, {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()})
                for s, (meta, tensors) in parts.items()
            }

    def backed_up(self, step: int) -> None:
        """This task backed up at ``step``: what came before its previous backup is no longer needed."""
        self._backups = [*self._backups, step][-2:]
        for old in [s for s in self._parts if s < self._backups[0]]:
            del self._parts[old]

    def parts(self, server: int, first: int, stop: int) -> list[tuple[int, Message]]:
        """``server``'s parts of steps ``first .. stop - 1``; raises naming what is missing."""
        missing = [s for s in range(first, stop) if s not in self._parts]
        if missing:
            held = f"steps {min(self._parts)}-{max(self._parts)}" if self._parts else "no step"
            raise ValueError(
                f"the restored server needs steps {first}-{stop - 1} again and this task holds {held} "
                f"(it keeps the steps since its second-to-last backup; missing: {missing[:5]})"
            )
        return [(s, self._parts[s][server]) for s in range(first, stop)]


class InPlaceRestore:
    """The training task's side of an in-place restore (see the module docstring).

    Args:
        client: the task's client of every server.
        rank: the task's rank (0: the chief restores; others wait).
        timeout: seconds to wait for a lost server to be back and restored.
        backup_of: the chief's: server index -> its part of the latest backup (raises when none).
        config: the job's server settings (mode, workers, staleness), sent with a restore.
        replay: sync mode's log of this task's pushes; None in async mode.
        steps_done: how many of its own steps this task pushed (the replay ends there).
    """

    def __init__(
        self,
        client: PSClient,
        *,
        rank: int,
        timeout: float,
        backup_of: Callable[[int], ServerBackup],
        config: Callable[[], dict[str, Any]],
        replay: ReplayLog | None,
        steps_done: Callable[[], int],
    ) -> None:
        self.client = client
        self.rank = rank
        self.timeout = timeout
        self._backup_of = backup_of
        self._config = config
        self.replay = replay
        self._steps_done = steps_done
        self._handled: dict[int, set[str]] = {}  # server -> replacements this task has waited for
        self.restores: list[dict[str, Any]] = []  # what each wait found, for logs and tests

    def call(self, op: str, fn: Callable[[], T]) -> T:
        """``fn()``; when a server it calls was lost and is restored in place, ``fn()`` again."""
        while True:
            try:
                return fn()
            except ParameterServerError as exc:
                if exc.server is None:
                    raise
                self._wait_for(exc.server, op, exc)

    def _wait_for(self, server: int, op: str, cause: ParameterServerError) -> None:
        """Return once ``server`` is a replacement restored from the backup (the chief restores it);
        raise ``cause`` when the server that answers is one already seen (the failure was no loss),
        and a :class:`ParameterServerError` naming the server and ``op`` after ``timeout``."""
        started = time.monotonic()
        deadline = started + self.timeout
        seen = self._handled.setdefault(server, set())
        restored_here: ServerBackup | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = ParameterServerError(
                    cause.peer,
                    op,
                    f"lost ({cause.detail}) and not back and restored from its backup within "
                    f"{self.timeout:g}s (under spread run --recover the launcher starts a lost parameter "
                    f"server again and the chief restores it; {env.PS_RESTORE_TIMEOUT} sets this wait)",
                )
                error.server = server
                raise error from cause
            try:
                stats, _ = self.client.call(
                    server, "stats", {}, {}, timeout=min(remaining, _STATS_TIMEOUT), wait_for_ready=True
                )
            except ParameterServerError:
                time.sleep(_POLL)  # not back yet
                continue
            incarnation = str(stats.get("incarnation", ""))
            if not stats.get("replacement") or incarnation in seen:
                raise cause  # the server that failed the call is still there: not a loss
            if stats.get("restored_in_place"):
                break
            if self.rank == 0 and restored_here is None:
                try:
                    restored_here = self._restore(server)
                except ParameterServerError:
                    time.sleep(_POLL)  # the replacement went away as well: wait for the next one
                continue
            time.sleep(_POLL)
        seen.add(incarnation)
        name = str(stats["restored_in_place"])
        replayed = self._replay(server, int(stats.get("version", 0)), op)
        record = {
            "server": server,
            "backup": name,
            "digest": stats.get("restored_digest", ""),
            "replayed": replayed,
            "seconds": round(time.monotonic() - started, 2),
        }
        self.restores.append(record)
        what = "restored it in place" if restored_here is not None else "it was restored in place"
        replay = f"; replayed this task's steps {replayed[0]}-{replayed[-1]} to it" if replayed else ""
        print(
            f"spread: rank {self.rank}: {cause.peer} was lost during {op} ({cause.detail}); {what} from "
            f"backup {name} (state sha256 {record['digest']}) after {record['seconds']:g}s{replay}; "
            "continuing",
            file=sys.stderr,
            flush=True,
        )

    def _restore(self, server: int) -> ServerBackup:
        """The chief: load ``server``'s part of the latest backup into its replacement and check it."""
        backup = self._backup_of(server)
        ledger = dict(backup.ledger)
        for other in range(self.client.num_servers):  # what the lost server knew beside its shards
            if other == server:
                continue
            try:
                stats, _ = self.client.call(other, "stats", {}, {})
            except ParameterServerError:
                continue  # lost too: it is waited for when a call to it fails
            ledger.update(done=stats.get("done", []), failed=stats.get("failed", []))
            ledger["restored_from"] = stats.get("restored_from", "")
            break
        config = self._config()
        if backup.optimizer:
            config["optimizer"] = backup.optimizer
        self.client.load({server: backup.tensors}, config, {server: ledger}, restored_in_place=backup.name)
        stats, _ = self.client.call(server, "stats", {}, {})
        expected = state_digest(backup.tensors)
        if stats.get("restored_digest") != expected:
            raise SpreadError(
                f"{self.client.clients[server].peer}: restore in place: it holds state sha256 "
                f"{stats.get('restored_digest')} after the restore from backup {backup.name}, which "
                f"is {expected}"
            )
        return backup

    def _replay(self, server: int, version: int, op: str) -> list[int]:
        """Sync mode: push this task's parts of steps ``version ..`` (those before the step in flight)
        to the restored ``server`` again; the steps replayed."""
        if self.replay is None:
            return []
        try:
            steps = self.replay.parts(server, version, self._steps_done())
        except ValueError as exc:
            error = ParameterServerError(
                self.client.clients[server].peer, op, f"restored in place, but cannot be replayed to: {exc}"
            )
            error.server = server
            raise error from None
        for _, (meta, tensors) in steps:
            self.client.call(server, "push", meta, tensors, timeout=self.client.timeout)
        return [step for step, _ in steps]
