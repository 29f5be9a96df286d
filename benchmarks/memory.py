"""W2 (GPT decoder: 4 layers, d_model 256, 4 heads, seq 128, vocab 8192, batch 16 sequences, AdamW):
activation memory and step time with no memory tool, activation checkpointing, activation offload and
gradient accumulation, all in the same run.

    flock /tmp/spread-bench.lock python benchmarks/memory.py [--reps 5] [--steps 3] [--threads 2]
        [--clock wall|cpu]

Memory, two measures of one training step:

* *peak above weights*: the most bytes of tensor storage alive at once during forward and backward
  that were allocated by them (a dispatch mode sees every op's outputs, weak references see them
  freed): activations, recomputed ones, gradients (20 MiB here, the same in every row) and
  temporaries. On a GPU, ``torch.cuda.max_memory_allocated`` over the same span is printed too.
* *saved for backward*: the bytes autograd keeps between forward and backward,
  ``spread.memory.SavedTensorBytes`` (deterministic; tensors inside checkpointed code are not kept).

Time: median step time (forward, backward, AdamW) over ``reps`` repetitions of ``steps`` steps after
2 warm-up steps, the configurations interleaved repetition by repetition so that load drifts hit them
alike; the overhead is the median over repetitions of each configuration's time over the plain one's
in the same repetition. ``--clock cpu`` times with the process's CPU time instead of the wall clock: with
``--threads 1`` that is the compute cost, much less sensitive to other jobs on a shared machine.

W2's largest activations are its logits (2,048 tokens x 8,192 = 64 MiB per copy), which block
checkpointing does not touch; ``checkpoint_chunks`` computes the head and loss in checkpointed token
slices. Offload on a CPU keeps the tensors where they are: there the row shows only the cost of the
hooks; its memory effect needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from spread.memory import (
    SavedTensorBytes,
    checkpoint_blocks,
    checkpoint_chunks,
    micro_batches,
    offload_module,
)

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 8192, 256, 4, 4, 128, 16
HEAD_CHUNKS = 8


class GPT(nn.Module):
    """The W2 decoder: token + position embeddings, pre-norm blocks with a causal mask, tied head."""

    def __init__(self, head_chunks: int | None = None) -> None:
        super().__init__()
        self.head_chunks = head_chunks
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                DIM, HEADS, 4 * DIM, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.ln = nn.LayerNorm(DIM)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of ``ids``."""
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        h, targets = h[:, :-1].reshape(-1, DIM), ids[:, 1:].reshape(-1)
        if self.head_chunks is None:
            return self._loss_sum(h, targets) / targets.numel()
        return sum(checkpoint_chunks(self._loss_sum, h, targets, chunks=self.head_chunks)) / targets.numel()

    def _loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.layer_norm(h, (DIM,), self.ln.weight, self.ln.bias) @ self.tok.weight.T
        return nn.functional.cross_entropy(logits, targets, reduction="sum")


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside this mode and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: set[weakref.ref] = set()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self._sizes:
                    size = storage.nbytes()
                    self._sizes[storage] = size
                    self._refs.add(weakref.ref(storage, partial(self._freed, size)))
                    self.live += size
                    self.peak = max(self.peak, self.live)
        return out

    def _freed(self, size: int, ref: weakref.ref) -> None:
        self.live -= size
        self._refs.discard(ref)


CONFIGS = {
    "none": "no memory tool",
    "checkpoint": "checkpoint every block",
    "checkpoint_head": f"checkpoint every block + head/loss in {HEAD_CHUNKS} checkpointed chunks",
    "checkpoint_half_head": "checkpoint every other block + chunked head",
    "offload": "offload saved activations (offload_module)",
    "accumulate4": "gradient accumulation, 4 micro-batches of 4",
}


def build(config: str, device: torch.device) -> tuple[nn.Module, Callable[..., None]]:
    torch.manual_seed(0)
    model = GPT(head_chunks=HEAD_CHUNKS if config.endswith("_head") else None).to(device)
    if config in ("checkpoint", "checkpoint_head"):
        checkpoint_blocks(model, every=1)
    elif config == "checkpoint_half_head":
        checkpoint_blocks(model, every=2)
    elif config == "offload":
        offload_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    steps = 4 if config == "accumulate4" else 1

    def step(ids: torch.Tensor, measure: PeakLiveBytes | None = None) -> None:
        optimizer.zero_grad(set_to_none=True)
        if measure is not None:
            measure.__enter__()
        for micro in micro_batches(ids, steps):
            (model(micro.data) * micro.weight).backward()
        if measure is not None:
            measure.__exit__(None, None, None)
        optimizer.step()

    return model, step


def measure_memory(config: str, device: torch.device, ids: torch.Tensor) -> dict[str, float]:
    model, step = build(config, device)
    step(ids)  # gradients and optimizer state exist before measuring, as in steady training
    with SavedTensorBytes(exclude=model.parameters()) as meter:
        loss = model(ids[: BATCH // 4] if config == "accumulate4" else ids)  # one (micro-)batch
    loss.backward()
    out = {"saved_mib": meter.bytes / 2**20}
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(ids)
        torch.cuda.synchronize()
        out["cuda_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    tracker = PeakLiveBytes()
    step(ids, tracker)
    out["peak_mib"] = tracker.peak / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(99)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(4)]

    memory = {c: measure_memory(c, device, data[0]) for c in args.configs}
    steps = {c: build(c, device)[1] for c in args.configs}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for c in args.configs:
        for i in range(2):
            steps[c](data[i])
    times: dict[str, list[float]] = {c: [] for c in args.configs}
    for _ in range(args.reps):
        for c in args.configs:
            sync()
            start = clock()
            for i in range(args.steps):
                steps[c](data[i % len(data)])
            sync()
            times[c].append((clock() - start) / args.steps)

    print(
        f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"device {device}, {args.threads} threads, {args.reps} reps x {args.steps} steps, {args.clock} clock"
    )
    base_peak = memory["none"]["peak_mib"] if "none" in memory else None
    base_time = statistics.median(times["none"]) if "none" in times else None
    cuda = device.type == "cuda"
    head = "| configuration | peak above weights (MiB) | vs none | saved for backward (MiB) | "
    head += "CUDA peak above weights (MiB) | " if cuda else ""
    head += "step ms median (min-max) | time vs none (median of paired ratios, min-max) |"
    print(head)
    print("| --- " + "| ---: " * (head.count("|") - 2) + "|")
    for c in args.configs:
        m, t = memory[c], times[c]
        med = statistics.median(t)
        row = f"| {CONFIGS[c]} | {m['peak_mib']:.1f} | "
        row += f"{m['peak_mib'] / base_peak:.2f}x | " if base_peak else "- | "
        row += f"{m['saved_mib']:.1f} | "
        row += f"{m['cuda_peak_mib']:.1f} | " if cuda else ""
        row += f"{1000 * med:.0f} ({1000 * min(t):.0f}-{1000 * max(t):.0f}) | "
        if base_time:
            # each repetition timed every configuration back to back: compare within a repetition
            ratios = [a / b for a, b in zip(t, times["none"], strict=True)]
            row += f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
        else:
            row += "- |"
        print(row)


if __name__ == "__main__":
    main()
