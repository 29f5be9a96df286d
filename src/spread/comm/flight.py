"""Which rank a job waits for, and where it is: a flight recorder of each rank's collectives.

The most asked question about a hung job is "which rank is stuck?". A rank waiting in a collective
cannot tell from the collective itself: gloo only times out (after the collective timeout, 300 s by
default) without naming anyone. So each rank keeps a small record of its recent collectives (kind,
number, bytes, start and end, counted alike on every rank: the n-th collective of a rank matches the
n-th of the others) and of where its training loop is (the Trainer says "forward of step 31"), and a
thread publishes it to the job's rendezvous store every couple of seconds: the store, not the stuck
collective, carries it. A rank that has waited in one collective for ``report_after`` seconds (30 by
default) reads everyone's record and says which ranks never entered that collective, when their last
one ended and what they are doing; a :class:`~spread.errors.CollectiveTimeout` carries the same.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch.distributed as dist

_PUBLISH_EVERY = 2.0  # seconds between a rank's publications
_KEY = "flight/{rank}"
_REPORT_AFTER_ENV = "SPREAD_HANG_REPORT_AFTER"


@dataclass
class _Entry:
    number: int  # this rank's n-th collective: the same n is the same collective on every rank
    op: str
    nbytes: int
    started: float  # wall clock, comparable across ranks on synchronised hosts
    ended: float | None = None


@dataclass
class _Record:
    rank: int
    pid: int
    phase: str = "starting"
    phase_since: float = field(default_factory=time.time)
    current: _Entry | None = None
    recent: list[_Entry] = field(default_factory=list)
    published: float = 0.0


class FlightRecorder:
    """This process's record of its collectives and phase (the training loop's thread only)."""

    def __init__(self, keep: int = 16) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._open: list[_Entry] = []  # nested: an exchange that waits for its asynchronous collectives
        self._recent: deque[_Entry] = deque(maxlen=keep)
        self.phase, self.phase_since = "starting", time.time()

    @property
    def _current(self) -> _Entry | None:
        return self._open[-1] if self._open else None

    def begin(self, op: str, nbytes: int = 0) -> None:
        with self._lock:
            self._count += 1
            self._open.append(_Entry(self._count, op, nbytes, time.time()))

    def end(self) -> None:
        with self._lock:
            if self._open:
                entry = self._open.pop()
                entry.ended = time.time()
                self._recent.append(entry)

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self.phase, self.phase_since = phase, time.time()

    def waiting_since(self) -> tuple[_Entry, float] | None:
        """The collective this rank is inside and since when, if any."""
        with self._lock:
            return (self._current, self._current.started) if self._current is not None else None

    def record(self, rank: int) -> _Record:
        with self._lock:
            return _Record(rank, os.getpid(), self.phase, self.phase_since, self._current, list(self._recent))


RECORDER = FlightRecorder()  # one per process: its training loop's collectives


def _load(raw: bytes) -> _Record:
    data = json.loads(raw)
    entry = lambda e: _Entry(**e) if e else None  # noqa: E731
    return _Record(
        data["rank"],
        data["pid"],
        data["phase"],
        data["phase_since"],
        entry(data["current"]),
        [_Entry(**e) for e in data["recent"]],
        data["published"],
    )


def diagnose(waiting: _Entry, records: dict[int, _Record], now: float | None = None) -> str:
    """Who never entered collective ``waiting`` (this rank's), and where each of them is."""
    now = time.time() if now is None else now
    lines = []
    for rank, record in sorted(records.items()):
        entered = record.current is not None and record.current.number >= waiting.number
        entered = entered or any(e.number >= waiting.number for e in record.recent)
        if entered:
            continue
        last = record.recent[-1] if record.recent else None
        where = f"it is in {record.phase} (for {now - record.phase_since:.0f} s)"
        stale = now - record.published
        silent = stale > 3 * _PUBLISH_EVERY
        alive = f"; its last report is {stale:.0f} s old (stopped or gone?)" if silent else ""
        missed = f"rank {rank} never entered {waiting.op} #{waiting.number}"
        if last is None:
            lines.append(f"{missed} (no collective yet); {where}{alive}")
        else:
            ended = now - (last.ended or now)
            previous = f"its last collective, #{last.number} ({last.op}), ended {ended:.0f} s ago"
            lines.append(f"{missed}: {previous}; {where}{alive}")
    return "; ".join(lines)


def read_records(store: dist.Store, world_size: int) -> dict[int, _Record]:
    """Every rank's last published record (ranks that published none, or a malformed one, are left out)."""
    found = {}
    for rank in range(world_size):
        key = _KEY.format(rank=rank)
        try:
            if store.check([key]):
                found[rank] = _load(store.get(key))
        except (RuntimeError, ValueError, KeyError, TypeError):  # the store is gone, or a malformed record
            continue
    return found


def describe_job(records: dict[int, _Record], world_size: int, now: float | None = None) -> list[str]:
    """Where each rank is, one line a rank, then who the ranks furthest along wait for: what ``spread
    run`` prints on SIGUSR1 (``spread run --dump``) and when it finds a rank stopped."""
    now = time.time() if now is None else now
    lines = []
    for rank in range(world_size):
        record = records.get(rank)
        if record is None:
            lines.append(f"rank {rank}: no record (not started, not past its strategy's setup, or no watch)")
            continue
        if record.current is not None:
            entry = record.current
            where = f"waiting in {entry.op} #{entry.number} for {now - entry.started:.0f} s"
        elif record.recent:
            entry = record.recent[-1]
            where = f"not in a collective; its last, #{entry.number} ({entry.op}), ended "
            where += f"{now - (entry.ended or now):.0f} s ago"
        else:
            where = "no collective yet"
        stale = now - record.published
        silent = (
            f"; its last report is {stale:.0f} s old (stopped or gone?)" if stale > 3 * _PUBLISH_EVERY else ""
        )
        phase = f"in {record.phase} (for {now - record.phase_since:.0f} s)"
        lines.append(f"rank {rank} (pid {record.pid}): {where}; {phase}{silent}")
    waiting = [r.current for r in records.values() if r.current is not None]
    if waiting:
        furthest = max(waiting, key=lambda e: e.number)
        culprits = diagnose(furthest, records, now)
        missing = [r for r in range(world_size) if r not in records]
        if missing:
            names = ", ".join(map(str, missing))
            culprits = "; ".join(filter(None, [culprits, f"rank(s) {names} published no record"]))
        if culprits:
            lines.append(f"waiting in {furthest.op} #{furthest.number}: {culprits}")
    return lines


class FlightWatch:
    """Publishes this rank's record to the store and reports a long wait (a daemon thread)."""

    def __init__(
        self, store: dist.Store, rank: int, world_size: int, report_after: float | None = None
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        if report_after is None:
            report_after = float(os.environ.get(_REPORT_AFTER_ENV, 30.0))
        self.report_after = report_after
        self.reports: list[str] = []
        self._reported: int | None = None  # the collective number already reported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spread-flight", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def records(self) -> dict[int, _Record]:
        """Every rank's last published record (ranks that published none are left out)."""
        return read_records(self.store, self.world_size)

    def explain(self) -> str:
        """Who this rank waits for in its current collective ("" when it is not waiting)."""
        waiting = RECORDER.waiting_since()
        if waiting is None:
            return ""
        return diagnose(waiting[0], self.records())

    def _publish(self) -> None:
        record = RECORDER.record(self.rank)
        record.published = time.time()
        self.store.set(_KEY.format(rank=self.rank), json.dumps(asdict(record)))

    def _run(self) -> None:
        while not self._stop.wait(_PUBLISH_EVERY):
            try:
                self._publish()
                self._check()
            except (RuntimeError, ValueError):  # the store went away: the job is ending
                return

    def _check(self) -> None:
        waiting = RECORDER.waiting_since()
        if waiting is None or waiting[0].number == self._reported:
            return
        entry, since = waiting
        if time.time() - since < self.report_after:
            return
        culprits = diagnose(entry, self.records())
        if culprits:
            self._reported = entry.number
            waited = time.time() - since
            where = f"{entry.op} #{entry.number}"
            line = f"spread: rank {self.rank} has waited {waited:.0f} s in {where}: {culprits}"
            self.reports.append(line)
            print(line, file=sys.stderr, flush=True)


_WATCH: FlightWatch | None = None


def start_watch(store: dist.Store, rank: int, world_size: int) -> FlightWatch:
    """Start this process's watch (one per process; a second call replaces the first)."""
    global _WATCH
    if _WATCH is not None:
        _WATCH.close()
    _WATCH = FlightWatch(store, rank, world_size)
    return _WATCH


def stop_watch() -> None:
    global _WATCH
    if _WATCH is not None:
        _WATCH.close()
        _WATCH = None


def explain_wait() -> str:
    """For a timeout's message: who the job waited for, if this process watches (else "")."""
    try:
        return _WATCH.explain() if _WATCH is not None else ""
    except Exception:  # a diagnosis must never hide the error it explains
        return ""
