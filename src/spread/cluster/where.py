"""Where each rank of a running job is, on demand: what ``spread run`` prints on SIGUSR1 (sent by
``spread run --dump PID``) and when it finds a rank stopped.

The launcher never imports torch, so it runs a reader process (``LaunchConfig.where_command``: the
CLI's :mod:`spread.cli._where`) that reads every rank's flight record from the job's rendezvous store.
The report also goes to a file of the launcher's own, in a directory only this user can enter, so
that ``spread run --dump PID`` can print it in the asker's terminal.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_READ_TIMEOUT = 20.0  # seconds the reader may take (it imports torch, then reads one key a rank)
_ANSWER_TIMEOUT = 30.0  # seconds `spread run --dump` waits for the launcher's report


def _private_directory() -> Path:
    """This user's directory for launcher reports (mode 700, owned by us), created if absent."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    directory = Path(base) / f"spread-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(
            f"{directory} is not a private directory of this user (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}): remove it, or set XDG_RUNTIME_DIR"
        )
    return directory


def report_path(pid: int) -> Path:
    """Where the launcher of process ``pid`` writes its report."""
    return _private_directory() / f"where-{pid}.txt"


class ReportFile:
    """The launcher's report file: present (saying so) from the launcher's start to its end, so that
    ``spread run --dump`` knows a process is a launcher before it sends it a signal."""

    def __init__(self) -> None:
        self.path: Path | None = None
        try:
            self.path = report_path(os.getpid())
            self.write(["no report yet"])
        except OSError:  # no private directory: reports still go to the job's output
            self.path = None

    def write(self, lines: Sequence[str]) -> None:
        if self.path is None:
            return
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text("".join(f"{line}\n" for line in lines))
        os.replace(temporary, self.path)

    def remove(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def read_where(
    command: Sequence[str], address: tuple[str, int], attempt: int, world_size: int, token: str
) -> list[str]:
    """Run the reader; its lines, or one line saying why there are none. Never raises, never hangs."""
    env = dict(os.environ, SPREAD_JOB_TOKEN=token)
    argv = [*command, address[0], str(address[1]), str(attempt), str(world_size)]
    try:
        result = subprocess.run(
            argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_READ_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return [f"no report: reading the job's store took over {_READ_TIMEOUT:.0f} s"]
    except OSError as exc:
        return [f"no report: cannot start the reader: {exc}"]
    lines = result.stdout.splitlines()
    if result.returncode != 0 and not lines:
        error = result.stderr.strip().splitlines()
        lines = [f"no report: the reader failed: {error[-1] if error else f'exit {result.returncode}'}"]
    return lines


def _is_spread(pid: int) -> bool:
    try:
        return b"spread" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): the report file alone says it is a launcher
        return True


def ask_launcher(pid: int, timeout: float = _ANSWER_TIMEOUT) -> list[str]:
    """``spread run --dump PID``: signal the launcher ``pid`` (SIGUSR1) and return its report.

    Raises ``ProcessLookupError`` when ``pid`` is not a running ``spread run`` of this user (no signal
    is sent then: SIGUSR1 ends a process that does not handle it) and ``TimeoutError`` without answer.
    """
    import signal

    path = report_path(pid)
    if not path.exists():
        raise ProcessLookupError(
            f"process {pid} is not a running `spread run` of this user (no {path}); "
            "the launcher's pid is printed by `pgrep -f 'spread run'`"
        )
    if not _is_spread(pid):
        path.unlink(missing_ok=True)  # left behind by a launcher that was SIGKILLed; the pid is reused
        raise ProcessLookupError(
            f"process {pid} is not a running `spread run` (a stale report file was removed)"
        )
    asked = time.time()
    before = path.stat().st_mtime_ns
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        path.unlink(missing_ok=True)  # left behind by a launcher that was SIGKILLed
        raise ProcessLookupError(f"process {pid} is not running (a stale report file was removed)") from None
    deadline = asked + timeout
    while time.time() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            text = path.read_text()
            if text.strip() and not text.startswith("no report yet"):
                return text.splitlines()
        time.sleep(0.1)
    raise TimeoutError(f"`spread run` (pid {pid}) did not answer within {timeout:.0f} s")
