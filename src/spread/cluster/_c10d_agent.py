"""The node's side of torch's elastic rendezvous (c10d backend), in a process of its own.

``spread run --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` numbers the machines with
``torch.distributed.elastic``'s ``DynamicRendezvousHandler``, as torchrun's agent does, rather than a
home-made protocol. The handler needs torch, which the launcher never imports (it forks the ranks and
must start at once), so the launcher runs this module once per job and talks to it over a pipe, one
JSON line each way (never pickle):

* ``{"op": "next", "live": ...}``: join the next round; the answer gives this node's rank among the
  nodes, the number of nodes, the first global rank of this node's processes, the world size, the job
  store's address (hosted by the agent of the round's node 0, shared by every round it leads) and the
  attempt number every node of the round agrees on (the prefix of the round's keys in that store).
  The store stays with the node that hosts it; the first to host it is the node at the rendezvous
  endpoint (which the job cannot lose anyway), else the round's node 0.
  ``live`` (``spread run --recover``) is ``{"attempt", "addr", "port"}`` from a node whose ranks go
  on training while machines join: the round then keeps that attempt and store, and the answer's
  ``join`` tells the other nodes to join those running ranks instead of starting afresh.
* ``{"op": "waiting"}``: how many nodes wait to join (a node that came back, or a new one).
* ``{"op": "shutdown"}``: close the rendezvous (the job is over: late nodes are told so).

It lives as long as the launcher (stdin's end) so that the store it may host outlives every round.
Usage: ``python -m spread.cluster._c10d_agent`` with the settings as one JSON object in argv[1].
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

_NODE_KEY = "spread/node/{group_rank}"  # in the round's store: a node's process count, last attempt
_STORE_KEY = "spread/store"  # in the round's store: the job store's address and the attempt number


def _handler(settings: dict[str, Any]) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    params = RendezvousParameters(
        backend="c10d",
        endpoint=settings["endpoint"],
        run_id=settings["run_id"],
        min_nodes=settings["min_nodes"],
        max_nodes=settings["max_nodes"],
        local_addr=settings["local_addr"],
        **settings["conf"],
    )
    return get_rendezvous_handler(params)


class _JobStore:
    """The job's store, hosted by the agent of the round's node 0 on a socket it binds itself (no
    free-port race, on this machine's address for the other nodes, not every interface). It serves
    every round this node leads."""

    def __init__(self) -> None:
        self.store: Any = None
        self.address: tuple[str, int] | None = None

    def host(self, addr: str) -> tuple[str, int]:
        if self.address is None:
            from spread.cluster.rendezvous import _host_store

            self.store = _host_store(addr, 0, timeout=60.0)  # binds the socket itself: port 0, no race
            self.address = (addr, self.store.port)
        return self.address


def _next_round(
    handler: Any,
    nproc: int,
    local_addr: str,
    job_store: _JobStore,
    last: int,
    live: dict[str, Any] | None,
    hosts_endpoint: bool = False,
) -> dict[str, Any]:
    """Join a round; ``last`` is the attempt this node ran last (-1: none). The round's attempt number
    is one more than the highest any of its nodes ran: it only grows while a node of the job lives,
    whichever node leads, so each round's keys have a prefix of their own in any store. When a node's
    ranks are ``live`` (training on, under --recover), the round keeps their attempt and store."""
    info = handler.next_rendezvous()
    store, group_rank, nnodes = info.store, info.rank, info.world_size
    mine = {
        "nproc": nproc,
        "last": last,
        "live": live,
        "endpoint": hosts_endpoint,
        "store": job_store.address,
    }
    store.set(_NODE_KEY.format(group_rank=group_rank), json.dumps(mine))
    nodes = [json.loads(store.get(_NODE_KEY.format(group_rank=g))) for g in range(nnodes)]
    running = next((node["live"] for node in nodes if node.get("live")), None)
    if running is not None:  # ranks train on (--recover): the others join them, their attempt and store
        if group_rank == 0:
            led = {"addr": running["addr"], "port": running["port"], "attempt": running["attempt"]}
            store.set(_STORE_KEY, json.dumps(led))
    elif group_rank == _store_host(nodes):  # host the job's store, say where and which attempt this is
        addr, port = job_store.host(local_addr)
        attempt = max(node["last"] for node in nodes) + 1
        store.set(_STORE_KEY, json.dumps({"addr": addr, "port": port, "attempt": attempt}))
    led = json.loads(store.get(_STORE_KEY))
    counts = [node["nproc"] for node in nodes]
    return {
        "group_rank": group_rank,
        "nnodes": nnodes,
        "rank_offset": sum(counts[:group_rank]),
        "world_size": sum(counts),
        "master_addr": led["addr"],
        "master_port": led["port"],
        "attempt": led["attempt"],
        "join": running is not None and live is None,
    }


def _store_host(nodes: list[dict[str, Any]]) -> int:
    """Which node of the round hosts the job's store: the one that hosts it already, else the one at
    the rendezvous endpoint (it must outlive the job under torch's c10d rendezvous anyway, so the job
    then has one machine it cannot lose, not two), else node 0."""
    for key in ("store", "endpoint"):
        chosen = [g for g, node in enumerate(nodes) if node.get(key)]
        if chosen:
            return chosen[0]
    return 0


def _hosts_endpoint(settings: dict[str, Any]) -> bool:
    """Whether this node serves the c10d rendezvous store, as torch decides it: ``is_host`` in
    ``--rdzv-conf``, else whether the endpoint names this machine."""
    flag = str(settings["conf"].get("is_host", "")).lower()
    if flag:
        return flag in ("1", "true", "yes", "y")
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        parse_rendezvous_endpoint,
    )

    host, _ = parse_rendezvous_endpoint(settings["endpoint"], default_port=29400)
    return bool(_matches_machine_hostname(host))


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    settings = json.loads(argv[0])
    # torch's handler would host a store of its own on node 0 and tell later nodes its address only in
    # the first round it leads (a node joining a later round then waits forever); spread hosts the
    # job's store itself and says where each round.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        handler = _handler(settings)
    except Exception as exc:  # a bad endpoint or configuration: said once, then every answer fails
        _answer({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    job_store, last = _JobStore(), -1
    hosts_endpoint = _hosts_endpoint(settings)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "next":
                joined = _next_round(
                    handler,
                    settings["nproc"],
                    settings["local_addr"],
                    job_store,
                    last,
                    request.get("live"),
                    hosts_endpoint,
                )
                last = joined["attempt"]
                _answer(joined)
            elif request["op"] == "waiting":
                _answer({"waiting": handler.num_nodes_waiting()})
            elif request["op"] == "shutdown":
                _answer({"closed": bool(handler.shutdown())})
        except Exception as exc:  # closed, timed out, the store's host gone: the launcher decides
            _answer(
                {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"}
            )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # Ctrl-C reached this process group: the launcher decides
        sys.exit(0)
