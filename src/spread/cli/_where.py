"""Where each rank of a running job is, read from its rendezvous store: ``spread run`` starts this on
SIGUSR1 (``spread run --dump``) and when it finds a rank stopped.

A process of its own because reading the store needs torch, which the launcher never imports. It reads
the flight records every rank publishes (:mod:`spread.comm.flight`) through the store, never through
a collective, so a hung job answers too. Usage: ``python -m spread.cli._where HOST PORT ATTEMPT
WORLD_SIZE`` with the job token in ``SPREAD_JOB_TOKEN``; prints one line a rank.
"""

from __future__ import annotations

import os
import sys

_CONNECT_TIMEOUT = 5.0  # seconds to reach the store: the launcher bounds the whole report anyway


def main(argv: list[str]) -> int:
    from spread import env
    from spread.cluster.rendezvous import open_job_store
    from spread.comm.flight import describe_job, read_records

    host, port, attempt, world_size = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    try:
        token = os.environ.get(env.JOB_TOKEN, "")
        store, regrouped = open_job_store(host, port, token, attempt, _CONNECT_TIMEOUT)
    except (RuntimeError, ValueError) as exc:
        print(f"cannot read the job's store at {host}:{port}: {exc}".splitlines()[0])
        return 1
    if regrouped is not None:  # recovered without restart: the survivors, renumbered
        print(f"(the job regrouped after losing ranks: {regrouped} of {world_size} go on, numbered anew)")
        world_size = regrouped
    for line in describe_job(read_records(store, world_size), world_size):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
