"""Which process each rank of the job is, so that a lost peer can be named.

gloo reports a peer that died as ``Connection closed by peer [127.0.0.1]:25267``: an address, not a
rank. Strategies record every rank's host and process id once, at start-up (one small all-gather);
when a collective then fails with a lost peer, the ranks on this host whose process is gone are named.
Ranks on other hosts cannot be checked from here: with each rank's process group and launcher id
(:class:`~spread.cluster.machine_reports.RankPlace`, recorded alongside) a regroup reads what their
launchers reported instead.

"This host" is the host name, or ``SPREAD_HOST_ID`` where set: tests make one machine pass for
several with it (and containers that share a host name can tell themselves apart).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from typing import TYPE_CHECKING

import torch

from spread import env
from spread.cluster.machine_reports import RankPlace

if TYPE_CHECKING:  # pragma: no cover
    from spread.comm.ops import Collectives

_job_processes: dict[int, tuple[int, int]] = {}  # rank -> (host digest, pid): this process's job
_job_places: dict[int, RankPlace] = {}  # rank -> its process group and launcher id


def host_digest() -> int:
    """This machine's name (``SPREAD_HOST_ID``, else the host name) as a number ranks can compare in
    a collective."""
    name = os.environ.get(env.HOST_ID) or socket.gethostname()
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "big")


def _launcher_id() -> int:
    """The id under which this rank's launcher reports its machine (``SPREAD_LAUNCHER_ID``; 0: none)."""
    try:
        return max(0, int(os.environ.get(env.LAUNCHER_ID, "0")))
    except ValueError:
        return 0


def record_job_processes(collectives: Collectives) -> None:
    """Learn every rank's host, process id, process group and launcher id (collective over the job's
    default group)."""
    mine = [host_digest(), os.getpid(), os.getpgrp(), _launcher_id()]
    everyone = collectives.all_gather(
        torch.tensor(mine, dtype=torch.int64, device=collectives.device), name="job_processes"
    )
    rows = [[int(v) for v in t.tolist()] for t in everyone]
    _job_processes.clear()
    _job_processes.update({rank: (host, pid) for rank, (host, pid, _, _) in enumerate(rows)})
    _job_places.clear()
    _job_places.update(
        {rank: RankPlace(group=group, launcher=launcher) for rank, (_, _, group, launcher) in enumerate(rows)}
    )


def job_places() -> dict[int, RankPlace]:
    """Every recorded rank's process group and launcher id (for a regroup to read their machines'
    reports)."""
    return dict(_job_places)


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
