"""The restore protocol's parts on their own: backup ids, the resume arithmetic, the chief's word."""

from __future__ import annotations

import pytest

from spread.errors import SpreadError
from spread.ps.restore import BackupId, ResumePoint, StartAnnouncements, resume_point

LEDGERS = [
    {"version": 7, "applied_ids": ["w0.aa.0", "w1.bb.0", "w1.bb.1", "w1.bb.2", "sync:0"]},
    {"version": 7, "applied_ids": ["w1.bb.0", "w1.bb.1", "w0.aa.0"]},
]


def test_backup_ids_round_trip_and_refuse_other_text():
    backup = BackupId.new(12)
    assert BackupId.decode(backup.encode()) == backup and backup.step == 12
    assert BackupId.new(12) != backup  # a nonce per backup
    for text in ("12", "x-ab", "-ab", "12-"):
        with pytest.raises(ValueError, match="not a backup id"):
            BackupId.decode(text)


def test_async_resumes_after_the_shortest_prefix_and_keeps_the_session():
    assert resume_point(LEDGERS, mode="async", rank=1) == ResumePoint(2, "bb")
    assert resume_point(LEDGERS, mode="async", rank=0) == ResumePoint(1, "aa")
    assert resume_point(LEDGERS, mode="async", rank=2) == ResumePoint(0, None)


def test_sync_resumes_at_the_common_version_and_refuses_servers_saved_apart():
    assert resume_point(LEDGERS, mode="sync", rank=1) == ResumePoint(7, None)
    with pytest.raises(SpreadError, match=r"saved at different steps: \[6, 7\]"):
        resume_point([{"version": 6}, {"version": 7}], mode="sync", rank=1)


def test_steps_of_two_sessions_are_refused():
    ledgers = [{"applied_ids": ["w1.bb.0"]}, {"applied_ids": ["w1.cc.0"]}]
    with pytest.raises(SpreadError, match=r"rank 1: the backup holds steps of several sessions"):
        resume_point(ledgers, mode="async", rank=1)


class _Servers:
    """What StartAnnouncements reads and writes on a PSClient: the servers' restored_from."""

    def __init__(self, n: int) -> None:
        self.restored_from = [""] * n

    def announce(self, name: str) -> None:
        self.restored_from = [name] * len(self.restored_from)

    def stats(self) -> list[dict[str, str]]:
        return [{"restored_from": r} for r in self.restored_from]


def test_each_fit_waits_for_its_own_word_from_the_chief():
    servers = _Servers(2)
    chief, worker = StartAnnouncements(servers), StartAnnouncements(servers)
    chief.announce_fresh_start()
    assert worker.wait(rank=1, timeout=1.0) is None  # fit 0: a fresh start
    backup = BackupId.new(6)
    servers.restored_from = [chief.stamp(backup.encode())] * 2  # fit 1: loaded with the backup
    assert worker.wait(rank=1, timeout=1.0) == backup
    with pytest.raises(SpreadError, match=r"rank 1: the chief did not say within 0.2s"):
        worker.wait(rank=1, timeout=0.2)  # fit 2: the servers still carry fit 1's word


def test_servers_that_disagree_are_not_taken_for_the_chiefs_word():
    servers = _Servers(2)
    servers.restored_from = ["0/6-aa", ""]  # one server restored, the other not yet
    with pytest.raises(SpreadError, match="servers report"):
        StartAnnouncements(servers).wait(rank=1, timeout=0.2)
