"""Memory per rank of ShardedStrategy at every stage and of its peers, in one run: model-state bytes
after a step and the peak resident memory of training, each configuration in processes of its own.

    python benchmarks/sharded_memory.py 2                     # W2, spread's configurations
    python benchmarks/sharded_memory.py 2 --workload gpt2 --peers [--json out.json]

Workloads: ``W2`` (GPT decoder, 4 layers, d 256, AdamW; ``benchmarks/workloads.py``) and ``gpt2``
(Hugging Face ``GPT2LMHeadModel`` from a ``GPT2Config``: 6 layers, d 384, 6 heads, sequence 128,
vocabulary 8192, 13.8 M parameters, 52.8 MiB; AdamW; ``benchmarks/model_families.py``), global
batch 16 sequences. Configurations: spread's MultiWorkerMirrored and ShardedStrategy at every stage
(and ``shard="parameters"`` with a unit per layer); with ``--peers`` also torch's
``DistributedDataParallel`` (``gradient_as_bucket_view=True``: its gradients are its buckets, so the
``.grad`` counted is all it holds), ``ZeroRedundancyOptimizer`` (AdamW) under that DDP, and FSDP2
(``fully_shard`` per layer and on the root) with ``reshard_after_forward=False`` (parameters stay
gathered from forward to the end of backward, ZeRO-2's memory during a step) and with its default
``True``.

Each configuration trains ``--steps`` steps (3) on the same global batches from the same weights;
then, before ``zero_grad``:

* *model state*: bytes of storage of parameters, gradients and optimizer state, each storage once:
  spread's ``Strategy.memory_report``; for the peers the same count over ``model.parameters()``
  (FSDP2: their local shards, with their padding), their ``.grad`` and the optimizer's state
  (``ZeroRedundancyOptimizer``: this rank's local optimizer's). Deterministic.
* *peak*: the resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) over
  model construction and the steps, less the resident set just before (after imports and the process
  group). glibc is told (``mallopt``) to map every allocation of 64 KiB or more on its own, so freed
  tensors leave the resident set at once (by default it keeps hundreds of MiB of freed memory in its
  arenas here); code pages the steps fault in count too (a few tens of MiB, about the same for every
  configuration). What a process really holds, communication buffers included, but it moves by
  several MiB from run to run and with the machine's load (the timing of collectives decides how
  long their buffers overlap).
* ``max |w - first|``: the weights after the steps against the first configuration's (0 when equal).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import spread
from spread.memory.report import optimizer_state_tensors, storage_bytes
from spread.testing import run_ranks

SPREAD_CONFIGS = {
    "MultiWorkerMirrored": None,
    'shard="optimizer"': {"shard": "optimizer"},
    'shard="gradients"': {"shard": "gradients"},
    'shard="parameters"': {"shard": "parameters"},
    'shard="parameters", units=layers': {"shard": "parameters", "units": "layers"},
}
PEER_CONFIGS = (
    "DDP",
    "ZeroRedundancyOptimizer",
    "FSDP2 reshard_after_forward=False",
    "FSDP2",
)
MIB = 2**20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _workload(name: str) -> tuple[nn.Module, Callable, Callable, Callable, int]:
    """``(model, loss_fn, make_optimizer, batch(step), global_batch)``, the same on every rank."""
    if name == "gpt2":
        import model_families

        model, loss_fn, make_optimizer, batch, global_batch = model_families.gpt2(
            layers=6, dim=384, heads=6, seq=128, vocab=8192
        )
        return model, loss_fn, make_optimizer, lambda step: batch(global_batch, seed=step), global_batch
    import workloads

    model, loss_fn, make_optimizer, batch, global_batch = workloads.make(name)
    return model, loss_fn, make_optimizer, lambda step: batch(global_batch), global_batch


def _layer_class(workload: str) -> type[nn.Module]:
    """The repeated layer: FSDP2's ``fully_shard`` units and spread's ``units=`` classes."""
    if workload == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    return nn.TransformerEncoderLayer


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _map_large_allocations() -> None:
    """glibc: allocations of 64 KiB or more in mappings of their own, returned when freed (and no
    dynamic threshold). Set inside the process: the launcher sets the environment too late for
    ``MALLOC_MMAP_THRESHOLD_``."""
    libc = ctypes.CDLL("libc.so.6")
    if not libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    libc.malloc_trim(0)


def _start_peak() -> int:
    """Reset the resident-set high-water mark; the resident set now."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_bytes("VmRSS")


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor shards


def _peer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[int]:
    """Parameters, gradients, optimizer state: bytes of storage, each once (as ``memory_report``)."""
    seen: set[int] = set()
    params = list(model.parameters())
    return [
        storage_bytes([_local(p) for p in params], seen),
        storage_bytes([_local(p.grad) for p in params], seen),
        storage_bytes([_local(t) for t in optimizer_state_tensors(optimizer)], seen),
    ]


