"""Model-state and activation bytes per rank on W2 (GPT decoder, AdamW) after one step:
MultiWorkerMirrored and ShardedStrategy at every stage, in the same job (``Strategy.memory_report``
with the step run under ``Strategy.measure_activations``; bytes of storage, not timings, so a shared
machine does not disturb them). The last line is what ``spread plan`` predicts for the activations
of one replica's batch (the same meter, at the profiled batch, scaled per sample).

    python benchmarks/sharded_memory.py 2      # processes (2 and 4 in docs/architecture.md)

Each configuration trains one step on the same global batch from the same weights; the printed
``max |w - mirrored|`` checks that the sharded weights equal MultiWorkerMirrored's after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch import nn
from workloads import make

import spread
from spread.plan.workload import measure_model
from spread.testing import run_ranks

CONFIGS = {
    "optimizer": {"shard": "optimizer"},
    "gradients": {"shard": "gradients"},
    "parameters": {"shard": "parameters"},
    "parameters, units=layers": {"shard": "parameters", "units": (nn.TransformerEncoderLayer,)},
}


def _one_step(strategy: spread.Strategy) -> tuple[list[int], dict]:
    with strategy.scope():
        model, loss_fn, make_optimizer, batch, global_batch = make("W2")
        optimizer = make_optimizer(model.parameters())
    strategy.prepare_optimizer(optimizer)
    x, y = batch(global_batch // strategy.num_replicas_in_sync)
    with strategy.measure_activations():
        strategy.run(lambda: loss_fn(model(x), y).backward())
    optimizer.step()
    report = strategy.memory_report(optimizer)
    sizes = [report.parameter_bytes, report.gradient_bytes, report.optimizer_state_bytes]
    return [*sizes, report.model_state_bytes, report.activation_bytes], strategy.full_state_dict(model)


def _predicted_activations(nprocs: int) -> float:
    """``spread plan``'s activation bytes per device for W2 over ``nprocs`` replicas (profiled here)."""
    model, loss_fn, _, batch, global_batch = make("W2")
    x, y = batch(global_batch)
    profile = measure_model(model, loss_fn, x, y, repeats=1)
    return profile.activation_bytes_per_sample * (global_batch // nprocs)


def _job() -> dict:
    owner = spread.MultiWorkerMirroredStrategy()  # owns the process group; the others reuse it
    try:
        out: dict = {}
        out["mirrored"], reference = _one_step(owner)
        for name, options in CONFIGS.items():
            with spread.ShardedStrategy(**options) as strategy:
                sizes, weights = _one_step(strategy)
            diff = max(float((weights[k] - reference[k]).abs().max()) for k in reference)
            out[name] = [*sizes, diff]
        return out
    finally:
        owner.close()


def main() -> None:
    nprocs = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    results = run_ranks(_job, nprocs, timeout=550)
    mirrored = results[0]["mirrored"][3]
    print(f"W2, AdamW, {nprocs} processes, rank 0, bytes after one step (before zero_grad)")
    header = ("configuration", "parameters", "gradients", "optim state", "model state", "activations")
    print(f"{header[0]:26} " + " ".join(f"{h:>11}" for h in header[1:]) + "  ratio")
    for name, row in results[0].items():
        extra = f"  max |w - mirrored| {row[5]:.1e}" if len(row) > 5 else ""
        sizes = " ".join(f"{v:>11,}" for v in row[:5])
        print(f"{name:26} {sizes}  {row[3] / mirrored:.2f}{extra}")
    predicted = _predicted_activations(nprocs)
    measured = results[0]["mirrored"][4]
    ratio = predicted / measured
    print(f"spread plan predicts {predicted:,.0f} activation bytes per device ({ratio:.4f}x measured)")


if __name__ == "__main__":
    main()
