"""A launcher's report to the job store about its machine (:mod:`spread.cluster.machine_reports`), kept
by a process of its own.

``spread run --recover`` on several machines starts this module once per attempt
(``python -m spread.cluster._machine_reporter SETTINGS``, the job token in ``SPREAD_JOB_TOKEN``, never
on the command line) and writes one JSON line to its stdin per event: ``{"exited": PGID}`` when a rank
exited, ``{"leaving": true}`` when the launcher got a stop signal. It writes the report at once on
each event and raises the beat every ``BEAT_EVERY`` seconds; it ends when its stdin closes (the
launcher's attempt ended) and, through ``PR_SET_PDEATHSIG``, with the launcher.

Why a process and not a thread of the launcher: a store client needs torch, which the launcher never
imports (it forks the ranks and must start at once). A store that cannot be reached is tried again at
the next beat; the report is a shortcut for the survivors (the regroup timeout stays the rule when it
is missing), so an unreachable store is never an error here.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import IO, Any

from spread import env
from spread.cluster.machine_reports import BEAT_EVERY, MachineReport, report_key

_CONNECT_TIMEOUT = 5.0  # seconds one attempt to reach the store may take


def _read_events(lines: IO[str], events: queue.SimpleQueue) -> None:
    for line in lines:
        try:
            events.put(json.loads(line))
        except ValueError:
            continue
    events.put(None)  # the launcher closed the pipe (or died)


class _Store:
    """The job's sealed keys for one attempt, reconnected when the store was unreachable (at most once
    per beat: an event meanwhile is written with the next report, which holds everything)."""

    def __init__(self, settings: dict[str, Any], token: str) -> None:
        self.settings, self.token = settings, token
        self.keys: Any = None
        self.written: MachineReport | None = None  # the last report the store accepted
        self.retry_at = 0.0

    def write(self, report: MachineReport, *, retry_every: float) -> None:
        import torch.distributed as dist

        from spread.cluster.rendezvous import job_keys

        if report == self.written or time.monotonic() < self.retry_at:
            return
        try:
            if self.keys is None:
                s = self.settings
                timeout = timedelta(seconds=float(s.get("connect_timeout", _CONNECT_TIMEOUT)))
                self.keys = job_keys(
                    dist.TCPStore(s["addr"], s["port"], None, False, timeout), self.token, s["attempt"]
                )
            self.keys.set(report_key(self.settings["launcher"]), report.to_json())
            self.written = report
        except (RuntimeError, ValueError, OSError, dist.DistError):  # TimeoutError is an OSError
            self.keys = None  # the store's host is gone or not up yet: try again at the next beat
            self.retry_at = time.monotonic() + retry_every


def serve(settings: dict[str, Any], token: str, lines: IO[str]) -> None:
    """Keep the report of ``settings["launcher"]`` until ``lines`` ends."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_events, args=(lines, events), daemon=True).start()
    store = _Store(settings, token)
    report = MachineReport()
    every = float(settings.get("beat_every", BEAT_EVERY))
    while True:
        store.write(report, retry_every=every)
        try:
            event = events.get(timeout=every)
        except queue.Empty:
            report = replace(report, beat=report.beat + 1)
            continue
        if event is None:
            store.retry_at = 0.0  # a last try for what the store has not accepted yet
            store.write(report, retry_every=every)
            return
        if "exited" in event:
            report = replace(report, beat=report.beat + 1, exited=report.exited | {int(event["exited"])})
        if event.get("leaving"):
            report = replace(report, beat=report.beat + 1, leaving=True)


def main(argv: list[str]) -> int:
    # An unreachable store is expected (the job's store host may end first): torch's C++ layer would
    # log each failed connection to the launcher's terminal.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    settings = json.loads(argv[0])
    token = os.environ.get(env.JOB_TOKEN, "")
    try:
        serve(settings, token, sys.stdin)
    except KeyboardInterrupt:  # a Ctrl-C that reached this process group: the launcher decides
        return 0
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)  # everything is written: skip torch's teardown (half a second the launcher would wait)
