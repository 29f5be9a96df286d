"""``goodput.py``'s torchft mode: W1 under torchft's fault-tolerant DDP, one replica group per process
(as torchft's ``train_ddp.py`` runs DDP), ``--groups`` groups in all, coordinated by a lighthouse.

Surviving groups keep training through a lost one without a restart: each step's quorum is the
groups alive then, and the gradient is averaged over them, so a step trains on the slices of the
groups present (the batch changes while a node is down). A group that comes back fetches the weights
from a live peer (torchft's HTTP transport) and joins at the next quorum. Step ``s`` is torchft's
committed step count, which picks the global batch: the same order as the other modes.

torchft 0.2.0's ``DistributedDataParallel`` cannot survive a lost peer on CPU: its comm hook waits on
the all-reduce, ``_ManagedWork.wait`` catches gloo's "Connection closed by peer", reports it and
returns before the future chain exists, and the hook's ``assert fut._fut`` then kills the survivor
(``torchft/ddp.py``, ``_comm_hook``; later steps of an errored manager get a ``_DummyWork`` whose
plain future has no ``_fut`` at all). :class:`TolerantDDP` is that class with the hook fixed: when
the all-reduce fails it hands back the local bucket, as torchft intends (the manager has recorded
the error, so ``should_commit`` discards the step). ``--as-shipped`` runs torchft's own hook.

    python _goodput_torchft.py --group G --groups 4 --lighthouse http://HOST:PORT --steps 960 ...
"""

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from _goodput_workload import W1Data, mark_first_step, model_and_optimizer, save_weights
from torch import distributed as dist
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo


class TolerantDDP(DistributedDataParallel):
    """torchft's DDP whose comm hook survives a failed all-reduce (see the module's docstring). The
    module has no ``from __future__ import annotations``: DDP checks the hook's annotations as types."""

    @staticmethod
    def _comm_hook(state: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        work = state.allreduce(bucket.buffer())
        if work.wait():
            chained = getattr(work.get_future(), "_fut", None)  # a _ManagedWork's future chain
            if chained is not None:
                return chained
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())  # this step will not commit: its gradient is discarded
        return done


def wait_for_groups(ready_dir: Path, group: int, groups: int, timeout: float) -> None:
    """Start training once every group has heartbeated to the lighthouse once, as a rendezvous waits
    for its nodes: torchft would otherwise let the first group train alone until the others come up.
    A group that comes back later finds every mark already there and joins at the next quorum."""
    ready_dir.mkdir(parents=True, exist_ok=True)
    (ready_dir / str(group)).touch()
    deadline = time.monotonic() + timeout
    while len(list(ready_dir.iterdir())) < groups:
        if time.monotonic() > deadline:
            raise SystemExit(f"group {group}: the other groups did not start within {timeout:g}s")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--started", required=True, help="a file group 0 creates after its first step")
    parser.add_argument("--ready-dir", required=True, help="the groups' start line (see wait_for_groups)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for a collective or quorum")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--as-shipped", action="store_true", help="torchft's own DDP comm hook")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = W1Data(args.batches, quick=args.quick)
    model, loss_fn, optimizer = model_and_optimizer(quick=args.quick)
    timeout = timedelta(seconds=args.timeout)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    # The group's own store (a group of one process hosts it); torchft's manager connects to it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timeout,
        quorum_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"goodput_{args.group}",
        # Every group starts from the same seeded weights: torchft's documented setting for that. With
        # the default (True) the groups other than one heal at step 0 and their slices of the first
        # batch are dropped, so even the uninterrupted run trains another first step than the rest.
        init_sync=False,
    )
    wait_for_groups(Path(args.ready_dir), args.group, args.groups, timeout=120.0)
    ddp = (DistributedDataParallel if args.as_shipped else TolerantDDP)(manager, model)
    ft_optimizer = Optimizer(manager, optimizer)
    while manager.current_step() < args.steps:
        inputs, targets = data.slice_at(manager.current_step(), args.group, args.groups)
        ft_optimizer.zero_grad()  # starts the step's quorum
        loss_fn(ddp(inputs), targets).backward()
        ft_optimizer.step()  # commits only if every group in the quorum succeeded
        if args.group == 0 and manager.current_step() == 1:
            mark_first_step(args.started)
    print(f"group {args.group}: done at step {manager.current_step()}", flush=True)
    if args.group == 0:
        save_weights(model, args.out)
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's background threads and servers would hold the process open


if __name__ == "__main__":
    main()
