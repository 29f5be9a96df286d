"""``torch.compile`` and the bucketed gradient exchange: graph breaks at bucket boundaries.

Why this exists: AOTAutograd turns a compiled graph's backward into one autograd node, so every
parameter of the graph gets its gradient when that node returns, at the very end of backward. The
reducer's per-parameter hooks then all fire together and no bucket's all-reduce overlaps backward
compute (measured on W1/W2: eager's first gradient is ready 2-30% into backward, a compiled
model's at 100%; ``docs/results/2026-11-25-compile-overlap.md``).

DDP solves this with dynamo's ``DDPOptimizer`` (``torch._dynamo.backends.distributed``): it walks the
captured graph backwards (the order backward produces gradients), cuts it wherever the parameter
bytes reach the bucket cap, and compiles each piece on its own with the user's backend; each piece's
backward is then its own node, and the gradients of the last layers are ready while earlier pieces
still compute. torch 2.13 has no public switch for modules that are not DDP: dynamo applies
``DDPOptimizer`` to any frame it compiles while ``DistributedDataParallel._active_ddp_module`` is
set, reading only the object's ``bucket_bytes_cap`` (DDP sets it around its forward; torch's
composable ``replicate`` sets it from forward hooks; ``torch/_dynamo/convert_frame.py``).
:func:`bucket_graph_breaks` sets it, around a replica step, to a small object carrying spread's
bucket cap; ``MultiWorkerMirroredStrategy.run`` enters it where the reducer can overlap backward at
all (``GradientReducer.overlaps_backward``: more than one bucket, and an algorithm whose asynchronous
all-reduce runs while backward computes; ``shm`` defers it to ``wait()``). Elsewhere a cut only costs
fusion.

What follows from that hook:

* it acts when dynamo *compiles* a frame, which is at the first call of a compiled model (and at each
  recompilation). A compiled model first called with gradients outside ``strategy.run`` keeps the
  unsplit graph compiled there (it still trains correctly; it only overlaps nothing). So does one
  whose class was compiled earlier in the process outside the cut: dynamo's guards do not tell two
  instances of one class apart and reuse that graph;
* ``torch._dynamo.config.optimize_ddp`` must keep its default (``True``, ``"ddp_optimizer"``); the
  user's ``False`` is honoured (no split). Any ``torch.compile`` backend is kept for each piece;
* the pieces follow ``DDPOptimizer``'s rule: the first piece closes at about 1 MB of parameters
  (DDP's small first bucket), each later one at the first parameter that reaches the cap; a spread
  bucket ends *before* the parameter that would overflow it, so a bucket may wait for the end of
  the next piece. Finer pieces would align better and fuse less; the cap is the reducer's own,
  raised to 1 MB when smaller (``DDPOptimizer`` refuses a cap below its first piece);
* the slot is process-global: it suits one replica per process (MultiWorkerMirrored, a pipeline's
  stage replicas). Thread replicas (Mirrored) share parameters and accumulate in place without a
  bucketed exchange, so they need no split.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class _BucketCap:
    """What dynamo reads from the active DDP module: the bucket size in bytes."""

    bucket_bytes_cap: int


@contextmanager
def bucket_graph_breaks(bucket_cap_bytes: int) -> Iterator[None]:
    """Graphs dynamo compiles inside this block are split every ``bucket_cap_bytes`` of parameters
    (in backward order), so their gradients become ready piece by piece during backward.

    Nesting restores the previous value (as DDP does); not for concurrent threads (process-global).
    """
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be positive, got {bucket_cap_bytes!r}")
    # DDPOptimizer refuses a cap below its first piece (1 MB, torch's first DDP bucket): smaller
    # reducer buckets get 1 MB pieces, so a few buckets become ready together.
    cap = max(bucket_cap_bytes, dist._DEFAULT_FIRST_BUCKET_BYTES)
    previous = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = _BucketCap(cap)  # type: ignore[assignment]
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = previous


def compiled_kind(module: nn.Module) -> str | None:
    """How ``module`` itself is compiled: ``"torch.compile"`` (an ``OptimizedModule`` wrapper),
    ``"module.compile()"`` (compiled in place), or ``None``. Its submodules are not looked at."""
    from torch._dynamo.eval_frame import OptimizedModule  # here: importing dynamo takes ~0.8 s

    if isinstance(module, OptimizedModule):
        return "torch.compile"
    if module._compiled_call_impl is not None:
        return "module.compile()"
    return None