def _job(workload: str, config: str, steps: int) -> dict:
    torch.set_num_threads(1)
    _map_large_allocations()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    options = SPREAD_CONFIGS.get(config)
    if options is None:  # MultiWorkerMirrored; for the peers it only owns the process group
        strategy: spread.Strategy = spread.MultiWorkerMirroredStrategy()
    else:
        units = (_layer_class(workload),) if options.get("units") == "layers" else "model"
        strategy = spread.ShardedStrategy(shard=options["shard"], units=units)
    try:
        baseline = _start_peak()
        activations = None
        if config in SPREAD_CONFIGS:
            with strategy.scope():
                model, loss_fn, make_optimizer, batch, global_batch = _workload(workload)
                optimizer = make_optimizer(model.parameters())
            strategy.prepare_optimizer(optimizer)

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                strategy.run(lambda: loss_fn(model(x), y).backward())

            def weights() -> dict[str, torch.Tensor]:
                return strategy.full_state_dict(model)

            def state() -> list[int]:
                report = strategy.memory_report(optimizer)
                return [report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes]
        else:
            model, loss_fn, make_optimizer, batch, global_batch = _workload(workload)
            trained = _wrap_peer(config, workload, model, world)
            if config == "ZeroRedundancyOptimizer":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                # Both workloads' optimizer: AdamW(lr=3e-4).
                zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=3e-4)
                optimizer, local_optimizer = zero, zero.optim
            else:
                optimizer = local_optimizer = make_optimizer(model.parameters())

            def step(x: torch.Tensor, y: torch.Tensor) -> None:
                loss_fn(trained(x), y).backward()

            def weights() -> dict[str, torch.Tensor]:
                return {k: _full(v) for k, v in model.state_dict().items()}

            def state() -> list[int]:
                return _peer_state(model, local_optimizer)

        local = global_batch // world
        for s in range(steps):
            x, y = batch(s)
            x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
            optimizer.zero_grad()
            if config in SPREAD_CONFIGS and s == steps - 1:
                with strategy.measure_activations():
                    step(x, y)
                activations = strategy.memory_report().activation_bytes
            else:
                step(x, y)
            optimizer.step()
        sizes = state()
        peak = _status_bytes("VmHWM") - baseline
        full = weights()
        return {
            "state": sizes,
            "peak": peak,
            "activations": activations,
            "weights": full if rank == 0 else None,
        }
    finally:
        strategy.close()


def _wrap_peer(config: str, workload: str, model: nn.Module, world: int) -> nn.Module:
    """The module that trains: DDP around ``model``, or ``model`` itself with FSDP2 applied."""
    if config in ("DDP", "ZeroRedundancyOptimizer"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, gradient_as_bucket_view=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    reshard = config == "FSDP2"
    layer = _layer_class(workload)
    for module in model.modules():
        if isinstance(module, layer):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _full(value: Any) -> Any:
    return value.full_tensor() if hasattr(value, "full_tensor") else value.detach().clone()


def _predicted_activations(workload: str, nprocs: int) -> float:
    """``spread plan``'s activation bytes per device over ``nprocs`` replicas (profiled here; W2's
    loss takes the model's output tensor, as the profiler passes it)."""
    from spread.plan.workload import measure_model

    model, loss_fn, _, batch, global_batch = _workload(workload)
    x, y = batch(0)
    profile = measure_model(model, loss_fn, x, y, repeats=1)
    return profile.activation_bytes_per_sample * (global_batch // nprocs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nprocs", type=int, nargs="?", default=2)
    parser.add_argument("--workload", default="W2", choices=("W2", "gpt2"))
    parser.add_argument("--peers", action="store_true", help="also DDP, ZeroRedundancyOptimizer, FSDP2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    configs = [*((PEER_CONFIGS[0],) if args.peers else ()), *SPREAD_CONFIGS, *PEER_CONFIGS[1:] * args.peers]
    results: dict[str, list[dict]] = {}
    first: dict[str, torch.Tensor] | None = None
    for config in configs:
        per_rank = run_ranks(_job, args.nprocs, args=(args.workload, config, args.steps), timeout=590)
        weights = per_rank[0].pop("weights")
        first = first if first is not None else weights
        common = [k for k in first if k in weights]
        diff = max(float((weights[k].float() - first[k].float()).abs().max()) for k in common)
        results[config] = [{**r, "max_weight_difference": diff} for r in per_rank]
        print(f"  done: {config}", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "nprocs": args.nprocs, "results": results}, f, indent=1)
    print(
        f"{args.workload}, AdamW, {args.nprocs} processes, {args.steps} steps; MiB per rank "
        f"(rank 0 / rank 1 ...); model state after the last step, before zero_grad"
    )
    header = ("configuration", "parameters", "gradients", "optim state", "model state", "peak RSS")
    print(f"{header[0]:34} " + " ".join(f"{h:>17}" for h in header[1:]) + "  max |w - first|")
    for config, per_rank in results.items():
        columns = [
            [r["state"][0], r["state"][1], r["state"][2], sum(r["state"]), r["peak"]] for r in per_rank
        ]
        cells = [" / ".join(f"{c[i] / MIB:.1f}" for c in columns) for i in range(5)]
        diff = per_rank[0]["max_weight_difference"]
        print(f"{config:34} " + " ".join(f"{c:>17}" for c in cells) + f"  {diff:.1e}")
    print("bytes of rank 0 (model state; activations saved for backward in the last step, spread only):")
    for config, per_rank in results.items():
        measured = per_rank[0]["activations"]
        saved = f"  activations {measured:,}" if measured is not None else ""
        print(f"  {config:34} {sum(per_rank[0]['state']):>13,}{saved}")
    if args.workload != "W2":
        return
    predicted = _predicted_activations(args.workload, args.nprocs)
    measured = results["MultiWorkerMirrored"][0]["activations"]
    ratio = predicted / measured
    print(f"spread plan predicts {predicted:,.0f} activation bytes per device ({ratio:.4f}x measured)")


if __name__ == "__main__":
    main()
