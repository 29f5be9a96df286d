"""The token of a job on several machines (issue 36 item 1): every node derives the same one from the
user's secret file and the job id, without a secret copied by hand; nobody else's file is trusted."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from spread.cluster.job_secret import shared_job_token


@pytest.fixture
def secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("SPREAD_JOB_TOKEN", raising=False)
    path = tmp_path / "config" / "spread" / "secret"
    monkeypatch.setenv("SPREAD_SECRET_FILE", str(path))
    return path


def test_the_secret_is_made_once_readable_by_its_owner_only(secret: Path) -> None:
    first = shared_job_token("job-7")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret.parent.stat().st_mode) == 0o700
    assert shared_job_token("job-7") == first  # another node reading the same (shared) file agrees
    assert shared_job_token("job-8") != first  # each job its own token
    assert secret.read_text().strip() not in first  # the secret itself never leaves the file


def test_a_launcher_starting_while_another_makes_the_secret_reads_the_whole_one(
    secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two machines' launchers on a shared home made the secret at the same moment: one read the file
    the other had created but not yet written and refused it as too short (CI, stop 42). Here the
    second launcher runs exactly inside the first one's making of the secret."""
    import secrets

    token_hex = secrets.token_hex
    seen: list[str] = []
    arrived = False

    def second_launcher_arrives(nbytes: int | None = None) -> str:
        nonlocal arrived
        if nbytes == 32 and not arrived:
            arrived = True
            seen.append(shared_job_token("job-7"))  # the other launcher, mid-way through ours
        return token_hex(nbytes)

    monkeypatch.setattr(secrets, "token_hex", second_launcher_arrives)
    first = shared_job_token("job-7")
    assert seen == [first]  # both use the secret that reached the file first
    assert [p.name for p in secret.parent.iterdir()] == ["secret"]  # no drafts left behind


def test_the_environment_token_wins(secret: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPREAD_JOB_TOKEN", "from-the-scheduler")
    assert shared_job_token("job-7") == "from-the-scheduler"
    assert not secret.exists()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_others_can_read_is_refused(secret: Path, mode: int) -> None:
    secret.parent.mkdir(parents=True)
    secret.write_text("x" * 64)
    os.chmod(secret, mode)
    with pytest.raises(ValueError, match=r"readable by nobody else .* chmod 600"):
        shared_job_token("job-7")


def test_a_short_secret_is_refused(secret: Path) -> None:
    secret.parent.mkdir(parents=True)
    secret.write_text("short")
    os.chmod(secret, 0o600)
    with pytest.raises(ValueError, match=r"shorter than 32 characters"):
        shared_job_token("job-7")


def test_a_symlinked_secret_is_refused(secret: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("y" * 64)
    os.chmod(target, 0o600)
    secret.parent.mkdir(parents=True)
    secret.symlink_to(target)  # a link another user could have planted
    with pytest.raises(ValueError, match=r"must be a regular file"):
        shared_job_token("job-7")
