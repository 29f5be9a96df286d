"""W1 as every mode of ``goodput.py`` trains it: the same model, data, step order and weights file.

Each mode's script (spread, plain DDP under torchrun, torchft) imports this, so their rows differ
only in how they survive a lost node. Step ``s`` trains on global batch ``s % batches`` of a fixed
synthetic set (no shuffle: the order is a function of the step alone, whichever world size or
restart reaches it), and each replica takes its contiguous slice of that batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import workloads


class W1Data:
    """``batches`` global batches of W1's synthetic data, made alike in every process."""

    def __init__(self, batches: int, *, quick: bool = False) -> None:
        _, _, _, make_batch, self.global_batch = workloads.make("W1", quick=quick)
        self.batches = batches
        self.inputs, self.targets = make_batch(batches * self.global_batch)

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step % self.batches) * self.global_batch
        end = start + self.global_batch
        return self.inputs[start:end], self.targets[start:end]

    def slice_at(self, step: int, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replica ``index`` of ``count``'s share of step ``step``'s global batch."""
        if self.global_batch % count:
            raise ValueError(f"W1's global batch {self.global_batch} does not split into {count} replicas")
        per = self.global_batch // count
        inputs, targets = self.global_batch_at(step)
        return inputs[index * per : (index + 1) * per], targets[index * per : (index + 1) * per]


def model_and_optimizer(*, quick: bool = False) -> tuple[nn.Module, Callable, torch.optim.Optimizer]:
    """W1's seeded model (alike in every process), its loss and its optimizer (SGD, lr 0.01)."""
    model, loss_fn, make_optimizer, _, _ = workloads.make("W1", quick=quick)
    return model, loss_fn, make_optimizer(model.parameters())


def mark_first_step(path: str) -> None:
    """Say that training has begun (``goodput.py --kill-clock first-step`` times its kills from it)."""
    Path(path).touch()


def save_weights(model: nn.Module, path: str) -> None:
    """The final weights, written atomically (a file that exists is whole)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, partial)
    os.replace(partial, target)


def script_arguments(description: str) -> argparse.ArgumentParser:
    """The arguments the harness gives every mode's training script."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    parser.add_argument("--backup-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--started", required=True, help="a file rank 0 creates after its first step")
    parser.add_argument("--quick", action="store_true")
    return parser
