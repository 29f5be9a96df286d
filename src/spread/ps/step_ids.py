"""Step ids: the name under which the parameter servers apply a pushed step exactly once.

A server records the id of every step it applied (its ledger, saved in checkpoints) and drops a
push whose id it holds, so a step retried, rerun on another worker or re-pushed after a restore is
applied once. Who makes the ids and who reads them back both go through :class:`StepId`; the text
forms below are what travels and what ledgers hold:

* ``w<task>.<session>.<number>``: step ``number`` of training task ``task`` (its rank) in session
  ``session``, a random token the task keeps across a restore (:meth:`resume_from_servers` finds
  its steps again by it);
* ``<session>:<number>``: task ``number`` scheduled by the chief's ``ClusterCoordinator`` whose own
  random token is ``session`` (a rerun on another worker pushes under the same id);
* ``sync:<number>``: sync-mode round ``number``, as a server records it (:func:`sync_round`).

A server treats ids as opaque strings; only their makers and readers parse them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SYNC_SESSION = "sync"
_TASK_FORM = re.compile(r"w(\d+)\.([^.:]+)\.(\d+)", re.ASCII)
_SCHEDULED_FORM = re.compile(r"([^.:]+):(\d+)", re.ASCII)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepId:
    """One step's id. ``task`` is the training task's rank for a step it numbered itself, None for
    a step numbered by the chief's coordinator (or a sync round); ``session`` is the numbering's
    random token; ``number`` the step's place in it."""

    task: int | None
    session: str
    number: int

    def __post_init__(self) -> None:
        if self.task is not None and (not isinstance(self.task, int) or self.task < 0):
            raise ValueError(f"StepId.task must be a rank >= 0 or None, got {self.task!r}")
        if not isinstance(self.session, str) or not self.session or any(c in self.session for c in ".:"):
            raise ValueError(
                f"StepId.session must be a non-empty string without '.' or ':', got {self.session!r}"
            )
        if not isinstance(self.number, int) or self.number < 0:
            raise ValueError(f"StepId.number must be an integer >= 0, got {self.number!r}")

    def encode(self) -> str:
        """The id as it travels and as ledgers hold it."""
        if self.task is None:
            return f"{self.session}:{self.number}"
        return f"w{self.task}.{self.session}.{self.number}"

    @classmethod
    def decode(cls, text: str) -> StepId:
        """The id ``text`` encodes; ``ValueError`` naming it when it is in none of the forms."""
        if match := _TASK_FORM.fullmatch(text):
            return cls(task=int(match[1]), session=match[2], number=int(match[3]))
        if match := _SCHEDULED_FORM.fullmatch(text):
            return cls(task=None, session=match[1], number=int(match[2]))
        raise ValueError(
            f"malformed step id {text!r}: expected 'w<task>.<session>.<number>' or '<session>:<number>'"
        )


def sync_round(number: int) -> StepId:
    """The id a server records for sync-mode round ``number``."""
    return StepId(task=None, session=SYNC_SESSION, number=number)
