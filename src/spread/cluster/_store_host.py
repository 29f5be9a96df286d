"""The job's rendezvous store, hosted beside the ranks as torchrun's agent hosts it.

``spread run`` binds the rendezvous socket on node 0 and starts this module once per job with the
open listening socket (``python -m spread.cluster._store_host FD HOST PORT``). It serves a
``torch.distributed.TCPStore`` on that socket until its stdin closes: the launcher holds the write
end of that pipe, so the store outlives every restart of the ranks and ends with the launcher (and
with ``PR_SET_PDEATHSIG``, even when the launcher is SIGKILLed).

Why a process of its own and not a thread of the launcher: hosting a ``TCPStore`` needs torch, which
the launcher must not import (it forks the ranks, and forking beside the store's C++ threads is
unsafe; it must also start in milliseconds). Every rank connects as a client, so a plain
``init_process_group("gloo")`` (``TORCHELASTIC_USE_AGENT_STORE=True``) and spread's rendezvous share
one store under per-attempt prefixes, exactly as under torchrun.
"""

from __future__ import annotations

import sys
from datetime import timedelta


def serve(fd: int, host: str, port: int) -> None:
    """Host the store on the listening socket ``fd`` (bound to ``host:port``) until stdin closes."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host, port, None, True, timedelta(seconds=60), wait_for_workers=False, master_listen_fd=fd
    )
    sys.stdin.buffer.read()  # EOF when the launcher closes the pipe or dies
    del store


def main(argv: list[str]) -> int:
    fd, host, port = int(argv[0]), argv[1], int(argv[2])
    try:
        serve(fd, host, port)
    except KeyboardInterrupt:  # a Ctrl-C that reached this process group: the launcher decides
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
