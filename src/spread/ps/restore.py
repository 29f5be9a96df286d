"""How a parameter-server job starts from a backup, in the servers' own words.

The chief decides: it restores every server from one backup (or finds none) and stamps that
decision on the servers; every other training task waits for the stamp, then continues its own
step numbering from the steps the restored servers hold. The servers are the only place every task
can see the chief's decision: a task must not read the backup directory itself, since the chief of
this very job may have written a newer backup there by the time a slow task starts.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from spread.errors import SpreadError
from spread.ps.client import PSClient
from spread.ps.step_ids import StepId

FRESH_START = "fresh-start-"  # what the chief stamps when there is no backup


@dataclass(frozen=True)
class BackupId:
    """Names one backup of the servers: the global step it was taken at, and a nonce (two jobs
    writing into one directory never share a name)."""

    step: int
    nonce: str

    @classmethod
    def new(cls, step: int) -> BackupId:
        return cls(step, secrets.token_hex(6))

    def encode(self) -> str:
        return f"{self.step}-{self.nonce}"

    @classmethod
    def decode(cls, text: str) -> BackupId:
        step, sep, nonce = text.partition("-")
        if not sep or not step.isdigit() or not nonce:
            raise ValueError(f"not a backup id: {text!r}")
        return cls(int(step), nonce)


@dataclass(frozen=True)
class ResumePoint:
    """Where a training task continues after a restore."""

    steps: int  # how many of this task's steps the servers hold: it resumes with the next one
    session: str | None  # the session of those steps (async mode), kept so their ids stay the same


def resume_point(ledgers: Iterable[Mapping[str, Any]], *, mode: str, rank: int) -> ResumePoint:
    """Where task ``rank`` resumes, from the servers' ledgers (live, or saved in a backup).

    Sync mode: every server applied the same steps (``version``). Async mode: a server records the
    id of every step it applied; a task's steps reach the servers in order, so each server holds a
    prefix of them, and the servers' snapshots (taken one after another) may differ by the step
    that was in flight. The task resumes after the shortest prefix and keeps its session, so a step
    that some servers already hold is dropped there as a duplicate and applied by the others: after
    the restore, no step is lost or applied twice.
    """
    ledgers = list(ledgers)
    if mode == "sync":
        versions = {int(ledger.get("version", 0)) for ledger in ledgers}
        if len(versions) > 1:
            raise SpreadError(f"sync-mode servers were saved at different steps: {sorted(versions)}")
        return ResumePoint(versions.pop() if versions else 0, None)
    sessions: set[str] = set()
    per_server = []
    for ledger in ledgers:
        held = 0
        for text in ledger.get("applied_ids", []):
            try:
                step_id = StepId.decode(str(text))
            except ValueError:
                continue  # not a step id of this version's forms: no task's step
            if step_id.task == rank:
                sessions.add(step_id.session)
                held = max(held, step_id.number + 1)
        per_server.append(held)
    if len(sessions) > 1:
        raise SpreadError(f"rank {rank}: the backup holds steps of several sessions {sorted(sessions)}")
    return ResumePoint(min(per_server) if per_server else 0, sessions.pop() if sessions else None)


class StartAnnouncements:
    """The chief's word on how each ``fit`` starts, stamped on the servers, and the wait for it.

    Each stamp is ``<fit number>/<name>``: a task's second ``fit`` must not take the first one's
    word. Every task counts its own fits; the chief's stamp and the others' waits pair up in order.
    """

    def __init__(self, client: PSClient) -> None:
        self._client = client
        self._starts = 0

    def stamp(self, name: str) -> str:
        """The next fit's stamp for ``name`` (the chief: loaded into the servers with the backup)."""
        stamp = f"{self._starts}/{name}"
        self._starts += 1
        return stamp

    def announce_fresh_start(self) -> None:
        """The chief found no backup: tell the servers, so the other tasks start from step 0 too."""
        self._client.announce(self.stamp(f"{FRESH_START}{secrets.token_hex(6)}"))

    def wait(self, *, rank: int, timeout: float) -> BackupId | None:
        """Block until every server carries this fit's stamp; the backup restored, or None for a
        fresh start. Assumes servers start with the job (as under ``spread run``, which relaunches
        them with every attempt)."""
        deadline = time.monotonic() + timeout
        prefix = f"{self._starts}/"
        while True:
            names = {s.get("restored_from") or "" for s in self._client.stats()}
            if len(names) == 1 and next(iter(names)).startswith(prefix):
                break
            if time.monotonic() > deadline:
                raise SpreadError(
                    f"rank {rank}: the chief did not say within {timeout:g}s whether the parameter "
                    f"servers were restored from a backup (servers report {sorted(names)}; is the chief "
                    f"running BackupAndRestore?)"
                )
            time.sleep(0.05)
        self._starts += 1
        name = names.pop()[len(prefix) :]
        return None if name.startswith(FRESH_START) else BackupId.decode(name)
