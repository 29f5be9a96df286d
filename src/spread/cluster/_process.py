"""Process-group and socket plumbing for the launcher, kept apart so launcher.py reads as policy.

Everything here is a thin, documented wrapper over one OS facility: ``prctl(PR_SET_PDEATHSIG)``,
binding the rendezvous socket, and asking or signalling a process group. No torch, no spread imports.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the rank when the launcher dies (Linux only).

    ``prctl`` is resolved here, in the parent, so the child only calls it between fork and exec.
    The ``getppid`` check closes the race where the launcher died before ``prctl`` ran.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return hook


def bind_listener(addr: str, port: int) -> socket.socket:
    """Bind the rendezvous socket on ``addr`` (IPv4 preferred when a name resolves to both)."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise OSError(f"cannot resolve --master-addr {addr!r}: {exc}") from exc
    family, _, _, _, sockaddr = sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:  # a fixed port is re-bound on every attempt; TIME_WAIT leftovers must not block it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {addr}:{port} for the rendezvous store: {exc.strerror or exc}"
        ) from exc
    return sock


def group_alive(pgid: int) -> bool:
    """Whether the process group still has a live (non-zombie) member.

    ``killpg(pgid, 0)`` also counts zombies, and an orphaned zombie grandchild may never be reaped when
    PID 1 of a container does not reap; on Linux /proc tells the two apart.
    """
    if sys.platform.startswith("linux"):
        try:
            entries = os.listdir("/proc")
        except OSError:
            entries = []
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
            except OSError:
                continue
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
                return True
        if entries:
            return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), or
    ``None`` when it is gone or the platform has no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except (OSError, IndexError):
        return None


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
