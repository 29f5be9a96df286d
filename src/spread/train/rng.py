"""Every rank's random streams in a checkpoint, so a resumed run draws what the uninterrupted one would.

torch's generator (CPU, and the current GPU's where there is one: dropout on a GPU draws from it) of
every rank, gathered to the chief with the ranks' numbers; Python's and NumPy's global state of the
rank that saves. A rank the checkpoint has no stream for (resumed at more replicas) gets its own,
derived from a saved one: it cannot repeat what ranks that no longer exist would have drawn.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from spread.strategies import Strategy


def states(strategy: Strategy) -> dict[str, Any]:
    """This job's RNG states (collective: gathers every rank's torch state where the strategy can)."""
    rows = strategy.gather_from_every_rank(_torch_states().unsqueeze(0))
    ranks = strategy.gather_from_every_rank(torch.tensor([[strategy.rank]], dtype=torch.int64))
    version, internal, gauss = random.getstate()
    return {
        "torch": rows.cpu(),
        "ranks": ranks.reshape(-1).cpu(),
        "python": (version, list(internal), gauss),
        "numpy": torch.from_numpy(_numpy_state()[1].astype(np.int64)),
    }


def restore(saved: dict[str, Any], rank: int) -> None:
    """Set this process's streams from :func:`states`: torch's from ``rank``'s row (a derived stream
    where there is none), Python's and NumPy's as saved."""
    rows = saved["torch"]
    ranks = saved["ranks"].tolist()
    cpu_bytes = torch.get_rng_state().numel()
    if rank in ranks:
        row = rows[ranks.index(rank)]
        torch.set_rng_state(row[:cpu_bytes].clone())
        if row.numel() > cpu_bytes and torch.cuda.is_available():  # saved on a GPU, resumed on one
            torch.cuda.set_rng_state(row[cpu_bytes:].clone())
    else:
        cpu_state = rows[rank % len(rows)][:cpu_bytes].clone()
        generator = torch.Generator().set_state(cpu_state)
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)) + rank)  # seeds GPUs too
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = _numpy_state()
    np.random.set_state((np_state[0], saved["numpy"].numpy().astype(np.uint32), *np_state[2:]))


def _torch_states() -> torch.Tensor:
    cpu = torch.get_rng_state()
    if torch.cuda.is_available():
        return torch.cat([cpu, torch.cuda.get_rng_state()])
    return cpu


def _numpy_state() -> tuple[Any, ...]:
    """NumPy's global RNG state as the legacy tuple (``(name, keys, pos, has_gauss, gauss)``)."""
    state = np.random.get_state(legacy=True)
    if not isinstance(state, tuple):
        raise RuntimeError("numpy returned its RNG state as a dict with legacy=True")
    return state
