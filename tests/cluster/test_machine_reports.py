"""Machine reports (issue 36 item 2): what each launcher publishes about its ranks in the job store,
and what the survivors of a loss on another machine conclude from it. A rank is known gone when its
launcher says it exited, when its machine is going away, or when the launcher's beat stayed the same
for ``SILENT_LIMIT`` seconds of the reader's clock; nothing else (a missing, forged or still-beating
report) ever counts a rank as lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from spread.cluster.machine_reports import LossWatch, MachineReport, RankPlace, report_key
from spread.cluster.rendezvous import _SealedKeys, job_keys

TOKEN = "machine-reports-token"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _keys() -> _SealedKeys:
    return _SealedKeys(dist.HashStore(), TOKEN, "spread/0")


# Ranks 0-1 on launcher 7 (this machine), 2-3 on launcher 9, rank 4 started by no reporting launcher.
PLACES = {
    1: RankPlace(group=101, launcher=7),
    2: RankPlace(group=202, launcher=9),
    3: RankPlace(group=203, launcher=9),
    4: RankPlace(group=404, launcher=0),
}


def _watch(keys: _SealedKeys, clock: Clock) -> LossWatch:
    return LossWatch(keys, PLACES, silent_limit=10.0, every=0.0, clock=clock)


def test_a_rank_its_launcher_reports_exited_is_gone_at_once() -> None:
    keys, clock = _keys(), Clock()
    watch = _watch(keys, clock)
    keys.set(report_key(9), MachineReport(beat=3).to_json())
    assert watch.gone() == set()
    keys.set(report_key(9), MachineReport(beat=4, exited=frozenset({203})).to_json())
    assert watch.gone() == {3}
    assert "exited" in watch.why[3]


def test_every_rank_of_a_machine_going_away_is_gone() -> None:
    keys, clock = _keys(), Clock()
    keys.set(report_key(9), MachineReport(beat=5, leaving=True).to_json())
    assert _watch(keys, clock).gone() == {2, 3}


def test_a_silent_machine_counts_only_after_the_limit_and_a_beating_one_never() -> None:
    keys, clock = _keys(), Clock()
    watch = _watch(keys, clock)
    keys.set(report_key(7), MachineReport(beat=1).to_json())
    keys.set(report_key(9), MachineReport(beat=1).to_json())
    assert watch.gone() == set()
    for beat in range(2, 40):  # launcher 7 beats every second for 38 s; launcher 9 stopped at beat 1
        clock.now += 1.0
        keys.set(report_key(7), MachineReport(beat=beat).to_json())
        gone = watch.gone()
        assert 1 not in gone
        assert gone == ({2, 3} if clock.now >= 10.0 else set()), clock.now
    assert "silent" in watch.why[2]


def test_silence_is_measured_from_when_the_beat_was_read_to_when_it_was_asked_again() -> None:
    """A read that blocked (a slow store) must not make a beating machine look silent: the span runs
    from the completion of the read that saw the beat to the issue of the read that saw it again."""

    class SlowKeys:
        def __init__(self, keys: _SealedKeys, clock: Clock) -> None:
            self.keys, self.clock, self.block = keys, clock, 0.0

        def read(self, key: str) -> str | None:
            value = self.keys.read(key)
            self.clock.now += self.block  # the answer came back this much later
            return value

    keys, clock = _keys(), Clock()
    slow = SlowKeys(keys, clock)
    watch = LossWatch(slow, {2: PLACES[2]}, silent_limit=10.0, every=0.0, clock=clock)
    keys.set(report_key(9), MachineReport(beat=1).to_json())
    slow.block = 30.0  # the first read takes 30 s: the beat it saw is dated at its completion
    assert watch.gone() == set()
    slow.block = 0.0
    clock.now += 1.0
    assert watch.gone() == set()


def test_missing_forged_or_malformed_reports_say_nothing() -> None:
    keys, clock = _keys(), Clock()
    watch = _watch(keys, clock)
    keys.store.set(report_key(9), "0" * 64 + " " + MachineReport(beat=1, leaving=True).to_json())  # forged
    keys.set(report_key(7), "not json")
    for _ in range(30):
        clock.now += 1.0
        assert watch.gone() == set()
    assert MachineReport.from_json('{"beat": 1, "exited": ["x"], "leaving": false}') is None


def test_a_rank_stays_gone_once_shown_gone() -> None:
    keys, clock = _keys(), Clock()
    watch = _watch(keys, clock)
    keys.set(report_key(9), MachineReport(beat=1, exited=frozenset({202})).to_json())
    assert watch.gone() == {2}
    keys.set(report_key(9), MachineReport(beat=2).to_json())  # never happens; still, no flip back
    assert watch.gone() == {2}


@pytest.mark.processes
def test_the_launchers_reporter_publishes_exits_and_leaving_sealed_with_the_job_token() -> None:
    """The launcher's side (:class:`spread.cluster.launcher._MachineReporter`) against a real store:
    what it is told reaches the store, readable with the job token; its beat rises; it ends when
    told to close."""
    from spread.cluster.launcher import _MachineReporter

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    keys = job_keys(server, TOKEN, 3)
    places = {2: RankPlace(group=202, launcher=11), 3: RankPlace(group=203, launcher=11)}
    reporter = _MachineReporter(("127.0.0.1", server.port), 3, 11, TOKEN)
    try:
        deadline = time.monotonic() + 60
        report = None
        while report is None or report.beat < 1:  # it started, reached the store, beat once
            assert time.monotonic() < deadline, "no report within 60 s"
            report = MachineReport.from_json(keys.read(report_key(11)))
            time.sleep(0.05)
        reporter.tell(exited=203)
        watch = LossWatch(keys, places, every=0.0)
        while watch.gone() != {3}:
            assert time.monotonic() < deadline, "the exit was not published"
            time.sleep(0.02)
        reporter.tell(leaving=True)
        while watch.gone() != {2, 3}:
            assert time.monotonic() < deadline, "leaving was not published"
            time.sleep(0.02)
        assert _SealedKeys(keys.store, "another token", "spread/3").read(report_key(11)) is None
    finally:
        reporter.close()
    assert reporter.proc.returncode == 0
    assert json.loads(keys.read(report_key(11)) or "{}")["exited"] == [203]


def test_the_reporter_never_gets_the_token_on_its_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from spread.cluster import launcher

    seen: dict = {}

    class Popen:
        def __init__(self, command, **kwargs) -> None:
            seen.update(command=command, env=kwargs["env"])

    monkeypatch.setattr(launcher.subprocess, "Popen", Popen)
    launcher._MachineReporter(("127.0.0.1", 1), 0, 5, "secret-token")
    assert not any("secret-token" in part for part in seen["command"])
    assert seen["env"]["SPREAD_JOB_TOKEN"] == "secret-token"


def test_the_host_identity_can_be_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    from spread.comm.peers import host_digest

    monkeypatch.delenv("SPREAD_HOST_ID", raising=False)
    here = host_digest()
    monkeypatch.setenv("SPREAD_HOST_ID", "machine-b")
    other = host_digest()
    monkeypatch.setenv("SPREAD_HOST_ID", "machine-c")
    assert len({here, other, host_digest()}) == 3


@pytest.mark.processes
def test_the_reporter_module_runs_without_a_store_and_ends_with_its_stdin() -> None:
    """A store that cannot be reached is never an error: the reporter keeps trying until closed."""
    settings = {"addr": "127.0.0.1", "port": 1, "attempt": 0, "launcher": 1, "beat_every": 0.05}
    settings = json.dumps(dict(settings, connect_timeout=0.5))
    proc = subprocess.run(
        [sys.executable, "-m", "spread.cluster._machine_reporter", settings],
        input='{"exited": 5}\n{"leaving": true}\n',
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPREAD_JOB_TOKEN": TOKEN},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
