"""What each machine's launcher tells the job about its ranks, and how the survivors of a loss read it.

A survivor of a lost rank regroups once every old rank has either posted itself alive or is known to
be gone (:meth:`spread.cluster.rendezvous.Rendezvous.regroup`). On its own machine it knows at once
(the lost process's pid has exited); a rank on another machine cannot be checked from here, and
without word from that machine the survivors would wait for ``SPREAD_REGROUP_TIMEOUT``. So under
``spread run --recover`` on several machines each launcher keeps one report in the job store (sealed
with the job token, as every key of the job), ``machines/<launcher id>``:

* ``exited``: the process groups of its ranks that have exited (reaped: certainly gone);
* ``leaving``: it received a stop signal (its machine is being preempted or shut down): it stops
  every rank it started, so none of them will take part in a regroup;
* ``beat``: a counter it raises every ``BEAT_EVERY`` seconds while it lives.

A machine lost whole (its launcher SIGKILLed with its ranks, powered off, cut off) says nothing; its
beat stops. Its ranks die with their launcher (``PR_SET_PDEATHSIG``), so a launcher known dead means
ranks gone. A survivor counts a machine silent only when the store showed it the same beat over
``SILENT_LIMIT`` seconds of its own clock, measured from when it read the beat (completion) to when
it asked again (issue): a slow store or a slow reader only shortens that span, never lengthens it,
and a slow *rank* on a machine whose launcher beats is never counted lost (it is waited for, up to
the regroup timeout, as before). The limit is ten missed beats: a launcher does nothing but relay
output and watch its ranks, so ten seconds without one store write means its machine is gone or cut
off from the store, which its ranks then are too.

A rank learns its launcher's id from ``SPREAD_LAUNCHER_ID``; ranks record their process group and
launcher id with their host and pid (:func:`spread.comm.peers.record_job_processes`). Nothing here
imports torch: the launcher uses the report's format.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

BEAT_EVERY = 1.0  # seconds between a launcher's beats
SILENT_LIMIT = 10.0  # seconds a survivor must see one beat unchanged before the machine counts as lost
READ_EVERY = 0.25  # seconds between a survivor's reads of the reports while it waits at a regroup


def report_key(launcher: int) -> str:
    """The job-store key of the report of the launcher with id ``launcher``."""
    return f"machines/{launcher}"


@dataclass(frozen=True)
class MachineReport:
    """One launcher's report: see the module's docstring."""

    beat: int = 0
    exited: frozenset[int] = frozenset()  # process groups (the launcher's children) that exited
    leaving: bool = False

    def to_json(self) -> str:
        return json.dumps({"beat": self.beat, "exited": sorted(self.exited), "leaving": self.leaving})

    @classmethod
    def from_json(cls, text: str | None) -> MachineReport | None:
        """The report in ``text``; ``None`` when absent or not a report (never trusted half-read)."""
        if text is None:
            return None
        try:
            raw = json.loads(text)
            beat, exited, leaving = raw["beat"], raw["exited"], raw["leaving"]
        except (ValueError, TypeError, KeyError):
            return None
        if not isinstance(beat, int) or not isinstance(leaving, bool) or not isinstance(exited, list):
            return None
        if not all(isinstance(group, int) for group in exited):
            return None
        return cls(beat=beat, exited=frozenset(exited), leaving=leaving)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's process came from: its process group (the launcher's child's pid: the rank's
    own pid under ``spread run``) and its launcher's id (0: not started by a reporting launcher)."""

    group: int
    launcher: int


class _Reads(Protocol):
    def read(self, key: str) -> str | None: ...


class LossWatch:
    """Which ranks on other machines their launchers' reports show gone, for one regroup.

    ``places``: every old rank's place but this rank's own. ``gone()`` is cheap to call in a polling
    loop: it reads the store at most every ``every`` seconds (once per launcher). A rank once shown
    gone stays gone for this regroup.
    """

    def __init__(
        self,
        keys: _Reads,
        places: Mapping[int, RankPlace],
        *,
        silent_limit: float = SILENT_LIMIT,
        every: float = READ_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys, self._silent_limit, self._every, self._clock = keys, silent_limit, every, clock
        self._ranks: dict[int, list[RankPlace]] = {}
        self._rank_of: dict[tuple[int, int], int] = {}
        for rank, place in places.items():
            if place.launcher:
                self._ranks.setdefault(place.launcher, []).append(place)
                self._rank_of[(place.launcher, place.group)] = rank
        self._beats: dict[int, tuple[int, float]] = {}  # launcher -> (beat, when first read)
        self._gone: set[int] = set()
        self._next_read = float("-inf")
        self.why: dict[int, str] = {}  # rank -> how its machine told (for messages)

    def gone(self) -> set[int]:
        """The ranks known gone from their machines' reports (absent reports say nothing)."""
        if self._clock() < self._next_read:
            return set(self._gone)
        for launcher, places in self._ranks.items():
            issued = self._clock()
            report = MachineReport.from_json(self._keys.read(report_key(launcher)))
            done = self._clock()
            if report is None:
                continue
            if report.leaving:
                self._lose(launcher, places, "its machine is going away (its launcher was stopped)")
                continue
            exited = [p for p in places if p.group in report.exited]
            self._lose(launcher, exited, "exited (its launcher said so)")
            seen = self._beats.get(launcher)
            if seen is None or seen[0] != report.beat:
                self._beats[launcher] = (report.beat, done)
            elif issued - seen[1] >= self._silent_limit:
                silent = f"its machine went silent (its launcher's beat stopped for {self._silent_limit:g}s)"
                self._lose(launcher, places, silent)
        self._next_read = self._clock() + self._every
        return set(self._gone)

    def _lose(self, launcher: int, places: list[RankPlace], why: str) -> None:
        for place in places:
            rank = self._rank_of[(launcher, place.group)]
            if rank not in self._gone:
                self._gone.add(rank)
                self.why[rank] = why
