"""Which process each rank of the job is, so that a lost peer can be named.

gloo reports a peer that died as ``Connection closed by peer [127.0.0.1]:25267``: an address, not a
rank. Strategies record every rank's host and process id once, at start-up (one small all-gather);
when a collective then fails with a lost peer, the ranks on this host whose process is gone are named.
Ranks on other hosts cannot be checked from here (that needs the launcher, which names them).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from spread.comm.ops import Collectives

_job_processes: dict[int, tuple[int, int]] = {}  # rank -> (host digest, pid): this process's job


def host_digest() -> int:
    """This machine's name as a number ranks can compare in a collective."""
    return int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:7], "big")


def record_job_processes(collectives: Collectives) -> None:
    """Learn every rank's host and process id (collective over the job's default group)."""
    mine = torch.tensor([host_digest(), os.getpid()], dtype=torch.int64, device=collectives.device)
    everyone = collectives.all_gather(mine, name="job_processes")
    _job_processes.clear()
    _job_processes.update({rank: (int(t[0]), int(t[1])) for rank, t in enumerate(everyone)})


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie: it has exited
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def on_this_host(rank: int) -> bool:
    """Whether the recorded ``rank`` ran on this machine."""
    recorded = _job_processes.get(rank)
    return recorded is not None and recorded[0] == host_digest()


def describe_gone() -> str:
    """``"rank 1 (pid 4242), ..."`` for the ranks on this host that exited; "" when none did."""
    return ", ".join(f"rank {rank} (pid {pid})" for rank, pid in gone_ranks())


def gone_ranks(wait: float = 0.5) -> list[tuple[int, int]]:
    """``(rank, pid)`` of the recorded ranks on this host whose process has exited. A peer's sockets
    close a moment before its process is reaped, so this looks again for up to ``wait`` seconds."""
    here, me = host_digest(), os.getpid()
    local = [(rank, pid) for rank, (host, pid) in sorted(_job_processes.items()) if (host, pid) != (here, me)]
    local = [(rank, pid) for rank, pid in local if _job_processes[rank][0] == here]
    deadline = time.monotonic() + wait
    while True:
        gone = [(rank, pid) for rank, pid in local if _exited(pid)]
        if gone or not local or time.monotonic() >= deadline:
            return gone
        time.sleep(0.02)
