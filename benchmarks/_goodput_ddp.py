"""``goodput.py``'s torchrun mode: W1 as a plain DDP script with ``torch.distributed.checkpoint``,
written the way PyTorch's DDP tutorial teaches (``torchrun --nnodes 1:2 --max-restarts K``): every
``--save-every`` steps the ranks save the model, optimizer and step with DCP; a restarted job loads
the newest complete checkpoint and goes on from its step. Nothing handles SIGTERM, so steps since the
last save are trained again after any restart. The global batch is kept at any world size (each
rank takes ``global batch / world size``), so a step is the same work in every mode.

    torchrun ... _goodput_ddp.py --steps 960 --batches 16 --save-every 20 --backup-dir D --out W.pt
        --started S
"""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _goodput_workload import W1Data, mark_first_step, model_and_optimizer, save_weights, script_arguments
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

_PREFIX = "step-"


class TrainState(Stateful):
    """What a checkpoint holds; DCP calls ``state_dict`` on save and ``load_state_dict`` on load."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        self.step = state["step"]


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoints DCP finished writing (it writes ``.metadata`` last), oldest first."""
    found = [p for p in root.glob(f"{_PREFIX}*") if (p / ".metadata").exists()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def main() -> None:
    parser = script_arguments(__doc__.splitlines()[0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = W1Data(args.batches, quick=args.quick)
    model, loss_fn, optimizer = model_and_optimizer(quick=args.quick)
    ddp = DistributedDataParallel(model)
    state = TrainState(model, optimizer)
    root = Path(args.backup_dir)
    saved = complete_checkpoints(root)
    if saved:
        dcp.load({"train": state}, checkpoint_id=saved[-1])
        print(f"rank {rank}: resumed from {saved[-1].name} at world size {world}", flush=True)
    state_start = state.step
    for step in range(state.step, args.steps):
        inputs, targets = data.slice_at(step, rank, world)
        optimizer.zero_grad()
        loss_fn(ddp(inputs), targets).backward()
        optimizer.step()
        state.step = step + 1
        if rank == 0 and step == state_start:
            mark_first_step(args.started)
        if state.step % args.save_every == 0 and state.step < args.steps:
            dcp.save({"train": state}, checkpoint_id=root / f"{_PREFIX}{state.step}")
            if rank == 0:  # keep the newest two
                for old in complete_checkpoints(root)[:-2]:
                    shutil.rmtree(old, ignore_errors=True)
    if rank == 0:
        save_weights(model, args.out)
    dist.barrier()  # no rank leaves while another still needs the group
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
