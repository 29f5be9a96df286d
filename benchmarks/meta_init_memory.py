"""Peak resident memory per rank of building a model of 1.5 GB of float32 parameters and training it
two steps at 4 processes: spread's ShardedStrategy with the model built on the meta device, against
MultiWorkerMirrored (built normally), ShardedStrategy built normally, and FSDP2 with meta init.

    python benchmarks/meta_init_memory.py [--nprocs 4 --layers 23 --width 4096]

The model: ``layers`` x (Linear(width, width) + ReLU), 23 x 4096 = 386 M parameters, 1.545 GB;
SGD without momentum (no optimizer state: the table is about parameters and gradients), batch 4 per
rank, 1 thread per process; the sharded ones with each Linear a unit (FSDP2: ``fully_shard`` on
each Linear, then the root). Each configuration runs as its own job, one after another.

Memory is ``VmHWM`` from ``/proc/self/status`` (the process's peak resident set) above ``VmRSS``
when the job had joined and built nothing yet: once after building (reset then, by writing 5 to
``/proc/self/clear_refs``), once after two steps, with glibc's mmap threshold fixed at 64 KB
(``MALLOC_MMAP_THRESHOLD_``) so that freed tensors leave the resident set. FSDP2's meta init is
FSDP2's documented way: ``fully_shard`` on the meta model, ``to_empty``, then ``reset_parameters()``
of each Linear on its shards.

``--check-values`` instead builds a small model (3 Linear layers) each way at 2 processes and prints
how far each rank's initial weights are from one device's built with the same seed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import spread
from spread.testing import run_ranks

CONFIGS = ("sharded, meta", "FSDP2, meta", "sharded, built whole", "mirrored, built whole")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _build(kind: str, strategy: spread.Strategy, layers: int, width: int) -> tuple[nn.Module, Callable]:
    """The model, and a training step on a batch."""
    if kind == "FSDP2, meta":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = _model(layers, width)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

        def fsdp_step(x: torch.Tensor) -> None:
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()

        return model, fsdp_step
    meta = torch.device("meta") if kind == "sharded, meta" else contextlib.nullcontext()
    with strategy.scope(), meta:
        model = _model(layers, width)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        strategy.run(lambda: model(x).pow(2).mean().backward())
        optimizer.step()

    return model, step


def _strategy(kind: str) -> spread.Strategy:
    if kind.startswith("sharded"):
        return spread.ShardedStrategy("parameters", units=(nn.Linear,))
    return spread.MultiWorkerMirroredStrategy("native")  # gloo's all-reduce; FSDP2 runs on its group


def _job(kind: str, layers: int, width: int) -> dict[str, int]:
    torch.set_num_threads(1)
    strategy = _strategy(kind)
    try:
        start = _status("VmRSS")
        _reset_peak()
        model, step = _build(kind, strategy, layers, width)
        built = _status("VmHWM") - start
        _reset_peak()
        x = torch.randn(4, width)
        for _ in range(2):
            step(x)
        trained = _status("VmHWM") - start
        del model
        return {"start": start, "built": built, "trained": trained}
    finally:
        strategy.close()


def _values_job(kind: str) -> float:
    """Max |initial weight - one device's| over this rank's view of a small model."""
    torch.set_num_threads(1)
    expected = _model(3, 64).state_dict()
    strategy = _strategy(kind)
    try:
        model, _ = _build(kind, strategy, 3, 64)
        if kind == "FSDP2, meta":
            got = {k: v.full_tensor() for k, v in model.state_dict().items()}
        else:
            got = strategy.full_state_dict(model)
        return max(float((got[k] - v).abs().max()) for k, v in expected.items())
    finally:
        strategy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--layers", type=int, default=23)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--check-values", action="store_true")
    args = parser.parse_args()
    # Tensors mapped and unmapped on their own: glibc would otherwise raise its mmap threshold after
    # the first large free and keep freed tensors in its heap, counted as resident (up to 320 MB per
    # rank here). Read when a process starts, so set before the ranks are spawned.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = os.environ.get("MALLOC_MMAP_THRESHOLD_", str(2**16))
    env = {"OMP_NUM_THREADS": "1"}
    if args.check_values:
        print("max |initial weight - one device's|, 3 x Linear(64, 64), 2 processes, per rank")
        for kind in CONFIGS:
            diffs = run_ranks(_values_job, 2, args=(kind,), timeout=120, env=env)
            print(f"  {kind:22} " + "  ".join(f"{d:.2e}" for d in diffs))
        return
    params = args.layers * (args.width * args.width + args.width)
    model_bytes = params * 4
    print(
        f"{args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.0f} M parameters, "
        f"{model_bytes / 1e9:.3f} GB float32; {args.nprocs} processes x 1 thread, SGD, batch 4 per rank"
    )
    print("peak resident memory above the start, per rank: MB (x model bytes); max over ranks")
    print(f"  {'configuration':22} {'build':>16} {'build + 2 steps':>18}   start RSS MB")
    for kind in CONFIGS:
        results = run_ranks(_job, args.nprocs, args=(kind, args.layers, args.width), timeout=590, env=env)
        built = max(r["built"] for r in results)
        trained = max(r["trained"] for r in results)
        start = max(r["start"] for r in results)
        print(
            f"  {kind:22} {built / 1e6:>8,.0f} ({built / model_bytes:.2f}x) "
            f"{trained / 1e6:>10,.0f} ({trained / model_bytes:.2f}x)   {start / 1e6:,.0f}"
        )


if __name__ == "__main__":
    main()
