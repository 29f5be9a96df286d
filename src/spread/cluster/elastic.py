"""The launcher's client of torch's elastic rendezvous (:mod:`spread.cluster._c10d_agent`).

One agent process per ``spread run``, spoken to in JSON lines over a pipe; every wait is bounded and
gives way to a stop signal, so Ctrl-C during a rendezvous still ends the launcher at once.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spread.cluster._process import die_with_parent_hook

_TICK = 0.1  # seconds between checks for a stop request while waiting for the agent
_SHORT = 60.0  # seconds for an answer that needs no other node (nodes waiting, shutdown)


class RendezvousFailed(RuntimeError):
    """The rendezvous could not complete (closed by another node, timed out, unreachable)."""


@dataclass(frozen=True)
class Round:
    """This node's place in one round of the job: what its ranks are told."""

    group_rank: int  # this node's index among the round's nodes (GROUP_RANK, NODE_RANK)
    nnodes: int
    rank_offset: int  # the global rank of this node's local rank 0
    world_size: int
    master_addr: str  # the job store (torch's handler on the round's node 0 hosts it)
    master_port: int
    attempt: int  # agreed by every node of the round: the prefix of the round's keys
    join: bool = False  # --recover: this node's ranks join ranks that train on (attempt and store theirs)


class ElasticRendezvous:
    """Start the agent; ``next_round``, ``nodes_waiting``, ``shutdown``, ``close``."""

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        nproc: int,
        local_addr: str,
        conf: Mapping[str, str],
    ) -> None:
        settings = {
            "endpoint": endpoint,
            "run_id": run_id,
            "min_nodes": min_nodes,
            "max_nodes": max_nodes,
            "nproc": nproc,
            "local_addr": local_addr,
            "conf": dict(conf),
        }
        self.join_timeout = float(conf.get("join_timeout", 600))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "spread.cluster._c10d_agent", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a terminal's Ctrl-C reaches the launcher, which decides
            preexec_fn=die_with_parent_hook(),
        )
        self._buffer = b""

    def _ask(
        self, op: str, timeout: float, stop_requested: Callable[[], bool], **more: Any
    ) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **more}).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the agent already ended: its last words (an error) are in the pipe
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if stop_requested():
                raise InterruptedError("stopped while waiting for the rendezvous")
            if time.monotonic() > deadline:
                raise RendezvousFailed(f"the rendezvous agent gave no answer to {op!r} within {timeout:.0f}s")
            ready, _, _ = select.select([fd], [], [], _TICK)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RendezvousFailed(f"the rendezvous agent exited (code {self.proc.wait()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer = json.loads(line)
        if "error" in answer:
            raise RendezvousFailed(answer["error"])
        return answer

    def next_round(self, stop_requested: Callable[[], bool], live: Mapping[str, Any] | None = None) -> Round:
        """Join the next round (up to ``join_timeout`` seconds and then some for the agent's start).
        ``live``: this node's ranks train on (``--recover``; ``{"attempt", "addr", "port"}`` of their
        job store), and the nodes that wait join them."""
        answer = self._ask(
            "next", self.join_timeout + _SHORT, stop_requested, live=dict(live) if live else None
        )
        return Round(**answer)

    def nodes_waiting(self) -> int:
        return int(self._ask("waiting", _SHORT, lambda: False)["waiting"])

    def shutdown(self) -> None:
        """Close the rendezvous: the job is over, nodes that come later are told so."""
        try:
            self._ask("shutdown", _SHORT, lambda: False)
        except (RendezvousFailed, OSError):
            pass  # closing is a courtesy to later nodes; the job's outcome stands

    def close(self) -> None:
        """End the agent (and the job store it may host)."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def facing_address(host: str) -> str:
    """This machine's address on the route to ``host`` (what the other nodes can reach us at):
    loopback for a loopback endpoint. No packet is sent (a UDP socket is only connected)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, 1, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(infos[0][4])
            return str(probe.getsockname()[0])
    except OSError:
        return socket.getfqdn()
